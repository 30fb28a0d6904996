"""Loading a model replica onto its devices: tokenizer, sharding plan and params.

`load_model` reads the checkpoint (converting a GGUF file once), builds the replica's
`ShardingPlan` from the model's logical axes (`models.registry`), and places every weight on
its devices once, as it is read (`models.loader.load_params` with the plan's shardings). With
`linear_backend="cpu"` the float32 linear weights are then pre-packed for the native matmul,
and GGUF weights kept quantized (`quantization="gguf"`, read from the file without a
conversion) are marked for the native GGUF kernel (`ops.cpu_gguf`), int8 / AWQ / GPTQ weights
for the native quantized kernel (`ops.cpu_quant`).

Pipeline stages of unequal size (`sharding.stages`): the stacks are read as the model's L
rows (whole on every stage where P does not divide L), then padded to the stage layout and
split over the stages one stacked weight at a time (`sharding.pipeline.pad_stage_params`);
while loading, a stage may thus hold every layer's weights.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from pagedjax.config import EngineConfig
from pagedjax.models import loader, registry
from pagedjax.ops import cpu_gguf, cpu_kernels, cpu_linear, cpu_quant
from pagedjax.ops.fused_projections import fuse_projections
from pagedjax.sharding.mesh import device_grid, replica_mesh
from pagedjax.sharding.pipeline import pad_stage_params
from pagedjax.sharding.rules import ShardingPlan
from pagedjax.sharding.stages import StageLayout


@dataclasses.dataclass
class LoadedModel:
    """A replica's tokenizer (None with skip_tokenizer_init), sharding plan, params on its
    devices, and the seconds loading took."""

    tokenizer: Any
    plan: ShardingPlan
    params: dict[str, Any]
    load_s: float


def setup_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` ("" leaves it off)."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load_model(config: EngineConfig, devices=None) -> LoadedModel:
    """Loads the model of `config` onto `devices`.

    Args:
        config: the engine config.
        devices: the replica's devices as a [pipeline, tensor] array (default: the first
            pipeline_parallel_size x tensor_parallel_size devices).

    Raises:
        ValueError: a missing or malformed checkpoint, or an unsupported architecture.
    """
    mc, cc, pc = config.model_config, config.cache_config, config.parallel_config
    setup_compilation_cache(config.compilation_cache_dir)
    # The native kernels' ISA path, for every trace in this process (a worker process too).
    cpu_kernels.set_default_isa(mc.cpu_kernel_isa)
    t0 = time.perf_counter()
    source = loader.ModelSource(mc.source_kind, mc.source_path)
    keep_gguf = source.kind == "gguf" and mc.quantization == "gguf"
    if source.kind == "gguf" and not keep_gguf:  # dequantized: the converted folder
        source = loader.converted_gguf_source(source, mc.download_dir)
    if mc.skip_tokenizer_init:
        tokenizer = None
    elif keep_gguf and mc.tokenizer is None:
        tokenizer = loader.gguf_tokenizer(source, mc.download_dir)
    else:
        tokenizer = loader.load_tokenizer(source, mc.tokenizer)
    if devices is None:
        devices = device_grid(jax.devices(), 1, pc.pipeline_parallel_size, pc.tensor_parallel_size)[
            0
        ]
    model = registry.get_model(mc.arch.architecture)
    mesh = replica_mesh(devices)
    stages = stage_layout(config)
    counts = model.logical_unit_counts(mc.arch)
    plan = ShardingPlan(mesh, {**counts, "layers": stages.padded_num_layers})
    read_plan = plan if stages.is_even else ShardingPlan(mesh, counts)  # [L, ...] stacks
    logical = model.param_logical_axes(mc.arch)
    params = loader.load_params(
        source,
        mc.arch,
        mc.dtype,
        sharding_for=read_plan.sharding_for(logical),
        quantization=mc.quantization,
        kv_cache_dtype=cc.kv_cache_dtype,
    )
    if not stages.is_even:
        params = pad_stage_params(params, stages, plan.sharding_for(logical))
    if mc.linear_backend == "cpu":  # the native matmul's panel layout, packed once
        max_rows = 0 if mc.batch_invariant else cpu_linear.MAX_TOKENS
        params = cpu_gguf.use_native(cpu_linear.pack_params(params, max_rows), mc.gguf_activations)
        params = cpu_quant.use_native(params)  # int8 / AWQ / GPTQ stacks read in place
        params = fuse_projections(params)  # q/k/v and gate/up: one native call each
    return LoadedModel(tokenizer, plan, params, time.perf_counter() - t0)


def stage_layout(config: EngineConfig) -> StageLayout:
    """The layers of each pipeline stage of `config` (one stage without pipeline
    parallelism)."""
    pc = config.parallel_config
    return StageLayout.make(
        config.model_config.arch.num_hidden_layers,
        pc.pipeline_parallel_size,
        pc.pp_layer_partition,
    )
