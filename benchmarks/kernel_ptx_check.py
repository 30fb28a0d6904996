"""Compiles the Pallas attention kernel down to PTX and a cubin without a GPU.

    python -m benchmarks.kernel_ptx_check dump DIR       # with jax: Triton IR of each config
    python benchmarks/kernel_ptx_check.py compile DIR    # with triton (pip): PTX, ptxas -v

Step 1 lowers `ops.paged_attention_pallas` for CUDA on any machine (cross-platform lowering)
and keeps the Triton IR that JAX's Pallas Triton lowering builds (read through a private JAX
hook: a development tool, not product code). Step 2 runs in any Python that has the `triton`
package of the GPU machine's version (3.6; keep it out of the project venv, e.g.
`python -m venv /tmp/tri && /tmp/tri/bin/pip install triton==3.6.0`): Triton's own compiler
takes each IR file to PTX for sm_90 and ptxas reports registers, spills and shared memory.
It is the closest check of the GPU build short of a GPU; it says nothing about speed.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

# name: (head_dim, block_size, q dtype, kv dtype, block_m, GQA group)
CONFIGS = {
    "decode_bf16_h128_bs16_g4_bm16": (128, 16, "bfloat16", "bfloat16", 16, 4),
    "prefill_bf16_h128_bs16_g4_bm64": (128, 16, "bfloat16", "bfloat16", 64, 4),
    "f16_h64_bs128_g3_bm64": (64, 128, "float16", "float16", 64, 3),
    "f32_h64_bs32_g8_bm16": (64, 32, "float32", "float32", 16, 8),
    "fp8e4m3_bf16_h128_bs16_g4_bm16": (128, 16, "bfloat16", "float8_e4m3fn", 16, 4),
    "fp8e5m2_bf16_h128_bs64_g1_bm64": (128, 64, "bfloat16", "float8_e5m2", 64, 1),
}


def dump(out_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as registration

    from benchmarks.kernels import make_case
    from pagedjax.ops.paged_attention_pallas import paged_attention_pallas

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    os.makedirs(out_dir, exist_ok=True)
    for name, (H, bs, q_dtype, kv_dtype, block_m, group) in CONFIGS.items():
        q, k, v, md, _ = make_case(
            4,
            100,
            8,
            heads=2 * group,
            kv_heads=2,
            head_dim=H,
            block_size=bs,
            dtype=jnp.float32,
            seed=0,
        )
        q, k, v = q.astype(q_dtype), k.astype(kv_dtype), v.astype(kv_dtype)

        def f(q, k, v, md, block_m=block_m):
            return paged_attention_pallas(
                q,
                k,
                v,
                0,
                md,
                sm_scale=0.1,
                k_scale=0.5,
                v_scale=2.0,
                interpret=False,
                block_m=block_m,
            )

        captured.clear()
        jax.jit(f).trace(q, k, v, md).lower(lowering_platforms=("cuda",))
        with open(os.path.join(out_dir, f"{name}.ttir"), "w") as fh:
            fh.write(captured[-1])
        print(f"lowered {name}")


def compile_all(in_dir: str, num_warps: int = 4, num_stages: int = 2) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    print(f"triton {triton.__version__}, sm_90, num_warps={num_warps}, num_stages={num_stages}")
    for path in sorted(glob.glob(os.path.join(in_dir, "*.ttir"))):
        kernel = triton_compile(
            path,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages),
        )
        ptx = path[:-5] + ".ptx"
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        res = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", path[:-5] + ".cubin"],
            capture_output=True,
            text=True,
            check=True,
        )
        info = [line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()]
        info = [s for s in info if "registers" in s or "spill" in s]
        print(
            f"{os.path.basename(path)[:-5]}: shared {kernel.metadata.shared} B; {'; '.join(info)}"
        )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit(__doc__)
    (dump if sys.argv[1] == "dump" else compile_all)(sys.argv[2])
