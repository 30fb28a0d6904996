"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against Hugging Face transformers (torch,
float32): prefill logits and greedy generation of tiny random checkpoints (8 experts, top-2);
the router and the grouped matmul on hand-made cases (one expert for every token, experts
with no token, one token, tied router logits); FLOPs that follow top-k, not the number of
experts; int8 / fp8 expert stacks; expert parallelism on 8 simulated devices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import forward_chunks, hf_greedy, hf_model, make_checkpoint, randomize_norms

from pagedjax import SamplingParams
from pagedjax.models import loader, registry
from pagedjax.models.mixtral import MixtralArchConfig
from pagedjax.models.moe_layer import group_layout, moe_block, route, tile_rows
from pagedjax.models.qwen3_moe import Qwen3MoeArchConfig
from pagedjax.ops.quant import QuantizedWeight, quantize_params

MAX_TOKENS = 8
EXPERT_NAMES = ("experts_gate", "experts_up", "experts_down")
CASES = {
    "mixtral": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2),
    # 3 layers, layer 1 dense (mlp_only_layers); expert MLP size != the dense one
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # no renormalisation of the top-k weights; every other layer sparse
    "qwen3_moe-step2": dict(
        arch="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
}


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory):
    dirs = {}

    def get(name):
        if name not in dirs:
            folder = make_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
            randomize_norms(folder, seed=len(dirs) + 7)
            dirs[name] = folder
        return dirs[name]

    return get


def _load(folder, quantization=None):
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, "float32", quantization=quantization)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_hf(moe_dirs, name):
    folder = moe_dirs(name)
    cfg, params = _load(folder)
    want_cls = MixtralArchConfig if name == "mixtral" else Qwen3MoeArchConfig
    assert type(cfg) is want_cls and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    if name == "qwen3_moe":
        assert cfg.sparse_layers == (0, 2) and params["layers"]["gate_proj"].shape[-1] == 128
    if name == "qwen3_moe-step2":
        assert cfg.sparse_layers == (1,) and not cfg.norm_topk_prob
    ids = np.random.default_rng(0).integers(3, 259, size=45).tolist()
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([ids])).logits[0].numpy()
    for chunks in ([ids], [ids[:13], ids[13:30], *([t] for t in ids[30:33]), ids[33:]]):
        got = forward_chunks(params, cfg, chunks, "reference")
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"{name} {len(chunks)}")


@pytest.fixture(scope="session")
def moe_prompts():
    """Eight prompts of 1 to 90 tokens; the 47- and 90-token ones start with the 33- and
    64-token ones (prefix-cache hits)."""
    rng = np.random.default_rng(4321)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (1, 5, 16, 17, 33, 47, 64, 90)]
    prompts[5][:33] = prompts[4]
    prompts[7][:64] = prompts[6]
    return prompts


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_greedy_generation_matches_hf(make_llm, moe_dirs, moe_prompts, name):
    """The eight prompts together, prefilled in chunks of at most 32 tokens, with prefix
    caching, in a pool that forces preemption: HF's tokens, token for token."""
    folder = moe_dirs(name)
    longest = max(map(len, moe_prompts)) + MAX_TOKENS
    llm = make_llm(
        folder,
        block_size=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        num_gpu_blocks_override=math.ceil(longest / 16) + 1,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in moe_prompts], greedy, use_tqdm=False)
    model = hf_model(folder)
    for p, out in zip(moe_prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, p, MAX_TOKENS), len(p)
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


# ----------------------------------------------------------------------------- the MoE block


def _experts(E=8, D=16, F=24, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "experts_gate": jnp.asarray(rng.normal(0, 0.3, (E, D, F)), jnp.float32),
        "experts_up": jnp.asarray(rng.normal(0, 0.3, (E, D, F)), jnp.float32),
        "experts_down": jnp.asarray(rng.normal(0, 0.3, (E, F, D)), jnp.float32),
    }


def _dense_reference(w, x, ids, weights):
    """Every token through each of its experts one by one (numpy float64)."""
    g, u, d = (np.asarray(w[k], np.float64) for k in ("experts_gate", "experts_up", "experts_down"))
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(np.asarray(ids[t]), np.asarray(weights[t]), strict=True):
            a = x[t] @ g[e]
            out[t] += wt * (((a / (1 + np.exp(-a))) * (x[t] @ u[e])) @ d[e])
    return out


def _route_and_check(w, x, router, k=2, norm=True):
    ids, weights = route(x, router, k, norm)
    got = jax.jit(moe_block)(w, x, ids, weights)
    np.testing.assert_allclose(got, _dense_reference(w, x, ids, weights), atol=1e-5, rtol=1e-5)
    return np.asarray(ids), np.asarray(weights)


def test_router_is_hfs_softmax_topk():
    """route() is HF's router: softmax in float32, top-k, renormalised (Mixtral; Qwen3-MoE
    with norm_topk_prob) or not (Qwen3-MoE without)."""
    rng = np.random.default_rng(1)
    x, router = (
        rng.normal(size=(9, 16)).astype(np.float32),
        rng.normal(size=(16, 8)).astype(np.float32),
    )
    for norm in (True, False):
        ids, weights = route(jnp.asarray(x), jnp.asarray(router), 2, norm)
        probs = torch.softmax(torch.tensor(x @ router, dtype=torch.float32), dim=-1)
        top, idx = torch.topk(probs, 2, dim=-1)
        if norm:
            top = top / top.sum(-1, keepdim=True)
        np.testing.assert_array_equal(ids, idx.numpy())
        np.testing.assert_allclose(weights, top.numpy(), rtol=1e-6)


def test_every_token_to_one_expert():
    """A router that sends every token to expert 3: with k = 1 the seven other experts get
    nothing; with k = 2 expert 3 is every token's first choice."""
    w = _experts()
    rng = np.random.default_rng(2)
    x = jnp.asarray(np.abs(rng.normal(size=(11, 16))) + 0.1, jnp.float32)  # positive
    router = rng.normal(0, 0.01, (16, 8)).astype(np.float32)
    router[:, 3] += 5.0  # a logit of >= 8 for expert 3, about 0 for the others
    ids, weights = _route_and_check(w, x, jnp.asarray(router), k=1)
    assert (ids == 3).all() and np.allclose(weights, 1.0)
    ids, _ = _route_and_check(w, x, jnp.asarray(router), k=2)
    assert (ids[:, 0] == 3).all()


def test_experts_without_tokens_and_one_token():
    """One token (a decode step of one sequence): six of the eight experts get nothing."""
    w = _experts()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, 16)), jnp.float32)
    ids, _ = _route_and_check(w, x, jnp.asarray(rng.normal(size=(16, 8)), jnp.float32))
    assert len(set(ids[0].tolist())) == 2
    # k = 1 and 8 (all experts) too
    for k in (1, 8):
        _route_and_check(w, x, jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), k=k)


def test_tied_router_logits_as_torch_topk():
    """Exactly tied probabilities: the experts torch.topk (CPU) picks, which is not the
    lowest index (three tied experts 1, 2, 3 in a top-2: torch takes 1 and 3); and the same
    choice for a token alone as in a batch."""
    router = np.zeros((16, 8), np.float32)
    router[:, [1, 2, 3]] = 1.0  # experts 1, 2 and 3 tie for every token
    x = np.abs(np.random.default_rng(4).normal(size=(5, 16))).astype(np.float32)
    ids, _ = _route_and_check(_experts(), jnp.asarray(x), jnp.asarray(router))
    probs = torch.softmax(torch.tensor(x @ router), -1)
    want = torch.topk(probs, 2).indices.numpy()
    assert sorted(want[0].tolist()) == [1, 3]
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want.tolist()]
    one, _ = route(jnp.asarray(x[:1]), jnp.asarray(router), 2, True)
    assert sorted(np.asarray(one)[0].tolist()) == [1, 3]


@pytest.mark.parametrize("E,k", [(8, 2), (8, 7), (16, 4), (60, 4), (128, 8)])
def test_tie_choice_matches_torch_topk_on_random_ties(E, k):
    """Rows of few distinct values (many ties at the top-k boundary), and all-equal rows:
    the chosen set is torch.topk's in every row, in descending value order."""
    from pagedjax.models.router_topk import topk_like_torch

    vals = np.random.default_rng(E + k).integers(0, 3, size=(48, E)).astype(np.float32)
    vals[:4] = 1.0
    got = np.asarray(jax.jit(topk_like_torch, static_argnums=1)(jnp.asarray(vals), k))
    want = torch.topk(torch.tensor(vals), k).indices.numpy()
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]
    picked = np.take_along_axis(vals, got, axis=-1)
    assert (np.diff(picked, axis=-1) <= 0).all()


@pytest.mark.parametrize("n", [2, 3, 8, 32, 60])
def test_small_top_k_equals_lax_top_k(n):
    """The router's one-at-a-time top-k equals `jax.lax.top_k` (values and indices, equal
    values by ascending index) on rows full of ties, for every k it handles, and with -inf."""
    from pagedjax.models.router_topk import SMALL_K, top_k

    rng = np.random.default_rng(n)
    vals = (np.round(rng.random((40, n)) * 4) / 4).astype(np.float32)
    vals[0] = 0.5  # all equal
    vals[1, ::2] = -np.inf
    ks = range(1, min(n, SMALL_K) + 1)
    # every k in one compiled function (one compilation per n, not per k)
    got_all = jax.jit(lambda v: [top_k(v, k) for k in ks])(jnp.asarray(vals))
    for k, got in zip(ks, got_all, strict=True):
        want = jax.lax.top_k(jnp.asarray(vals), k)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), k


@pytest.mark.parametrize("A,E", [(1, 8), (16, 8), (16, 33), (512, 8), (512, 32), (4096, 128)])
def test_tile_layout(A, E):
    """Every tile holds one group's assignments; rows computed <= 1.5 x A + one tile."""
    m, n_tiles = tile_rows(A, E)
    rng = np.random.default_rng(A + E)
    group = rng.integers(0, E, size=A).astype(np.int32)
    group[: A // 2] = 0  # a crowded group and sparse ones
    order, dest, tile_group = (
        np.asarray(a) for a in group_layout(jnp.asarray(group), E, m, n_tiles)
    )
    assert n_tiles * m <= 1.5 * A + m
    assert sorted(order.tolist()) == list(range(A)) and len(set(dest.tolist())) == A
    assert (dest < n_tiles * m).all()
    np.testing.assert_array_equal(tile_group[dest // m], group[order])


def _moe_flops(E: int, T: int = 64, k: int = 2, D: int = 64, F: int = 128) -> float:
    w = _experts(E, D, F)
    x = jnp.zeros((T, D), jnp.float32)
    ids = jnp.zeros((T, k), jnp.int32)
    weights = jnp.zeros((T, k), jnp.float32)
    compiled = jax.jit(moe_block).lower(w, x, ids, weights).compile()
    return compiled.cost_analysis()["flops"]


def test_flops_follow_top_k_not_the_number_of_experts():
    """XLA's cost analysis of the MoE block at fixed top-2 and token count: 32 experts cost
    at most 1.5x the FLOPs of 8; the total is within 1.7x of the 2*3*T*k*D*F
    that the chosen experts need (rows padded to whole tiles: at most 1.5x, plus the
    element-wise work); a dense pass over 8 experts would be 4x that."""
    f8, f32 = _moe_flops(8), _moe_flops(32)
    assert f32 <= 1.5 * f8, (f8, f32)
    need = 2 * 3 * 64 * 2 * 64 * 128
    assert need <= f8 <= 1.7 * need, (f8, need)


def test_packed_experts_native_matmul(moe_dirs):
    """linear_backend="cpu": expert stacks packed for the native grouped matmul ([L, E, P,
    D, 16] panels, each expert read in place) give the float logits, for one-token steps and
    a 45-token chunk."""
    from pagedjax.ops import cpu_kernels, cpu_linear

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    folder = moe_dirs("mixtral")
    cfg, params = _load(folder)
    packed = cpu_linear.pack_params(params)
    assert isinstance(packed["layers"]["experts_gate"], cpu_linear.PackedWeight)
    assert packed["layers"]["experts_gate"].shape == (2, 8, 64, 128)
    ids = np.random.default_rng(7).integers(3, 259, size=52).tolist()
    chunks = [ids[:45], *([t] for t in ids[45:52])]
    want = forward_chunks(params, cfg, chunks, "reference")
    got = forward_chunks(packed, cfg, chunks, "reference")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_packed_router_logits_do_not_depend_on_the_step(moe_dirs):
    """The router is packed with the experts, so a token's router logits (and so its experts
    and their weights) are the same bits in a step of 1, 7 or 64 rows as in one of 192: XLA's
    dot on the plain router rounds by the step's shape (on an AVX2 EPYC it differed by
    ~5e-7 and broke the batch invariance of a Mixtral's logprobs)."""
    from pagedjax.ops import cpu_kernels, cpu_linear
    from pagedjax.ops.linear import LayerView, linear

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    _, params = _load(moe_dirs("mixtral"))
    router = cpu_linear.pack_params(params)["layers"]["router"]
    assert isinstance(router, cpu_linear.PackedWeight) and router.shape == (2, 64, 8)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((192, 64)), jnp.float32)

    @jax.jit
    def f(x, layer):
        w = LayerView(router, layer)
        return (linear(x, w), *route(x, w, 2, True))

    for layer in map(jnp.int32, (0, 1)):
        full = f(x, layer)
        for T in (1, 7, 64):
            for a, b in zip(f(x[:T], layer), full, strict=True):
                np.testing.assert_array_equal(a, b[:T])


# ----------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_expert_stacks(moe_dirs, method):
    """int8 / fp8 expert stacks (per-expert, per-output-channel scales [L, E, out]): the MoE
    block on quantized experts equals the block on their dequantized weights (same routing,
    within float32 rounding for int8, fp8 activation rounding for fp8), and the whole model
    stays close to the float one (a token whose router choice flips under quantization moves
    more: most positions within 0.1, the same argmax at >= 90 % of positions)."""
    from pagedjax.ops.quant import dequantize

    folder = moe_dirs("mixtral")
    cfg, params = _load(folder)
    _, qparams = _load(folder, quantization=method)
    layers = qparams["layers"]
    w = layers["experts_gate"]
    assert isinstance(w, QuantizedWeight) and w.method == method
    assert w.qweight.shape == (2, 8, 64, 128) and w.scales.shape == (2, 8, 128)
    assert isinstance(quantize_params(params, method)["layers"]["experts_down"], QuantizedWeight)
    # one layer's block, quantized against dequantized experts, on the same routing
    q_experts = {n: jax.tree.map(lambda a: a[0], layers[n]) for n in EXPERT_NAMES}
    deq = {n: dequantize(q_experts[n]) for n in EXPERT_NAMES}
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(13, 64)), jnp.float32)
    ids, weights = route(x, params["layers"]["router"][0], 2, True)
    got, want = moe_block(q_experts, x, ids, weights), moe_block(deq, x, ids, weights)
    tol = 1e-4 if method == "int8" else 0.1  # fp8 rounds activations to 4 significant bits
    np.testing.assert_allclose(got, want, atol=tol * float(jnp.abs(want).max()), rtol=0)
    ids = np.random.default_rng(5).integers(3, 259, size=40).tolist()
    ref = forward_chunks(params, cfg, [ids], "reference")
    out = forward_chunks(qparams, cfg, [ids], "reference")
    rel = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)  # [positions]
    assert np.median(rel) < {"int8": 0.1, "fp8": 0.3}[method], rel


# ----------------------------------------------------------------------------- config


def test_expert_parallel_needs_experts(tiny_llama_dir, moe_dirs):
    from pagedjax.engine_args import EngineArgs

    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineArgs(model=str(tiny_llama_dir), enable_expert_parallel=True).create_engine_config()
    args = EngineArgs(model=str(moe_dirs("mixtral")), enable_expert_parallel=True)
    assert args.create_engine_config().model_config.arch.expert_parallel
    model = registry.get_model("MixtralForCausalLM")
    cfg = args.create_engine_config().model_config.arch
    assert model.param_logical_axes(cfg)["layers"]["experts_gate"][1] == "expert"


# ----------------------------------------------------------------------------- sharding

EXPERT_STACKS = ("['layers']['experts_gate']", "['layers']['experts_up']")


@pytest.mark.parametrize(
    "model,layout",
    [("mixtral", x) for x in ("tp2", "tp4", "ep2", "ep4", "ep2-pp2")]
    + [("qwen3_moe-l3", "ep2"), ("qwen3_moe-l3", "ep2-pp2")],
)
def test_moe_greedy_identical_to_one_device(moe_sharding_report, model, layout):
    rep = moe_sharding_report[model]
    assert rep[layout]["tokens"] == rep["single"]["tokens"]


def test_int8_experts_under_expert_parallelism(moe_sharding_report):
    rep = moe_sharding_report["mixtral"]
    assert rep["ep2-int8"]["tokens"] == rep["int8"]["tokens"]
    shapes = rep["ep2-int8"]["replicas"][0]["params"]
    # qweight [L, E, D, Fe] and scales [L, E, Fe]: 4 whole experts per device
    assert shapes["['layers']['experts_gate'].qweight"] == [[2, 4, 64, 128]] * 2
    assert shapes["['layers']['experts_gate'].scales"] == [[2, 4, 128]] * 2


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("single", [2, 8, 64, 128]),
        ("tp2", [2, 8, 64, 64]),  # each expert's MLP columns split, as a dense MLP
        ("tp4", [2, 8, 64, 32]),
        ("ep2", [2, 4, 64, 128]),  # num_experts / EP whole experts per device
        ("ep4", [2, 2, 64, 128]),
        ("ep2-pp2", [1, 4, 64, 128]),  # and one layer per stage
    ],
)
def test_expert_shard_shapes(moe_sharding_report, layout, shape):
    rep = moe_sharding_report["mixtral"][layout]["replicas"][0]
    devices = {"single": 1, "tp2": 2, "tp4": 4, "ep2": 2, "ep4": 4, "ep2-pp2": 4}[layout]
    assert len(rep["devices"]) == devices
    for name in EXPERT_STACKS:
        if layout == "single":  # one CPU device: packed for the native matmul (panels of 16)
            L, E, D, F = shape
            assert rep["params"][name + ".panels"] == [[L, E, F // 16, D, 16]]
            continue
        assert rep["params"][name] == [shape] * devices
    down = [shape[0], shape[1], shape[3], shape[2]] if "ep" in layout else None
    if down:
        assert rep["params"]["['layers']['experts_down']"] == [down] * devices


def test_weight_bytes_per_device_under_expert_parallelism(moe_sharding_report):
    """The layout line's per-device param bytes and the KV sizing's weight bytes count each
    device's share: under EP=2 a device holds half the expert stacks (3 x 2 x 4 x 64 x 128
    float32 of the 3 x 2 x 8 x 64 x 128), under EP=4 a quarter."""
    rep = moe_sharding_report["mixtral"]
    expert_bytes = 3 * 2 * 8 * 64 * 128 * 4
    single = rep["single"]["replicas"][0]["param_bytes"]["0"]
    assert rep["single"]["replicas"][0]["weight_bytes"] == single
    for layout, P in (("ep2", 2), ("ep4", 4)):
        r = rep[layout]["replicas"][0]
        per_device = set(r["param_bytes"].values())
        assert len(per_device) == 1 and r["weight_bytes"] == per_device.pop()
        # what besides the experts each device holds is what TP=P holds besides its experts
        tp = rep[f"tp{P}"]["replicas"][0]["param_bytes"]["0"]
        assert r["weight_bytes"] == tp  # (experts by index or by columns: the same share)
        assert r["weight_bytes"] <= single - expert_bytes * (P - 1) / P


@pytest.mark.parametrize("layout", ["tp2", "ep2", "ep2-pp2"])
def test_collectives_per_layer(moe_sharding_report, layout):
    """The compiled step's collectives inside loops: only the layer scan's body has any, and
    per layer they are two all-reduces (after attention's o_proj; after the experts: their
    down projection's partial sums under TP, the psum returning each device's experts'
    outputs under EP), no all-to-all and no all-gather (expert weights never move); under
    PP=2 the stage loop adds the collective-permute that hands activations on."""
    ops = moe_sharding_report["mixtral"][layout]["replicas"][0]["collectives"]
    loops = [c for name, c in ops.items() if name.startswith("while:") and c]
    want = {"all-reduce": 2}
    if "pp2" in layout:
        want["collective-permute"] = 1
    assert loops == [want], ops


@pytest.mark.parametrize("arch", ["qwen2moe", "llama"])
def test_gguf_mixture_of_experts_is_refused_by_name(tmp_path, arch):
    """A GGUF MoE file other than qwen3moe (which loads: tests/test_gguf_moe.py), e.g.
    qwen2moe or llama.cpp's Mixtral ("llama" with expert_count), is refused with a message
    naming it, not misread as a dense model."""
    import gguf

    from pagedjax.models.gguf_file import gguf_arch_config

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_expert_count(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"mixture-of-experts.*{arch}"):
        gguf_arch_config(gguf.GGUFReader(str(path)))


def test_fused_expert_tensors_load_as_per_expert_ones(moe_dirs, tmp_path):
    """transformers 5's fused expert stacks (`experts.gate_up_proj` [E, 2 Fe, D],
    `experts.down_proj` [E, D, Fe]) load to the same params as the per-expert tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = moe_dirs("mixtral")
    tensors = load_file(str(folder / "model.safetensors"))
    fused = {}
    for layer in range(2):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        w = {
            n: [tensors.pop(f"{pre}.{e}.{n}.weight") for e in range(8)] for n in ("w1", "w2", "w3")
        }
        fused[f"{pre}.gate_up_proj"] = np.stack(
            [np.concatenate([g, u]) for g, u in zip(w["w1"], w["w3"], strict=True)]
        )
        fused[f"{pre}.down_proj"] = np.stack(w["w2"])
    out = tmp_path / "fused"
    shutil.copytree(folder, out)
    save_file({**tensors, **fused}, str(out / "model.safetensors"), metadata={"format": "pt"})
    _, want = _load(folder)
    _, got = _load(out)
    for name in ("experts_gate", "experts_up", "experts_down", "router"):
        np.testing.assert_array_equal(got["layers"][name], want["layers"][name])


def test_enable_expert_parallel_flag():
    import argparse

    from pagedjax.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--enable-expert-parallel"])
    assert EngineArgs.from_cli_args(ns).enable_expert_parallel is True
    assert (
        EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).enable_expert_parallel
        is False
    )
