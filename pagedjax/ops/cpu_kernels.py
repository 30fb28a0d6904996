"""The native CPU kernels' library: C++ XLA FFI custom calls, built on first use.

Two kernels live in `csrc/` and are compiled into one shared library:
    paged_attention_cpu.cc  ragged paged attention (`cpu_attention.paged_attention`)
    linear_cpu.cc           float32 x @ W[layer] over a stacked weight (`cpu_linear.matmul`)
The first is the "cpu" attention backend (`attention_backend="cpu"`), the second the "cpu"
linear backend (`linear_backend="cpu"`); "auto" picks both on one CPU device.

The library is compiled with the system C++ compiler ($CXX, else g++; `-O3 -march=native`)
against the FFI headers that ship with jaxlib, into `<cache root>/kernels/` (see
`paths.cache_root`), keyed by the sources and their header, the flags, the jaxlib
version and the CPU model. `available()` is False, with the reason logged once, when there is
no compiler or the build fails; `attention_backend` and `linear_backend` "auto" then keep
"xla".
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

from pagedjax.paths import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention_cpu.cc", CSRC / "linear_cpu.cc")
HEADERS = (CSRC / "simd.h",)  # included by the sources: part of the cache key
# FFI target name -> the handler symbol the library exports.
TARGETS = {
    "pagedjax_paged_attention_cpu": "PagedAttentionCpu",
    "pagedjax_linear_cpu": "LinearCpu",
}
CXX_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",  # fused multiply-adds, whatever the compiler's default
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
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
    key = "|".join(
        [
            *(f.read_text() for f in (*SOURCES, *HEADERS)),
            cxx,
            " ".join(CXX_FLAGS),
            jax.__version__,
            platform.machine(),
            _cpu_model(),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"pagedjax_cpu-{digest}.so"


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
        cmd = [
            cxx,
            *CXX_FLAGS,
            f"-I{include}",
            f"-I{CSRC}",
            *map(str, SOURCES),
            "-o",
            str(tmp_path),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CPU kernels failed:\n{' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp_path, out)
    finally:
        tmp_path.unlink(missing_ok=True)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the custom calls once; returns None, or why they are unavailable."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
    except (RuntimeError, OSError, AttributeError) as e:
        logger.warning("native CPU kernels unavailable, using the XLA path: %s", e)
        return str(e)
    return None


def available() -> bool:
    """True when the kernel library is built and registered (builds it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (the compiler's complaint), or None when available."""
    return _load()
