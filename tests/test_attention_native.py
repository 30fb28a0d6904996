"""The native CPU paged-attention kernel (`ops.cpu_attention`) on every ISA path this CPU
runs, forced: against a dense float64 NumPy softmax (float32, bfloat16 and float8 caches,
windows, soft-caps, prefill and decode rows), the row maximum found at every place in a row,
a sequence split by KV head bit-identical to the batch, every float8 byte read exactly, and
a failed build reported. (The kernel against the jnp reference is in test_attention.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.ops import cpu_attention, cpu_kernels

# Query scale of the soft-cap cases: scores of about +-20, so that caps of 30 and 50 bend them.
CAP_Q_SCALE = 20.0


@pytest.mark.parametrize(
    "head_dim,dtype,window,cap",
    [
        (64, "float32", None, None),
        (24, "float32", None, None),
        (64, "bfloat16", None, None),
        (64, "float8_e4m3fn", None, None),
        (32, "float8_e5m2", None, None),
        (64, "float32", 7, 30.0),
        (24, "float32", 20, 50.0),
        (64, "float8_e4m3fn", 33, None),
        (32, "float8_e5m2", None, 30.0),
        (16, "float8_e4m3fn", None, None),  # one 16-float vector (AVX-512), two, four
        (80, "float32", None, None),  # 5 AVX-512 vectors, 10 AVX2 ones
    ],
)
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_native_kernel_matches_numpy(head_dim, dtype, window, cap, isa):
    """`cpu_attention.paged_attention` against a dense NumPy softmax: register-tiled head dims
    (64, 32) and the generic loop (24); float32, bfloat16 and float8 caches (with scales);
    scattered blocks; decode rows (one ending mid-block, a one-token context), a prefill chunk
    after a cached prefix that spans two query tiles, a padding sequence and padding tokens;
    sliding windows (shorter than a block, across blocks) and logit soft-caps (the kernel's
    vectorised tanh on both sides of its branch at |x| = 0.625, and its scalar tail). Every
    ISA path this CPU runs, forced."""
    rng = np.random.default_rng(head_dim)
    L, NB, BS, K, G, B = 3, 48, 16, 2, 3, 8
    lens = np.array([37, 1, 64, 0, 100], np.int32)
    qlens = np.array([1, 1, 1, 0, 21], np.int32)  # the last: prefill of positions 79..99
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    T = int(qsl[-1]) + 3  # three padding tokens
    tables = rng.permutation(np.arange(1, NB))[: len(lens) * B].reshape(len(lens), B)
    tables = tables.astype(np.int32)
    shape = (L, NB, BS, K, head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    k_scale, v_scale = (0.5, 1.5) if "float8" in dtype else (None, None)
    kc, vc = jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)
    k_read = np.asarray(kc.astype(jnp.float32)) * (k_scale or 1.0)  # what the cache holds
    v_read = np.asarray(vc.astype(jnp.float32)) * (v_scale or 1.0)
    q = rng.standard_normal((T, K * G, head_dim), np.float32)
    if cap is not None:
        q *= CAP_Q_SCALE
    scale = head_dim**-0.5
    got = np.asarray(
        jax.jit(
            lambda q, kc, vc, lens, qsl, tables, window: cpu_attention.paged_attention(
                q,
                kc,
                vc,
                2,
                lens,
                qsl,
                tables,
                sm_scale=scale,
                k_scale=k_scale,
                v_scale=v_scale,
                sliding_window=window,
                logit_soft_cap=cap,
                isa=isa,
            )
        )(
            jnp.asarray(q),
            kc,
            vc,
            jnp.asarray(lens),
            jnp.asarray(qsl),
            jnp.asarray(tables),
            jnp.int32(window or 0),  # traced
        )
    )
    assert not got[qsl[-1] :].any(), "padding tokens must be zero"
    for s, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
        for i in range(ql):
            ctx = n - ql + i + 1  # the query's position + 1
            pos = np.arange(max(0, ctx - window) if window else 0, ctx)  # positions it sees
            ks = k_read[2, tables[s, pos // BS], pos % BS]  # [ctx, K, H]
            vs = v_read[2, tables[s, pos // BS], pos % BS]
            for h in range(K * G):
                sc = ks[:, h // G].astype(np.float64) @ q[qsl[s] + i, h] * scale
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                p = np.exp(sc - sc.max())
                want = (p / p.sum()) @ vs[:, h // G]
                np.testing.assert_allclose(got[qsl[s] + i, h], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_native_kernel_finds_the_row_maximum_anywhere(isa):
    """Decode rows whose one large score (450 against others within about +-150) lies at the
    row's first position, inside its vector loop, in its last full vector, in its scalar tail,
    or in a row of exactly one vector after the first position (the kernel's `MaxOf`, per ISA
    path). exp(score - max) overflows to inf unless the maximum is found, and with it found
    every other weight is exactly 0: the output is that position's value row."""
    rng = np.random.default_rng(7)
    H, BS, B = 64, 16, 8
    cases = [(37, 0), (37, 5), (37, 20), (37, 32), (37, 36), (17, 16), (100, 99), (100, 50)]
    S = len(cases)
    tables = (1 + np.arange(S * B, dtype=np.int32)).reshape(S, B)
    k = rng.standard_normal((1, S * B + 1, BS, 1, H)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    k[..., 0] = np.clip(k[..., 0], -4.0, 4.0)  # the other scores: 300 / 8 * k0, within +-150
    for s, (_, pos) in enumerate(cases):
        k[0, tables[s, pos // BS], pos % BS, 0, 0] = 12.0  # score 300 / 8 * 12 = 450
    q = np.zeros((S, 1, H), np.float32)
    q[..., 0] = 300.0
    got = np.asarray(
        cpu_attention.paged_attention(
            jnp.asarray(q),
            jnp.asarray(k),
            jnp.asarray(v),
            0,
            jnp.asarray([n for n, _ in cases], jnp.int32),
            jnp.arange(S + 1, dtype=jnp.int32),
            jnp.asarray(tables),
            sm_scale=H**-0.5,
            isa=isa,
        )
    )
    for s, (_, pos) in enumerate(cases):
        want = v[0, tables[s, pos // BS], pos % BS, 0]
        np.testing.assert_allclose(got[s, 0], want, atol=1e-6, err_msg=f"case {cases[s]}")


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_native_kernel_one_sequence_split_by_kv_head_matches_the_batch(dtype, isa):
    """A step of one decode sequence is split into one work item per KV head (each reading
    and converting only its head's part of every block); its output is bit-identical to the
    same sequence's row in a step of five sequences (one item per sequence, every head)."""
    rng = np.random.default_rng(11)
    NB, BS, K, G, H, B = 40, 16, 2, 3, 64, 4
    lens = np.array([37, 50, 3, 64, 20], np.int32)
    tables = rng.permutation(np.arange(1, NB))[: 5 * B].reshape(5, B).astype(np.int32)
    kc = jnp.asarray(rng.standard_normal((1, NB, BS, K, H), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((1, NB, BS, K, H), np.float32)).astype(dtype)
    q = rng.standard_normal((5, K * G, H), np.float32)

    def run(rows):
        n = len(rows)
        return np.asarray(
            cpu_attention.paged_attention(
                jnp.asarray(q[rows]),
                kc,
                vc,
                0,
                jnp.asarray(lens[rows]),
                jnp.arange(n + 1, dtype=jnp.int32),
                jnp.asarray(tables[rows]),
                sm_scale=H**-0.5,
                isa=isa,
            )
        )

    batch = run([0, 1, 2, 3, 4])
    for s in range(5):
        assert np.array_equal(run([s])[0], batch[s]), s


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_native_kernel_reads_every_float8_byte_exactly(dtype, isa):
    """A one-token context gives out = v_scale * V[pos 0] exactly (softmax weight 1): one V
    row holding all 256 byte values (4 KV heads x 64) comes back as ml_dtypes' float32 value
    of each byte, subnormals included, on every ISA path (the kernel's
    in-register float8 -> float32 conversion). Inf / NaN bytes are left out: a quantized
    cache is saturated to finite values."""
    fp8 = jnp.dtype(dtype)
    data = np.arange(256, dtype=np.uint8).view(fp8)
    want = data.astype(np.float32)
    data = np.where(np.isfinite(want), data, np.zeros((), fp8))  # inf / NaN bytes -> 0
    want = data.astype(np.float32).reshape(4, 64)
    v = np.zeros((1, 2, 1, 4, 64), fp8)
    v[0, 1, 0] = data.reshape(4, 64)
    k = np.zeros((1, 2, 1, 4, 64), fp8)
    q = np.ones((1, 4, 64), np.float32)
    one = jnp.ones((1,), jnp.int32)
    got = cpu_attention.paged_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        0,
        one,
        jnp.asarray([0, 1], jnp.int32),
        one.reshape(1, 1),
        sm_scale=1.0,
        v_scale=2.0,
        isa=isa,
    )
    np.testing.assert_array_equal(np.asarray(got)[0], 2.0 * want)


def test_native_kernel_reports_a_failed_build(monkeypatch, tmp_path):
    """No compiler: `build` names it; the engine's "auto" backend then keeps "xla"."""
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler 'no-such-cxx'"):
        cpu_kernels.build("no-such-cxx")
    # A compiler that fails: the failing command and its output in the message, nothing left
    # in the cache.
    cxx = tmp_path / "bad-cxx"
    cxx.write_text("#!/bin/sh\necho 'bad-cxx: cannot compile' >&2\nexit 1\n")
    cxx.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)building the CPU kernels failed.*cannot compile"):
        cpu_kernels.build(str(cxx))
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".lock"]  # the lock only


_RECORDING_CXX = """#!/bin/sh
# records each call, takes a while, and writes an empty file where -o points
echo "$$ $*" >> "$(dirname "$0")/calls.log"
sleep 1
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && : > "$2"; shift; done
"""


def test_processes_building_at_once_wait_for_one_build(monkeypatch, tmp_path):
    """Three processes asking for the same library at once: one compiles it (each source
    once, one link), the others wait on its lock and return the same file."""
    import subprocess
    import sys

    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    cxx = tmp_path / "cxx"
    cxx.write_text(_RECORDING_CXX)
    cxx.chmod(0o755)
    code = (
        f"from pagedjax.ops import cpu_kernels; print(cpu_kernels.build({str(cxx)!r}, 'portable'))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and outs[0].endswith(".so")
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == len(cpu_kernels.SOURCES) + 1, calls  # each source, then the link
