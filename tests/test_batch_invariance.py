"""Batch invariance on CPU: a request's logprobs do not depend on what else shares its steps.

Six prompts run alone, then each set of them inside batches of 1, 7 and 40 other requests of
mixed lengths: long prompts prefilled in chunks (a 192-token step budget, so steps range from
one decode row to 192 tokens, past the 128 where XLA's dot would take over without
`batch_invariant`), steps mixing prefill chunks and decode rows, and prompts that share a
32-token prefix with a target (prefix cache hits; the target's own prompt may then be
computed from a different chunk boundary).
Each target's greedy tokens and top-5 logprobs at every output position must be bit-identical
to its run alone: every row of a step is reduced in the same order whatever the step's size
(the native matmul at every step size, the native attention per query row), for a dense
model and a mixture-of-experts one (the latter inside the batch of 40 only)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native kernels")

OUTPUT_LEN = 6


def _targets(rng) -> list[list[int]]:
    return [rng.integers(3, 259, size=n).tolist() for n in (1, 9, 16, 40, 77, 130)]


def _others(rng, targets, n) -> list[list[int]]:
    out = []
    for i in range(n):
        if i % 3 == 0:  # a prefix hit on a target of at least 32 tokens
            long = [t for t in targets if len(t) >= 32]
            base = long[i % len(long)][:32]
            out.append(base + rng.integers(3, 259, size=int(rng.integers(1, 40))).tolist())
        else:
            out.append(rng.integers(3, 259, size=int(rng.integers(1, 180))).tolist())
    return out


def _run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.parametrize("D", [1, 5, 64, 576])
def test_row_sum_is_the_sum_and_the_same_bits_in_any_batch(D):
    """`layers.row_sum` equals float64 NumPy's sum within float32 rounding, and a row's sum is
    the same bits jitted alone or among 7 / 300 rows (its order is fixed by D alone)."""
    import jax

    from pagedjax.models.layers import row_sum

    rng = np.random.default_rng(D)
    x = rng.standard_normal((300, D)).astype(np.float32)
    f = jax.jit(row_sum)
    whole = np.asarray(f(x))
    assert whole.shape == (300, 1)
    np.testing.assert_allclose(whole[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
    for rows in ([3], list(range(7)), list(range(300))):
        assert np.array_equal(np.asarray(f(x[rows])), whole[rows])


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory):
    from conftest import make_checkpoint, randomize_norms
    from test_moe import CASES

    folder = make_checkpoint(tmp_path_factory.mktemp("mixtral"), **CASES["mixtral"])
    randomize_norms(folder, seed=3)
    return folder


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_logprobs_do_not_depend_on_the_batch(make_llm, request, model):
    """A dense model, and a mixture-of-experts one (8 experts, top-2: steps of up to 384
    (token, expert) rows through the native grouped matmul, which reduces each row as the
    native matmul does whatever its tile, group or step)."""
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    llm = make_llm(folder, max_model_len=256, max_num_seqs=48, max_num_batched_tokens=192)
    cfg = llm.llm_engine.config.model_config
    assert (cfg.attention_backend, cfg.linear_backend) == ("cpu", "cpu")
    rng = np.random.default_rng(22)
    targets = _targets(rng)
    alone = [_run(llm, [t])[0] for t in targets]
    # the MoE model: only the batch whose steps pass 128 expert rows (CI time)
    for n_others in (1, 7, 40) if model == "llama" else (40,):
        others = _others(rng, targets, n_others)
        prompts = others + targets
        order = rng.permutation(len(prompts))  # targets among the others, in random places
        got = _run(llm, [prompts[i] for i in order])
        by_prompt = {int(i): r for i, r in zip(order, got, strict=True)}
        for j, want in enumerate(alone):
            tokens, lps = by_prompt[n_others + j]
            assert tokens == want[0], (n_others, j)
            for pos, (g, w) in enumerate(zip(lps, want[1], strict=True)):
                assert g == w, f"target {j} among {n_others} others, position {pos}: {g} != {w}"
