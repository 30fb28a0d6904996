"""SamplingParams: vLLM's field names, defaults, meanings and validation.

Each field means what vLLM's documentation says it means (and OpenAI's, where OpenAI defines
the field). Out-of-range values raise `InvalidInputError` (a `ValueError`) whose `param` is
the field.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

from pagedjax.errors import InvalidInputError

_SAMPLING_EPS = 1e-5


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams` names).

    Exactly one kind is set:
        json: a JSON schema (dict, or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar (Lark syntax, or GBNF/EBNF as llguidance accepts).
        json_object: True: any JSON object.
    Optional: whitespace_pattern (a regex for the whitespace allowed between JSON tokens,
    None: the constraint engine's default).

    Raises InvalidInputError (param "structured_outputs") when no kind or more than one is set
    or a field has the wrong type; whether a schema, regex or grammar compiles is checked by
    the engine when the request is added (also an InvalidInputError).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidInputError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}",
                param="structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidInputError(
                "structured_outputs.json must be a JSON schema (a dict or its JSON text)",
                param="structured_outputs",
            )
        for f in ("regex", "grammar"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidInputError(
                    f"structured_outputs.{f} must be a non-empty string", param="structured_outputs"
                )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidInputError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                param="structured_outputs",
            )

    @property
    def kind(self) -> str:
        """The one kind set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.Enum):
    """What `RequestOutput`s carry while a request runs (vLLM's names)."""

    CUMULATIVE = 0  # the whole output so far, every step
    DELTA = 1  # only what is new since the last output (with n > 1: the samples that progressed)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output.

    Attributes (vLLM's defaults):
        n: number of output sequences for the prompt.
        presence_penalty: [-2, 2]; added once per distinct token already in the output.
        frequency_penalty: [-2, 2]; added per occurrence of a token in the output.
        repetition_penalty: > 0; 1 disables; divides positive (multiplies negative) logits of
            tokens in the prompt or output (Keskar et al., CTRL, 2019).
        temperature: >= 0; 0 (below 1e-5) is greedy.
        top_p: (0, 1]; nucleus sampling mass; 1 disables.
        top_k: 0 or -1 disables; else keep the k most likely tokens.
        min_p: [0, 1]; drop tokens less likely than min_p times the most likely one.
        seed: per-request seed, any int (all 64 bits of it, modulo 2**64, reach the
            sampler); same seed, same draws, whatever the batch. None or -1: no seed (the
            engine draws one).
        stop: strings that end the output (not included unless include_stop_str_in_output).
        stop_token_ids: token ids that end the output (the token is kept in token_ids).
        bad_words: words never to generate.
        include_stop_str_in_output: keep the stop string in the text.
        ignore_eos: keep generating after EOS.
        max_tokens: output tokens at most (None: up to max_model_len).
        min_tokens: output tokens before EOS, stop_token_ids or stop strings may end it.
        logprobs: number of top logprobs per output token (plus the sampled token's).
        prompt_logprobs: number of top logprobs per prompt token.
        detokenize: produce text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces between special tokens in the text.
        logit_bias: token id -> bias added to its logit.
        allowed_token_ids: if set, only these tokens can be sampled.
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: up to max_model_len).
        output_kind: what intermediate outputs carry (see RequestOutputKind).
        structured_outputs: a constraint on the output (see StructuredOutputsParams).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if self.seed == -1:  # vLLM: -1 means no seed
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop", "a string or a list of strings", str)
        self.stop_token_ids = _as_list(
            self.stop_token_ids, "stop_token_ids", "a list of token ids >= 0", int
        )
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise InvalidInputError(
                    f"logit_bias must map token ids to floats, got {self.logit_bias!r}",
                    param="logit_bias",
                ) from None
        self._verify()

    def _verify(self) -> None:
        """Raises InvalidInputError (param: the field) for an out-of-range value."""

        def bad(field: str, rule: str) -> InvalidInputError:
            return InvalidInputError(
                f"{field} must be {rule}, got {getattr(self, field)!r}", param=field
            )

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for f in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, f) <= 2.0:
                raise bad(f, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "0 or -1 (disabled), or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1 (or None)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                param="min_tokens",
            )
        for f in ("logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise bad(f, "an integer >= 0 (or None)")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise bad("truncate_prompt_tokens", "-1 or an integer >= 1 (or None)")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop must not contain an empty string", param="stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidInputError(
                "allowed_token_ids must not be empty", param="allowed_token_ids"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy, except `structured_outputs`, which is shared: the engine reads a
        constraint once, when the request is added (`grammar_text`), and deep-copying a
        large schema cost as much as a decode step (13 ms for 260 kB)."""
        so = self.structured_outputs
        return copy.deepcopy(self, {} if so is None else {id(so): so})


@dataclasses.dataclass
class BeamSearchParams:
    """Parameters of `LLM.beam_search` (vLLM's names and defaults).

    Attributes:
        beam_width: beams kept at every step (>= 1).
        max_tokens: tokens generated at most (>= 1).
        ignore_eos: keep extending beams past EOS.
        temperature: applied before taking each beam's candidates (0: the raw logprobs).
        length_penalty: final score = cumulative logprob / (sequence length ** length_penalty),
            the sequence length counting the prompt (as vLLM).
        include_stop_str_in_output: kept for vLLM compatibility (beam search has no stop strings).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidInputError(
                f"beam_width must be an integer >= 1, got {self.beam_width!r}", param="beam_width"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidInputError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        if self.temperature < 0:
            raise InvalidInputError(
                f"temperature must be >= 0, got {self.temperature!r}", param="temperature"
            )


def _as_list(value: Any, field: str, rule: str, kind: type) -> list:
    """`value` (None: empty) as a list of `kind`.

    Raises:
        InvalidInputError (param `field`): not a list, tuple or other sequence of `kind`
            (a bool is no int here).
    """
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise InvalidInputError(f"{field} must be {rule}, got {value!r}", param=field)
    items = list(value)
    if any(not isinstance(v, kind) or isinstance(v, bool) for v in items):
        raise InvalidInputError(f"{field} must be {rule}, got {value!r}", param=field)
    return items
