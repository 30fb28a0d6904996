"""distributed_executor_backend="ray" on a local Ray instance: two data-parallel replicas as
actors, and one tensor-parallel model over two actor processes (jax.distributed), both with
the single-process greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

KW = dict(
    dtype="float32",
    max_model_len=128,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    num_gpu_blocks_override=40,
    compilation_cache_dir="",
    use_tqdm_on_load=False,
    disable_log_stats=True,
)


@pytest.fixture(scope="module")
def local_ray():
    root = str(Path(__file__).resolve().parent.parent)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": root, "XLA_FLAGS": ""}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_llama_dir):
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 259, size=n).tolist()} for n in (1, 12, 45)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = LLM(str(tiny_llama_dir), **KW).generate(prompts, params, use_tqdm=False)
    return prompts, params, [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize(
    "layout",
    [dict(data_parallel_size=2), dict(num_processes=2, tensor_parallel_size=2)],
    ids=["dp2-actors", "tp2-over-two-actor-processes"],
)
def test_ray_layouts_give_the_single_process_output(
    local_ray, tiny_llama_dir, prompts_and_reference, layout
):
    prompts, params, want = prompts_and_reference
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="ray", **KW, **layout)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        actors = llm.llm_engine.layout["actors"]
        assert len(actors) == 2
        if "num_processes" in layout:  # one mesh over both actors' devices
            assert all(len(a["devices"]) == 2 for a in actors)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()
