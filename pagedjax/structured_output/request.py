"""One constrained sequence's grammar state: its compiled grammar (a future shared by every
request with the same constraint) and its own matcher, advanced token by token.

The scheduler owns it, through `engine.request.Request.structured_output`. The matcher is a
copy of the compiled grammar's initial matcher, made when the sequence first needs a mask; it
has consumed exactly the sequence's output tokens, so a preempted sequence (recomputed or
swapped) keeps it unchanged and the n samples of a prompt each have their own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import llguidance as llg

if TYPE_CHECKING:
    from pagedjax.structured_output.compilation import Compilation


class StructuredOutputRequest:
    """The constraint state of one sequence.

    Args:
        kind: the constraint's kind ("json", "regex", "choice", "grammar", "json_object").
        compilation: what compiles its grammar (`compilation.Compilation`, shared by every
            request with the same constraint). Its `future` is `compiled`: the grammar's
            initial `llguidance.LLMatcher` (never advanced; copied per sequence), raising the
            compile error if the grammar is invalid; it is settled by `is_ready`.
    """

    def __init__(self, kind: str, compilation: Compilation):
        self.kind = kind
        self.compilation = compilation
        self.compiled = compilation.future
        self.matcher: llg.LLMatcher | None = None
        self.error: str | None = None  # why the sequence cannot go on, once it cannot

    def is_ready(self) -> bool:
        """The grammar finished compiling (successfully or not); takes its result if a run
        has just finished (`Compilation.poll`)."""
        return self.compilation.poll()

    def waited(self) -> float:
        """Seconds since its grammar's compilation started."""
        return time.monotonic() - self.compilation.started

    def expedite(self) -> None:
        """Has its grammar also compile at normal priority (`compilation.Compilation`)."""
        self.compilation.expedite()

    def compile_error(self) -> str | None:
        """The compile error once compiled (None if it compiled)."""
        e = self.compiled.exception()
        return None if e is None else str(e)

    def get_matcher(self) -> llg.LLMatcher:
        """This sequence's matcher (made on first use; the grammar must be ready)."""
        if self.matcher is None:
            self.matcher = self.compiled.result().deep_copy()
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advances the matcher by a sampled token. False (and `error` set) if the grammar
        rejects it, which the mask should have made impossible."""
        m = self.get_matcher()
        if m.consume_token(token_id):
            return True
        self.error = f"token {token_id} violates the {self.kind} constraint: {m.get_error()}"
        return False

    def release(self) -> list:
        """Drops this sequence's references to its compiled grammar and its own matcher, and
        returns them in a list (for `CompilePools.release`, through the manager's `release`).
        The matcher is a copy that shares the compiled grammar's parts, so whichever of the two
        goes last frees the grammar (8-13 ms holding the GIL for a schema of 400 distinct
        objects). Call once, when the sequence has ended; nothing else after."""
        box = [self.compilation, self.compiled, self.matcher]
        self.compilation = self.compiled = self.matcher = None
        return box

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self.matcher is not None and self.matcher.is_stopped()
