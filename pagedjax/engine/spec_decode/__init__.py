"""Speculative decoding on the host: who gets proposals, how many, and the counters.

`Speculator` is the scheduler's helper (plain Python and numpy, no jax). For a running request
that decodes (its next step computes its one last token), it returns up to k proposed tokens:
from `ngram.NgramProposer` (method "ngram"), or those the draft model proposed at the end of
the previous step (method "draft_model", handed in through `set_drafts`). The count is capped
so that the run of kept tokens (at most k + 1) stays within max_tokens and max_model_len, and
within the step's token budget. Requests speculation cannot serve are scheduled without
proposals, in the same batch: structured outputs (`serves`); beam-search steps (max_tokens 1
each) and requests whose remaining budget is one token get none by the caps above; prompt
steps (and with them prompt logprobs and the forking of n > 1 samples) get none because only
decode steps speculate.

Counters (vLLM's names, exported by `engine.prometheus`): num_drafts (verification runs),
num_draft_tokens (tokens proposed), num_accepted_tokens (proposals kept), and
num_accepted_tokens_per_pos[j] (runs whose proposal j was kept). Mean acceptance length =
1 + num_accepted_tokens / num_drafts (tokens a verification step yields).
"""

from __future__ import annotations

import dataclasses

from pagedjax.config import SpeculativeConfig
from pagedjax.engine.spec_decode.ngram import NgramProposer


@dataclasses.dataclass
class SpecDecodeStats:
    """Counters since start (see module docstring)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification run (1 + accepted per run); 0 before the first."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def sum_spec_stats(stats: list[SpecDecodeStats]) -> SpecDecodeStats:
    """The counters of several replicas, added."""
    width = max(len(s.num_accepted_tokens_per_pos) for s in stats)
    return SpecDecodeStats(
        sum(s.num_drafts for s in stats),
        sum(s.num_draft_tokens for s in stats),
        sum(s.num_accepted_tokens for s in stats),
        [
            sum(
                s.num_accepted_tokens_per_pos[j]
                for s in stats
                if j < len(s.num_accepted_tokens_per_pos)
            )
            for j in range(width)
        ],
    )


class Speculator:
    """Proposals for the scheduler, and the acceptance counters.

    Args:
        config: the `SpeculativeConfig`.
        max_model_len: prompt + output tokens at most.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram"
            else None
        )
        self._drafts: dict[str, tuple[int, ...]] = {}  # draft model's, for the next step
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots to hold past a sampling step's tokens: the draft model writes its k
        proposals' K/V there after the step (n-gram lookup writes nothing)."""
        return self.k if self.config.method == "draft_model" else 0

    def propose(self, req, num_new_tokens: int, budget: int) -> tuple[int, ...]:
        """The tokens to verify after `req`'s last one this step ((): none).

        Args:
            req: the `Request` (running).
            num_new_tokens: its tokens to compute this step without proposals.
            budget: the step's token budget left (its num_new_tokens included).
        """
        p = req.sampling_params
        if num_new_tokens != 1 or req.num_output_tokens == 0 or not self.serves(p):
            return ()
        k = min(
            self.k,
            budget - 1,
            self.max_model_len - req.num_tokens - 1,
            p.max_tokens - req.num_output_tokens - 1,
        )
        if k < 1:
            return ()
        if self.ngram is not None:
            return self.ngram.propose(req.request_id, req.all_token_ids, k)
        drafts = self._drafts.get(req.request_id, ())
        return drafts[:k]

    @staticmethod
    def serves(params) -> bool:
        """Whether requests with these SamplingParams may get proposals: not those with
        structured outputs (their grammar masks would have to advance over the proposals;
        they decode one token per step, in the same batch)."""
        return getattr(params, "structured_outputs", None) is None

    def set_drafts(self, req_id: str, drafts: tuple[int, ...]) -> None:
        """The draft model's proposals for `req_id`'s next step."""
        self._drafts[req_id] = tuple(drafts)

    def forget(self, req_id: str) -> None:
        """A request ended or lost its KV cache (preempted)."""
        self._drafts.pop(req_id, None)
        if self.ngram is not None:
            self.ngram.forget(req_id)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verification run: `num_proposed` tokens proposed, the first `num_accepted`
        kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.num_accepted_tokens_per_pos[j] += 1
