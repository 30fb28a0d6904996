"""One of two processes that run the tiny model with tensor parallelism across processes
(jax.distributed on localhost, CPU collectives). Started by tests/test_multiprocess.py."""

from __future__ import annotations

import json
import sys


def main(folder: str, port: str, process_id: str) -> None:
    import numpy as np

    from pagedjax import LLM, SamplingParams

    llm = LLM(
        folder,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,  # one bucket: prompts are chunked
        cuda_graph_sizes="16",
        max_num_seqs=8,
        num_gpu_blocks_override=40,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        compilation_cache_dir="",
        use_tqdm_on_load=False,
        disable_log_stats=True,
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 259, size=n).tolist()} for n in (1, 9, 40)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    import jax

    print(
        "REPORT "
        + json.dumps(
            {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "process_count": jax.process_count(),
                "devices": llm.llm_engine.layout["devices"],
                "kv_local_shards": [
                    list(s.data.shape) for s in llm.llm_engine.runner.kv_cache[0].addressable_shards
                ],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
