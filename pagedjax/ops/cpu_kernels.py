"""The native CPU kernels' library: C++ XLA FFI custom calls, built on first use, per ISA path.

Six kernels live in `csrc/` and are compiled into one shared library:
    paged_attention_cpu.cc  ragged paged attention (`cpu_attention.paged_attention`)
    linear_cpu.cc           float32 x @ W[layer] over a stacked weight (`cpu_linear.matmul`),
                            and the experts' grouped matmul (`cpu_linear.grouped_matmul`)
    gguf_linear_cpu.cc      x @ W[layer] over GGUF quantized blocks (`cpu_gguf.matmul`)
    gguf_int8_cpu.cc        the same with x quantized to int8 per 32-value block, integer dot
                            products (`cpu_gguf.matmul(..., activations="int8")`)
    quant_linear_cpu.cc     x @ W[layer] over int8 / AWQ / GPTQ int4 weights (`cpu_quant.matmul`)
    kv_write_cpu.cc         the new K/V rows into their cache slots, in place
                            (`kv_cache.write_kv(..., native=True)`)
The first and the last are the "cpu" attention backend (`attention_backend="cpu"`), the
other four the "cpu" linear backend (`linear_backend="cpu"`); "auto" picks both on one CPU
device. A new kernel
is one more file in SOURCES and one more entry in TARGETS.

ISA paths (`ISAS`, widest first): "avx512" (16-float vectors, 32 registers), "avx2" (8-float
vectors) and "portable" (4-float GCC vectors, any CPU). Each path is a separate build of the
library: the compiler flags of `ISA_FLAGS` plus `-DPAGEDJAX_ISA_<NAME>` (the macro the
sources read through `csrc/simd.h`), and separate FFI target names (`target(name, isa)`
appends `_<isa>`), so that several paths can be loaded in one process (the tests run every
path the machine can). `native_isa()` is the widest path the CPU's flags allow;
`resolve_isa(setting)` turns the engine's `cpu_kernel_isa` ("auto" or a path name) into a
path, refusing one wider than the CPU. The engine sets the process's path once
(`set_default_isa`); the kernels' Python wrappers use it unless given `isa=`.

Each library is compiled with the system C++ compiler ($CXX, else g++) against the FFI
headers that ship with jaxlib, into `<cache root>/kernels/` (see `paths.cache_root`), keyed by
the sources and their headers, the path's flags, the jaxlib version and the CPU model.
`available()` is False, with the reason logged once, when there is no compiler or the build
fails; `attention_backend` and `linear_backend` "auto" then keep "xla".

Threads: each kernel call spreads its work over XLA's intra-op thread pool (the process's
cores). `set_thread_limit(n)` caps that at n threads for every later call of every loaded
path (and of paths loaded later), so that other work of the process can have cores of its own;
the kernels' results do not depend on it (work is split by rows,
columns and heads, never inside a reduction).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax

from pagedjax.ops.choices import CPU_KERNEL_ISAS
from pagedjax.paths import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (  # the longest to compile first (they compile in parallel)
    CSRC / "gguf_int8_cpu.cc",
    CSRC / "paged_attention_cpu.cc",
    CSRC / "gguf_linear_cpu.cc",
    CSRC / "linear_cpu.cc",
    CSRC / "quant_linear_cpu.cc",
    CSRC / "kv_write_cpu.cc",
)
# Included by the sources: part of the cache key.
HEADERS = (
    CSRC / "simd.h",
    CSRC / "parallel.h",
    CSRC / "gguf_blocks.h",
    CSRC / "gguf_int8_panels.h",
)
# FFI target name -> the handler symbol the library exports.
TARGETS = {
    "pagedjax_paged_attention_cpu": "PagedAttentionCpu",
    "pagedjax_linear_cpu": "LinearCpu",
    "pagedjax_grouped_linear_cpu": "GroupedLinearCpu",
    "pagedjax_gguf_linear_cpu": "GgufLinearCpu",
    "pagedjax_gguf_dequantize_cpu": "GgufDequantizeCpu",
    "pagedjax_gguf_linear_int8_cpu": "GgufLinearInt8Cpu",
    "pagedjax_quant_int8_linear_cpu": "QuantInt8LinearCpu",
    "pagedjax_quant_int4_linear_cpu": "QuantInt4LinearCpu",
    "pagedjax_kv_write_cpu": "KvWriteCpu",
}
CXX_FLAGS = (
    "-O3",
    "-ffp-contract=fast",  # fused multiply-adds, whatever the compiler's default
    # Tuned for no CPU in particular, so that a path computes the same bits on every CPU that
    # runs it: GCC's tuning for AMD Zen leaves some multiply-add chains unfused (its
    # avoid-fma-max-bits), differently in different code paths, and a row's bits then depend on
    # its step's size (the batch-invariance tests failed on an EPYC's avx2 path).
    "-mtune=generic",
    "-fno-math-errno",
    "-std=c++17",
    "-fPIC",
)
ISAS = CPU_KERNEL_ISAS  # widest first
ISA_SETTINGS = ("auto", *ISAS)  # the engine's `cpu_kernel_isa`
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# The path's flags on top of CXX_FLAGS: -march=native, with the wider extensions switched
# off for a narrower path (so that the compiler cannot use them either).
ISA_FLAGS = {
    "avx512": ("-march=native",),
    "avx2": ("-march=native", "-mno-avx512f"),
    "portable": ("-march=native", "-mno-avx") if _X86 else ("-march=native",),
}
# CPU flags (/proc/cpuinfo) each x86 path needs.
_ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
    "avx2": {"avx2", "fma"},
    "portable": set(),
}
_default_isa: str | None = None
_libraries: dict[str, ctypes.CDLL] = {}  # ISA path -> its loaded library
_thread_limit = 0  # the last set_thread_limit (0: none)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def runnable_isas() -> tuple[str, ...]:
    """The ISA paths this machine's CPU can run, widest first ("portable" always)."""
    if not _X86:
        return ("portable",)
    flags = _cpu_flags()
    return tuple(isa for isa in ISAS if _ISA_CPU_FLAGS[isa] <= flags)


@functools.cache
def has_cpu_flag(flag: str) -> bool:
    """Whether the CPU reports `flag` in /proc/cpuinfo (e.g. "avx512_vnni"); False elsewhere."""
    return _X86 and flag in _cpu_flags()


def native_isa() -> str:
    """The widest ISA path the CPU runs: "avx512", "avx2" or "portable"."""
    return runnable_isas()[0]


def resolve_isa(setting: str | None = "auto") -> str:
    """The ISA path of a `cpu_kernel_isa` setting: "auto" (or None) is `native_isa()`.

    Raises:
        ValueError: an unknown setting, or a path this CPU cannot run (naming its flags).
    """
    if setting in (None, "auto"):
        return native_isa()
    if setting not in ISAS:
        raise ValueError(f"cpu_kernel_isa must be one of {ISA_SETTINGS}, got {setting!r}")
    if setting not in runnable_isas():
        raise ValueError(
            f"cpu_kernel_isa {setting!r} needs the CPU flags {sorted(_ISA_CPU_FLAGS[setting])}; "
            f"this CPU runs {runnable_isas()}"
        )
    return setting


def set_default_isa(setting: str | None) -> str:
    """Sets the process's ISA path (the engine calls it with `cpu_kernel_isa`); returns it.

    Raises:
        ValueError: as `resolve_isa`.
    """
    global _default_isa
    _default_isa = resolve_isa(setting)
    return _default_isa


def default_isa() -> str:
    """The process's ISA path: the last `set_default_isa`, else `native_isa()`."""
    return _default_isa or native_isa()


def _library_path(cxx: str, isa: str) -> Path:
    key = "|".join(
        [
            *(f.read_text() for f in (*SOURCES, *HEADERS)),
            cxx,
            " ".join((*CXX_FLAGS, *ISA_FLAGS[isa], _isa_define(isa))),
            jax.__version__,
            platform.machine(),
            _cpu_model(),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"pagedjax_cpu-{isa}-{digest}.so"


def _isa_define(isa: str) -> str:
    return f"-DPAGEDJAX_ISA_{isa.upper()}"


def build(cxx: str | None = None, isa: str | None = None) -> Path:
    """Compiles the kernel library of an ISA path (if not built yet) and returns its path.

    Args:
        cxx: the C++ compiler (default $CXX, else g++).
        isa: an ISA path (`ISAS`); None: `default_isa()`.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
        ValueError: an ISA path this CPU cannot run.
    """
    isa = resolve_isa(isa or default_isa())
    cxx = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
    out = _library_path(cxx, isa)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if out.exists():  # another process built it while this one waited
            return out
        return _build(cxx, isa, out)


@contextlib.contextmanager
def _build_lock(out: Path):
    """Holds an exclusive lock (`flock` on "<library>.lock", where the OS has it) while one
    library builds, so processes that need it at once (the test suite's two workers, a
    server's data-parallel engines) wait for one build instead of each compiling it (~35 s
    of compiler time each). The lock file stays; it holds nothing."""
    try:
        import fcntl
    except ImportError:  # no flock: concurrent builds stay correct (atomic rename), only slower
        yield
        return
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(cxx: str, isa: str, out: Path) -> Path:
    """`build`'s compile and link, into a temporary directory renamed to `out`."""
    # a cold start spends tens of seconds here: say so, or the log is silent meanwhile
    logger.info("building the native CPU kernels (%s) with %s, once, into %s", isa, cxx, out)
    started = time.perf_counter()
    flags = [*CXX_FLAGS, *ISA_FLAGS[isa], _isa_define(isa)]
    include = [f"-I{jax.ffi.include_dir()}", f"-I{CSRC}"]
    # Build in a temporary directory and rename: processes building at once never see half a
    # file. Each source compiles on its own core (the library's first build: ~35 s of compiler
    # time, its longest source ~11 s), then one link.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        compiles = [
            [cxx, *flags, *include, "-c", str(src), "-o", str(obj)]
            for src, obj in zip(SOURCES, objects, strict=True)
        ]
        with concurrent.futures.ThreadPoolExecutor(min(len(compiles), os.cpu_count() or 1)) as ex:
            for cmd, done in zip(compiles, ex.map(_compile, compiles), strict=True):
                if done.returncode:
                    raise RuntimeError(
                        f"building the CPU kernels failed:\n{' '.join(cmd)}\n{done.stderr}"
                    )
        tmp_path = Path(tmp) / out.name
        cmd = [cxx, *flags, "-shared", *map(str, objects), "-o", str(tmp_path)]
        done = _compile(cmd)
        if done.returncode:
            raise RuntimeError(f"linking the CPU kernels failed:\n{' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp_path, out)
    logger.info("built the native CPU kernels (%s) in %.1f s", isa, time.perf_counter() - started)
    return out


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.cache
def _load(isa: str) -> str | None:
    """Builds and registers one path's custom calls once; returns None, or why unavailable."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(isa=isa)))
        lib.PagedjaxKernelIsa.restype = ctypes.c_char_p
        built = lib.PagedjaxKernelIsa().decode()
        if built != isa:
            raise RuntimeError(f"the {isa} build of the CPU kernels reports ISA {built!r}")
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(
                target_name(name, isa), jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
        lib.PagedjaxSetThreadLimit.argtypes = [ctypes.c_int64]
        lib.PagedjaxThreadLimit.restype = ctypes.c_int64
        lib.PagedjaxSetThreadLimit(_thread_limit)
        _libraries[isa] = lib
    except (RuntimeError, OSError, AttributeError) as e:
        logger.warning("native CPU kernels (%s) unavailable, using the XLA path: %s", isa, e)
        return str(e)
    return None


def set_thread_limit(limit: int) -> None:
    """Caps the threads of every later native kernel call at `limit` (<= 0: no cap, the
    intra-op pool's size). Applies to every loaded ISA path and to paths loaded later; safe
    to call from any thread while kernels run (each call reads the cap once, when it starts).
    """
    global _thread_limit
    _thread_limit = max(int(limit), 0)
    for lib in list(_libraries.values()):
        lib.PagedjaxSetThreadLimit(_thread_limit)


def thread_limit() -> int:
    """The cap of the last `set_thread_limit` (0: none)."""
    return _thread_limit


def library_thread_limits() -> dict[str, int]:
    """The cap each loaded ISA path's library holds (what its kernels read), by path."""
    return {isa: int(lib.PagedjaxThreadLimit()) for isa, lib in list(_libraries.items())}


def target_name(name: str, isa: str) -> str:
    """The FFI target name of kernel `name` (a key of TARGETS) in the build of `isa`."""
    return f"{name}_{isa}"


def target(name: str, isa: str | None = None) -> str:
    """The FFI target name of kernel `name` (a key of TARGETS) for an ISA path (None:
    `default_isa()`), its library built and registered.

    Raises:
        RuntimeError: that path's library is unavailable (the compiler's complaint).
        ValueError: an ISA path this CPU cannot run.
    """
    isa = resolve_isa(isa or default_isa())
    reason = _load(isa)
    if reason is not None:
        raise RuntimeError(f"native CPU kernels ({isa}) unavailable: {reason}")
    return target_name(name, isa)


def available(isa: str | None = None) -> bool:
    """True when the library of an ISA path (None: `default_isa()`) is built and registered
    (builds it on the first call)."""
    return _load(resolve_isa(isa or default_isa())) is None


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why the kernels of an ISA path are unavailable (the compiler's complaint), or None."""
    return _load(resolve_isa(isa or default_isa()))
