"""Host-side step batches: padding to shape buckets and packing into one int32 transfer.

Plain numpy, no jax: the runner hands a list of `SeqInput`s (what each scheduled sequence
computes this step) to `BatchBuilder.build`, which returns one flat int32 array laid out by
`PackedLayout` for the bucket the step falls into. The jitted step slices it back into named
arrays (`PackedLayout.unpack`), so each step costs one host-to-device copy.

Buckets: the token count T is padded up the ladder 16, 32, 64, ... max_num_batched_tokens;
the sequence count S and the prefill-tile count NT follow from T (S = min(T, max_num_seqs),
NT = ceil(T / Tq) + min(S, T // 2)), so the step compiles once per rung of the T ladder.

Sampler rows: one per sequence, except with speculative decoding (`num_speculative_tokens`
K > 0), where a sequence with k proposed tokens gets k + 1 rows (the target's distribution
after its last known token and after each proposal); the row count R = min(T, S * (K + 1))
and the verification fields (`draft_token`, `row_start`, `prior_drafts`, `num_rows`) are in
the layout only when K > 0, so a step without speculation is packed as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

MIN_TOKEN_BUCKET = 16
SMALL_TOKEN_BUCKETS = (1, 4)  # below MIN_TOKEN_BUCKET (see token_buckets)
MAX_BANNED = 16  # token ids banned per row and step (min_tokens stops, bad-word endings)
# Per-row sampling fields, in packed order; the float ones travel as float32 bits.
SAMPLING_ROW_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed_lo",
    "seed_hi",
    "token_index",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "use_bias",
    "slot",
    "counts",
)
FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
)
# Values of padding rows: greedy, nothing applied, the scratch slot (set by the builder).
_ROW_DEFAULTS = {"top_p": 1.0, "repetition_penalty": 1.0}


def split_seed(seed: int) -> tuple[int, int]:
    """A request's seed as the int32 bits of its low and high 32-bit words.

    The seed is taken modulo 2**64 (vLLM's seeds are any int; negative ones wrap), so every
    bit of a 64-bit seed reaches the sampler: seeds that differ only above bit 31 draw
    differently.
    """
    seed %= 2**64
    lo, hi = np.asarray([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32).tolist()
    return lo, hi


def token_buckets(
    max_num_batched_tokens: int,
    min_bucket: int = MIN_TOKEN_BUCKET,
    sizes: tuple[int, ...] | None = None,
) -> list[int]:
    """The ladder of padded token counts: `sizes` (the engine's `cuda_graph_sizes`) below the
    maximum, then the maximum; without `sizes`, `SMALL_TOKEN_BUCKETS` (decode steps of one or
    a few sequences), then powers of two from `min_bucket`, then the maximum.

    A step runs its bucket's shape: every XLA op between the native kernels (norms, RoPE,
    activations, the sampler over [T, vocab] logits) computes all T rows, real or not, so a
    single sequence's decode step padded to 16 rows paid for 16 (the default model, one
    request, two engines alternating in one process: a decode step of 12.9-17.2 ms with the
    1-token bucket, 16.8-19.8 ms without). Each bucket is one more compilation (at start-up,
    or at its first step under `enforce_eager`), hence two small ones only, and powers of two
    above.
    """
    cap = max_num_batched_tokens
    if sizes is not None:
        return [b for b in sorted(set(sizes)) if b < cap] + [cap]
    buckets = [b for b in SMALL_TOKEN_BUCKETS if b < min(min_bucket, cap)]
    b = min(min_bucket, cap)
    while b < cap:
        buckets.append(b)
        b *= 2
    buckets.append(cap)
    return buckets


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Offsets of each named array inside one packed int32 buffer, for one bucket.

    T tokens, S sequences, B block-table columns, NT prefill tiles. Float fields
    (temperature, top_p) travel as the bits of float32 values.
    """

    num_tokens: int
    num_seqs: int
    num_block_cols: int
    num_tiles: int
    spec_width: int = 0  # K, the most proposed tokens per sequence (0: no speculation)

    @property
    def num_rows(self) -> int:
        """R, the sampler rows: S, or min(T, S * (K + 1)) with speculation."""
        if not self.spec_width:
            return self.num_seqs
        return min(self.num_tokens, self.num_seqs * (self.spec_width + 1))

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        T, S, B, NT = self.num_tokens, self.num_seqs, self.num_block_cols, self.num_tiles
        R, K = self.num_rows, self.spec_width
        spec = [
            ("draft_token", (R,)),  # the proposal row r verifies; -1 on a run's last row
            ("row_start", (R,)),  # the first row of the row's sequence
            ("first_row", (S,)),  # each sequence's first row
            ("prior_drafts", (R, K)),  # proposals before the row's (penalty counts), -1 pad
            ("num_rows", ()),
        ]
        return [
            ("input_ids", (T,)),
            ("positions", (T,)),
            ("slot_mapping", (T,)),
            ("prompt_targets", (T,)),
            ("seq_lens", (S,)),
            ("query_start_loc", (S + 1,)),
            ("last_token_index", (S,)),
            ("logits_indices", (R,)),
            ("block_tables", (S, B)),
            ("tile_seq", (NT,)),
            ("tile_q_start", (NT,)),
            ("tile_q_len", (NT,)),
            ("tile_kv_len", (NT,)),
            ("num_tiles", ()),
            ("want_logprobs", ()),
            ("want_prompt", ()),
            ("use_bitmask", ()),  # set by the runner when a row is constrained
            *((name, (R,)) for name in SAMPLING_ROW_FIELDS),
            ("banned", (R, MAX_BANNED)),
            *(spec if K else ()),
        ]

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name -> (offset, shape) in the packed buffer (computed once per layout)."""
        out, off = {}, 0
        for name, shape in self.fields():
            out[name] = (off, shape)
            off += math.prod(shape)
        return out

    @functools.cached_property
    def size(self) -> int:
        return sum(math.prod(shape) for _, shape in self.fields())

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Named numpy views into a packed host buffer (writes go into `buf`)."""
        return {
            name: buf[off : off + math.prod(shape)].reshape(shape)
            for name, (off, shape) in self.offsets.items()
        }

    def unpack(self, packed):
        """Named slices of a packed array; works on numpy and on jax arrays inside jit."""
        return {
            name: packed[off : off + math.prod(shape)].reshape(shape)
            for name, (off, shape) in self.offsets.items()
        }


@dataclasses.dataclass
class StepBatch:
    """A packed step. buffer: [size] int32, or [M, size] for M micro-batches (M > 0);
    sample_rows[i]: the (first) sampler row of sequence i (micro-batch m's row r is
    m * S + r); with speculation, its k proposals are verified on the rows after it;
    token_rows[i]: the flat indices (m * T + offset) of sequence i's scheduled tokens."""

    layout: PackedLayout
    buffer: np.ndarray
    sample_rows: list[int]
    token_rows: list[np.ndarray]
    num_microbatches: int


@dataclasses.dataclass
class SeqInput:
    """What one sequence computes in a step.

    token_ids: [n] int32 the tokens scheduled this step (positions start .. start + n - 1).
    start: number of the sequence's tokens already in the KV cache (num_computed_tokens).
    block_ids: [>= ceil((start + n) / block_size)] int32 the sequence's block table.
    temperature ... counts: the sampling row (see ops.sampling.SamplingMetadata); `counts`
        says whether the row's sample is real (the step reaches the sequence's last token).
        `seed` is any int, taken modulo 2**64 and packed as two int32 words, `seed_lo` and
        `seed_hi` (see `split_seed`).
    banned: token ids masked this step (at most MAX_BANNED).
    num_draft: k, the proposed tokens at the end of `token_ids` (speculative decoding); the
        sequence then gets k + 1 sampler rows, row j drawing token `token_index + j`.
    row_banned: with proposals, the banned ids of each of the k + 1 rows (else `banned`).
    prompt_targets: [n] int32 or None; for prompt logprobs, the prompt token each scheduled
        position predicts (-1 where none).
    """

    token_ids: np.ndarray
    start: int
    block_ids: np.ndarray
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    token_index: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    use_bias: bool = False
    slot: int = 0
    counts: bool = True
    banned: tuple[int, ...] = ()
    num_draft: int = 0
    row_banned: tuple[tuple[int, ...], ...] | None = None
    want_logprobs: bool = False
    prompt_targets: np.ndarray | None = None


class BatchBuilder:
    """Pads and packs steps; owns one reusable host buffer per bucket."""

    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        query_tile_size: int = 32,
        kv_chunk_pages: int = 8,
        scratch_slot: int = 0,
        num_speculative_tokens: int = 0,
        sizes: tuple[int, ...] | None = None,
    ):
        self.spec_width = num_speculative_tokens
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.max_num_seqs = max_num_seqs
        self.query_tile_size = query_tile_size
        self.kv_chunk_pages = kv_chunk_pages
        cols = math.ceil(max_model_len / block_size)
        self.num_block_cols = math.ceil(cols / kv_chunk_pages) * kv_chunk_pages
        self.buckets = token_buckets(max_num_batched_tokens, sizes=sizes)
        self._buffers: dict[int, np.ndarray] = {}
        self._views: dict[int, dict[str, np.ndarray]] = {}  # of each bucket's buffer

    def layout(self, num_tokens_bucket: int) -> PackedLayout:
        T = num_tokens_bucket
        S = min(T, self.max_num_seqs)
        NT = math.ceil(T / self.query_tile_size) + min(S, T // 2)
        return PackedLayout(T, S, self.num_block_cols, NT, self.spec_width)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int:
        """The smallest bucket that holds the step.

        Raises:
            ValueError: more tokens than max_num_batched_tokens or sequences than max_num_seqs.
        """
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs={self.max_num_seqs}")
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens={self.buckets[-1]}")

    def microbatch_layout(self, num_tokens_bucket: int, num_microbatches: int) -> PackedLayout:
        """The layout of each of the M micro-batches of a bucket (T / M tokens, rounded up)."""
        return self.layout(-(-num_tokens_bucket // num_microbatches))

    def build_step(self, seqs: list[SeqInput], num_microbatches: int = 0) -> StepBatch:
        """Packs a step: one buffer (`num_microbatches` 0), or [M, size] micro-batches cut at
        equal token counts, a sequence cut in two continuing in the next micro-batch (its
        first part samples nothing)."""
        if not num_microbatches:
            layout, buf = self.build(seqs)
            v = self._views[layout.num_tokens]
            qsl = v["query_start_loc"]
            first_rows = np.cumsum([0] + [1 + s.num_draft for s in seqs[:-1]]).tolist()
            return StepBatch(
                layout,
                buf,
                first_rows if seqs else [],
                [np.arange(qsl[i], qsl[i + 1]) for i in range(len(seqs))],
                0,
            )
        M = num_microbatches
        total = sum(len(s.token_ids) for s in seqs)
        layout = self.microbatch_layout(self.bucket_for(total, len(seqs)), M)
        Tm, Sm = layout.num_tokens, layout.num_seqs
        groups: list[list[tuple[int, SeqInput]]] = [[] for _ in range(M)]
        m = used = 0
        for i, s in enumerate(seqs):
            n, off = len(s.token_ids), 0
            while off < n:
                if used == Tm or len(groups[m]) == Sm:
                    m, used = m + 1, 0
                take = min(n - off, Tm - used)
                last = off + take == n
                part = dataclasses.replace(
                    s,
                    token_ids=s.token_ids[off : off + take],
                    start=s.start + off,
                    counts=s.counts and last,
                    want_logprobs=s.want_logprobs and last,
                    banned=s.banned if last else (),
                    prompt_targets=None
                    if s.prompt_targets is None
                    else s.prompt_targets[off : off + take],
                )
                groups[m].append((i, part))
                used += take
                off += take
        bufs = np.zeros((M, layout.size), np.int32)
        sample_rows = [0] * len(seqs)
        token_rows: list[list[np.ndarray]] = [[] for _ in seqs]
        for m, group in enumerate(groups):
            _, buf = self.build([p for _, p in group], layout)
            bufs[m] = buf
            qsl = layout.views(buf)["query_start_loc"]
            for row, (i, _) in enumerate(group):
                sample_rows[i] = m * Sm + row  # the last part's row wins
                token_rows[i].append(m * Tm + np.arange(qsl[row], qsl[row + 1]))
        return StepBatch(layout, bufs, sample_rows, [np.concatenate(t) for t in token_rows], M)

    def build(
        self, seqs: list[SeqInput], layout: PackedLayout | None = None
    ) -> tuple[PackedLayout, np.ndarray]:
        """Packs the step's sequences (in order) into the buffer of their bucket (or of
        `layout`).

        Padding: tokens have id 0, position 0 and slot 0 (null block); sequence rows have
        seq_len 0, an all-null block table and `last_token_index` = T; tiles past
        `num_tiles` are ignored.
        """
        lens = [len(s.token_ids) for s in seqs]
        total = sum(lens)
        if layout is None:
            layout = self.layout(self.bucket_for(total, len(seqs)))
        elif total > layout.num_tokens or len(seqs) > layout.num_seqs:
            raise ValueError(f"{len(seqs)} sequences of {total} tokens exceed {layout}")
        buf = self._buffers.get(layout.num_tokens)
        if buf is None:
            buf = self._buffers[layout.num_tokens] = np.zeros(layout.size, np.int32)
            self._views[layout.num_tokens] = layout.views(buf)
        else:
            buf.fill(0)
        v = self._views[layout.num_tokens]
        T, bs, Tq = layout.num_tokens, self.block_size, self.query_tile_size
        n_seqs = len(seqs)
        qsl = np.zeros(n_seqs + 1, np.int64)
        np.cumsum(lens, out=qsl[1:])
        tiles: list[tuple[int, int, int, int]] = []
        for i, s in enumerate(seqs):
            n, q0 = lens[i], int(qsl[i])
            pos = np.arange(s.start, s.start + n, dtype=np.int32)
            v["input_ids"][q0 : q0 + n] = s.token_ids
            v["positions"][q0 : q0 + n] = pos
            v["slot_mapping"][q0 : q0 + n] = s.block_ids[pos // bs] * bs + pos % bs
            nb = len(s.block_ids)
            v["block_tables"][i, :nb] = s.block_ids
            if n > 1:
                for t0 in range(0, n, Tq):
                    tl = min(Tq, n - t0)
                    tiles.append((i, q0 + t0, tl, s.start + t0 + tl))
        v["seq_lens"][:n_seqs] = [s.start + n for s, n in zip(seqs, lens, strict=True)]
        v["query_start_loc"][: n_seqs + 1] = qsl
        v["query_start_loc"][n_seqs + 1 :] = total
        v["last_token_index"][:n_seqs] = qsl[1:] - 1
        v["last_token_index"][n_seqs:] = T
        if tiles:
            arr = np.asarray(tiles, np.int32)
            v["tile_seq"][: len(tiles)] = arr[:, 0]
            v["tile_q_start"][: len(tiles)] = arr[:, 1]
            v["tile_q_len"][: len(tiles)] = arr[:, 2]
            v["tile_kv_len"][: len(tiles)] = arr[:, 3]
        v["num_tiles"][...] = len(tiles)
        self._pack_rows(v, seqs, qsl, layout)
        v["want_logprobs"][...] = any(s.want_logprobs for s in seqs)
        targets = v["prompt_targets"]
        targets.fill(-1)
        want_prompt = False
        for i, s in enumerate(seqs):
            if s.prompt_targets is not None:
                q0 = int(qsl[i])
                targets[q0 : q0 + lens[i]] = s.prompt_targets
                want_prompt = True
        v["want_prompt"][...] = want_prompt
        return layout, buf

    def _pack_rows(self, v, seqs: list[SeqInput], qsl: np.ndarray, layout: PackedLayout) -> None:
        """The sampler rows: one per sequence, or 1 + k for a sequence with k proposals
        (row j: logits after its j-th proposal, token index + j, its own banned ids)."""
        n_seqs = len(seqs)
        nrows = np.asarray([1 + s.num_draft for s in seqs], np.int64)
        R = int(nrows.sum())
        if layout.num_rows < R:
            raise ValueError(f"{R} sampler rows exceed {layout}")
        seq_of = np.repeat(np.arange(n_seqs), nrows)  # [R] the row's sequence
        first = np.zeros(n_seqs, np.int64)
        np.cumsum(nrows[:-1], out=first[1:])
        j = np.arange(R) - first[seq_of]  # the row's index within its sequence
        last = qsl[1:] - 1  # [n_seqs] flat index of each sequence's last token
        ndraft = nrows - 1
        v["logits_indices"][:R] = (last - ndraft)[seq_of] + j
        seed_words = np.asarray([split_seed(s.seed) for s in seqs], np.int32).reshape(-1, 2)
        for name in SAMPLING_ROW_FIELDS:
            col = v[name]
            if name in FLOAT_FIELDS:
                vals = np.asarray([getattr(s, name) for s in seqs], np.float32).view(np.int32)
                col[R:] = np.float32(_ROW_DEFAULTS.get(name, 0.0)).view(np.int32)
            elif name in ("seed_lo", "seed_hi"):
                vals = seed_words[:, 0 if name == "seed_lo" else 1]
            else:
                vals = np.asarray([int(getattr(s, name)) for s in seqs], np.int64)
            col[:R] = vals[seq_of] if n_seqs else vals
        v["token_index"][:R] += j
        v["slot"][R:] = self.scratch_slot
        v["counts"][R:] = 0
        banned = v["banned"]
        banned.fill(-1)
        r = 0
        for s in seqs:
            per_row = s.row_banned if s.row_banned is not None else (s.banned,)
            for b in per_row:
                if len(b) > MAX_BANNED:
                    raise ValueError(f"more than {MAX_BANNED} banned tokens in one step")
                banned[r, : len(b)] = b
                r += 1
            r += 1 + s.num_draft - len(per_row)
        if not layout.spec_width:
            return
        draft, prior = v["draft_token"], v["prior_drafts"]
        draft.fill(-1)
        prior.fill(-1)
        v["row_start"][:] = np.arange(layout.num_rows)
        v["row_start"][:R] = first[seq_of]
        v["first_row"][:n_seqs] = first
        v["num_rows"][...] = R
        for i, s in enumerate(seqs):
            k = s.num_draft
            if k:
                d = s.token_ids[len(s.token_ids) - k :]
                r0 = int(first[i])
                draft[r0 : r0 + k] = d
                for jj in range(1, k + 1):
                    prior[r0 + jj, :jj] = d[:jj]
