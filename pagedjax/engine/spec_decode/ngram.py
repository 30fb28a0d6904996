"""N-gram proposals (prompt lookup decoding): the tokens that followed the latest earlier
occurrence of the request's last n tokens, in its own prompt and output.

After Saxena's prompt lookup decoding (2023) and vLLM's `ngram` method: for n from
`prompt_lookup_max` down to `prompt_lookup_min`, find an earlier position where the last n
tokens occurred, and propose the (up to k) tokens that came next. Here every candidate's match
length is computed at once with numpy (one vectorised comparison per n-gram size, over the
history), the longest match wins and, among equally long ones, the latest occurrence. No
Python loop runs over the history: a step costs O(prompt_lookup_max x history) in C, a few
microseconds per thousand tokens (benchmarks/spec_decode_ngram.py measures it). Plain numpy.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to k tokens per request by n-gram lookup.

    Args:
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried (tokens).

    Each request's tokens are kept in a growing numpy buffer, extended by the tokens added
    since the last call (`propose`), and dropped by `forget`.
    """

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.nmin = prompt_lookup_min
        self.nmax = prompt_lookup_max
        self._buf: dict[str, tuple[np.ndarray, int]] = {}

    def _tokens(self, req_id: str, token_ids: list[int]) -> np.ndarray:
        buf, n = self._buf.get(req_id, (None, 0))
        L = len(token_ids)
        if buf is None or n > L:
            buf, n = np.zeros(max(64, 2 * L), np.int64), 0
        elif len(buf) < L:
            buf = np.concatenate([buf[:n], np.zeros(L + len(buf), np.int64)])
        buf[n:L] = token_ids[n:L]
        self._buf[req_id] = (buf, L)
        return buf[:L]

    def forget(self, req_id: str) -> None:
        self._buf.pop(req_id, None)

    def propose(self, req_id: str, token_ids: list[int], k: int) -> tuple[int, ...]:
        """Up to k proposed next tokens (none if no n-gram of at least prompt_lookup_min
        tokens recurs).

        Args:
            req_id: the request (its buffer is reused across calls).
            token_ids: all its tokens, prompt and output.
            k: the most tokens to propose.
        """
        return propose_ngram(self._tokens(req_id, token_ids), k, self.nmin, self.nmax)


def propose_ngram(tokens: np.ndarray, k: int, nmin: int, nmax: int) -> tuple[int, ...]:
    """The n-gram proposal for `tokens` [L] int (see module docstring); () if none."""
    L = len(tokens)
    nmax = min(nmax, L - 1)
    if k < 1 or nmax < nmin:
        return ()
    # Candidate match ends e in [0, L-2] (a next token exists); m[e]: match length at e.
    run = np.ones(L - 1, bool)
    m = np.zeros(L - 1, np.int32)
    for t in range(nmax):
        run[:t] = False
        run[t:] &= tokens[: L - 1 - t] == tokens[L - 1 - t]
        if not run.any():
            break
        m += run
    best = int(m.max()) if L > 1 else 0
    if best < nmin:
        return ()
    e = int(np.flatnonzero(m == best)[-1])
    return tuple(int(x) for x in tokens[e + 1 : e + 1 + k])
