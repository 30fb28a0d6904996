"""The runner's bookkeeping of one request in the batch: its frozen spec, block table and
slot of the device sampling state, and the `SeqInput` of each step it is scheduled in (tokens,
positions, sampling row, banned tokens, prompt-logprob targets). Plain numpy, no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pagedjax.engine.interface import NewRequestData, RequestSpec, ScheduledSeq
from pagedjax.executor.input_batch import SeqInput


@dataclasses.dataclass
class RequestState:
    """The runner's row bookkeeping for one request in the batch: its spec, its block table,
    its slot of the device sampling state and the sampling fields of its row."""

    spec: RequestSpec
    block_ids: list[int]
    slot: int
    row: dict[str, Any]  # the SeqInput sampling fields that do not change
    bad_words: list[tuple[int, ...]]  # multi-token bad words

    @classmethod
    def new(cls, new: NewRequestData, slot: int) -> RequestState:
        """The row bookkeeping of a request entering the batch in sampling-state `slot`."""
        spec = new.spec
        return cls(
            spec=spec,
            block_ids=list(new.block_ids),
            slot=slot,
            row=dict(
                temperature=spec.temperature,
                top_p=spec.top_p,
                top_k=spec.top_k,
                min_p=spec.min_p,
                seed=spec.seed,
                repetition_penalty=spec.repetition_penalty,
                presence_penalty=spec.presence_penalty,
                frequency_penalty=spec.frequency_penalty,
                use_bias=has_bias(spec),
                want_logprobs=spec.logprobs is not None,
            ),
            bad_words=[w for w in spec.bad_words if len(w) > 1],
        )

    def seq_input(self, seq: ScheduledSeq) -> SeqInput:
        """What this request computes in the step `seq` describes (its row of the batch)."""
        spec, start, n = self.spec, seq.num_computed_tokens, len(seq.token_ids)
        banned = self._banned(seq.num_output_tokens, seq.recent_output_ids) if seq.samples else ()
        row_banned = None
        k = seq.num_draft_tokens
        if k:  # row j follows the first j proposals
            drafts = seq.token_ids[n - k :]
            row_banned = tuple(
                self._banned(seq.num_output_tokens + j, seq.recent_output_ids + drafts[:j])
                for j in range(k + 1)
            )
        targets = None
        P = spec.num_prompt_tokens
        if spec.prompt_logprobs is not None and start + 1 < P:
            nxt = np.arange(start + 1, start + n + 1)
            prompt = np.asarray(spec.prompt_token_ids, np.int32)
            targets = np.where(nxt < P, prompt[np.minimum(nxt, P - 1)], -1)
        return SeqInput(
            token_ids=np.asarray(seq.token_ids, np.int32),
            start=start,
            block_ids=np.asarray(self.block_ids, np.int32),
            token_index=seq.num_output_tokens,
            slot=self.slot,
            counts=seq.samples,
            banned=banned,
            num_draft=k,
            row_banned=row_banned,
            prompt_targets=targets,
            **self.row,
        )

    def _banned(self, num_output_tokens: int, recent: tuple[int, ...]) -> tuple[int, ...]:
        """Ids banned for the output token at index `num_output_tokens`, after `recent`:
        stop ids before min_tokens, the last token of a bad word whose prefix just ended."""
        banned: list[int] = []
        if num_output_tokens < self.spec.min_tokens:
            banned.extend(self.spec.stop_token_ids)
        for word in self.bad_words:
            k = len(word) - 1
            if len(recent) >= k and recent[len(recent) - k :] == word[:-1]:
                banned.append(word[-1])
        return tuple(dict.fromkeys(banned))


def has_bias(spec: RequestSpec) -> bool:
    return bool(
        spec.logit_bias
        or spec.allowed_token_ids is not None
        or any(len(w) == 1 for w in spec.bad_words)
    )


def bias_row(spec: RequestSpec, vocab: int) -> np.ndarray:
    """[V] float32 additive bias of a request: logit_bias, -inf outside allowed_token_ids,
    -inf for single-token bad words."""
    row = np.zeros(vocab, np.float32)
    if spec.allowed_token_ids is not None:
        row[:] = -np.inf
        row[list(spec.allowed_token_ids)] = 0.0
    for tok, b in spec.logit_bias:
        row[tok] += b
    row[[w[0] for w in spec.bad_words if len(w) == 1]] = -np.inf
    return row
