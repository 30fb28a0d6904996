"""Host-side batch building: a hand-computed step, bucket choice, and the packed layout."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.executor.input_batch import BatchBuilder, SeqInput, split_seed, token_buckets


def test_token_buckets():
    assert token_buckets(64) == [1, 4, 16, 32, 64]
    assert token_buckets(100) == [1, 4, 16, 32, 64, 100]
    assert token_buckets(8) == [1, 4, 8]
    assert token_buckets(4) == [1, 4]
    assert token_buckets(1) == [1]
    assert token_buckets(64, min_bucket=32) == [1, 4, 32, 64]
    assert token_buckets(64, sizes=(8, 1, 128, 8)) == [1, 8, 64]  # cuda_graph_sizes


def test_hand_computed_step():
    b = BatchBuilder(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=64,
        block_size=4,
        query_tile_size=2,
        kv_chunk_pages=2,
    )
    seqs = [
        SeqInput(
            np.array([7], np.int32),
            start=5,
            block_ids=np.array([3, 9], np.int32),
            temperature=0.0,
            seed=1,
        ),  # decode of its 6th token
        SeqInput(
            np.array([1, 2, 3], np.int32),
            start=4,
            block_ids=np.array([2, 5], np.int32),
            temperature=0.7,
            top_p=0.9,
            top_k=4,
            seed=2**40 + 5,
            token_index=0,
        ),
    ]
    layout, buf = b.build(seqs)
    assert (layout.num_tokens, layout.num_seqs, layout.num_block_cols) == (4, 4, 16)
    v = layout.views(buf)
    np.testing.assert_array_equal(v["input_ids"][:4], [7, 1, 2, 3])
    np.testing.assert_array_equal(v["positions"][:4], [5, 4, 5, 6])
    # slot = block_ids[pos // 4] * 4 + pos % 4
    np.testing.assert_array_equal(
        v["slot_mapping"][:4], [9 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    )
    np.testing.assert_array_equal(v["seq_lens"], [6, 7, 0, 0])
    np.testing.assert_array_equal(v["query_start_loc"], [0, 1, 4, 4, 4])
    np.testing.assert_array_equal(v["last_token_index"], [0, 3, 4, 4])
    np.testing.assert_array_equal(v["block_tables"][0, :3], [3, 9, 0])
    np.testing.assert_array_equal(v["block_tables"][1, :3], [2, 5, 0])
    # The 3-token sequence is cut into tiles of 2 and 1 queries.
    assert int(v["num_tiles"]) == 2
    np.testing.assert_array_equal(v["tile_seq"][:2], [1, 1])
    np.testing.assert_array_equal(v["tile_q_start"][:2], [1, 3])
    np.testing.assert_array_equal(v["tile_q_len"][:2], [2, 1])
    np.testing.assert_array_equal(v["tile_kv_len"][:2], [6, 7])
    np.testing.assert_allclose(v["temperature"].view(np.float32), [0.0, 0.7, 0.0, 0.0])
    np.testing.assert_allclose(v["top_p"].view(np.float32), [1.0, 0.9, 1.0, 1.0])
    np.testing.assert_array_equal(v["top_k"], [0, 4, 0, 0])
    np.testing.assert_array_equal(v["seed_lo"], [1, 5, 0, 0])
    np.testing.assert_array_equal(v["seed_hi"], [0, 2**8, 0, 0])
    # 5 tokens take the 16-token bucket: the padding rows are zeros
    layout, buf = b.build([*seqs, SeqInput(np.array([4], np.int32), 2, np.array([1], np.int32))])
    v = layout.views(buf)
    assert layout.num_tokens == 16
    assert not v["slot_mapping"][5:].any() and not v["input_ids"][5:].any()


def _packed_seeds(seeds):
    b = BatchBuilder(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, block_size=4)
    seqs = [SeqInput(np.array([1], np.int32), 0, np.array([1], np.int32), seed=s) for s in seeds]
    layout, buf = b.build(seqs)
    v = layout.views(buf)
    n = len(seeds)
    lo = v["seed_lo"][:n].view(np.uint32).astype(np.uint64)
    hi = v["seed_hi"][:n].view(np.uint32).astype(np.uint64)
    return [int(x) for x in (hi << np.uint64(32)) | lo]


def test_seed_travels_as_two_words_that_round_trip():
    seeds = [0, 2**32 + 5, 2**64 - 1, 5]
    assert _packed_seeds(seeds) == seeds
    # Any int, taken modulo 2**64 (vLLM's seeds): negative ones and ones above 2**64 wrap.
    assert _packed_seeds([-2, 2**64 + 3, 2**70 + 2**33]) == [2**64 - 2, 3, 2**33]
    assert split_seed(2**32 + 5) == (5, 1)
    assert split_seed(2**64 - 1) == (-1, -1)


def test_buffer_reuse_clears_the_previous_step():
    b = BatchBuilder(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, block_size=4)
    b.build([SeqInput(np.arange(10, dtype=np.int32), 0, np.arange(1, 4, dtype=np.int32))])
    layout, buf = b.build([SeqInput(np.array([5], np.int32), 2, np.array([8], np.int32))])
    v = layout.views(buf)
    assert not v["input_ids"][1:].any() and not v["block_tables"][0, 1:].any()


def test_too_many_tokens_or_sequences():
    b = BatchBuilder(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64, block_size=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        b.build([SeqInput(np.zeros(17, np.int32), 0, np.arange(1, 6, dtype=np.int32))])
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        b.build([SeqInput(np.zeros(1, np.int32), 0, np.array([1], np.int32))] * 3)
