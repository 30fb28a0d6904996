"""Native ragged paged attention for the CPU: a C++ XLA FFI custom call, built on first use.

`csrc/paged_attention_cpu.cc` reads each sequence's K/V rows in place from the paged cache
through its block table, over XLA's intra-op thread pool; the XLA path
(`paged_attention_xla`) must gather every KV chunk into a temporary before its dots, which on
CPU costs more than the arithmetic. It is the "cpu" attention backend: decode rows and
prefill chunks alike, one device (the custom call has no sharding rule).

The library is compiled with the system C++ compiler ($CXX, else g++; `-O3 -march=native`)
against the FFI headers that ship with jaxlib, into `<cache root>/kernels/` (see
`models.loader.cache_root`), keyed by the source, the flags, the jaxlib version and the CPU
model. `available()` is False, with the reason logged once, when there is no compiler or the
build fails; `attention_backend="auto"` then keeps "xla".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cc"
TARGET = "pagedjax_paged_attention_cpu"
QUERY_TILE = 16  # queries of one sequence per work item (they share each block read)
CXX_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
# Cache dtypes the kernel reads (a float8 cache through a byte -> float32 table).
SUPPORTED_CACHE_DTYPES = tuple(
    jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _library_path(cxx: str) -> Path:
    from pagedjax.models.loader import cache_root

    key = "|".join(
        [
            SOURCE.read_text(),
            cxx,
            " ".join(CXX_FLAGS),
            jax.__version__,
            platform.machine(),
            _cpu_model(),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"paged_attention_cpu-{digest}.so"


def build(cxx: str | None = None) -> Path:
    """Compiles the kernel library (if not built yet) and returns its path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
    out = _library_path(cxx)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    include = jax.ffi.include_dir()
    # Build into a temporary file and rename: processes building at once never see half a file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        cmd = [cxx, *CXX_FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp_path, out)
    finally:
        tmp_path.unlink(missing_ok=True)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the custom call once; returns None, or why it is unavailable."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(lib.PagedAttentionCpu), platform="cpu"
        )
    except (RuntimeError, OSError, AttributeError) as e:
        logger.warning("native CPU attention unavailable, using the XLA path: %s", e)
        return str(e)
    return None


def available() -> bool:
    """True when the kernel library is built and registered (builds it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernel is unavailable (the compiler's complaint), or None when it is available."""
    return _load()


def supports(cache_dtype) -> bool:
    """True for a cache dtype the kernel reads."""
    return jnp.dtype(cache_dtype) in SUPPORTED_CACHE_DTYPES


@functools.cache
def _fp8_table(dtype) -> np.ndarray:
    """float32 value of each byte of a float8 format ([256]; zeros for other dtypes)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize != 1:
        return np.zeros(256, np.float32)
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.finfo(dtype).dtype).astype(np.float32)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    query_tile: int = QUERY_TILE,
) -> jax.Array:
    """Causal attention of each query token over its sequence's paged context (native CPU).

    Args:
        q: [T, N, H] queries, flat and ragged (any float dtype; computed in float32).
        k_cache, v_cache: [L, num_blocks, block_size, K, H] float32, bfloat16 or float8.
        layer: scalar index into the L axis.
        seq_lens: [S] int32 context length of each sequence after the step (0: padding).
        query_start_loc: [S + 1] int32; sequence s owns queries [qsl[s], qsl[s + 1]), the
            last at position seq_lens[s] - 1. Tokens past qsl[S] are padding.
        block_tables: [S, B] int32 physical block ids; must cover each context.
        sm_scale: softmax scale.
        k_scale, v_scale: a float8 cache's scalar scales (None: 1.0).
        query_tile: queries of one sequence per work item.

    Returns:
        [T, N, H] float32; padding rows are zero.

    Raises:
        RuntimeError: the kernel is unavailable (`available()` is False).
        ValueError: a cache dtype the kernel does not read.
    """
    if not available():
        raise RuntimeError(f"native CPU attention unavailable: {unavailable_reason()}")
    if not supports(k_cache.dtype):
        raise ValueError(
            f"native CPU attention reads {SUPPORTED_CACHE_DTYPES}, not {k_cache.dtype}"
        )
    scales = jnp.stack(
        [jnp.asarray(1.0 if s is None else s, jnp.float32).reshape(()) for s in (k_scale, v_scale)]
    )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        scales,
        jnp.asarray(_fp8_table(k_cache.dtype)),
        sm_scale=np.float32(sm_scale),
        query_tile=np.int64(query_tile),
    )
