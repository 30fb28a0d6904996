"""Resolving engine arguments into an `EngineConfig`: "auto" and None against the checkpoint and
the device, the distributed runtime's start, and the checks that span several fields.

`resolve_engine_config(args)` is what `EngineArgs.create_engine_config()` runs. It imports
jax, the loader and the kernels inside the function, so that importing this module (and
`engine_args`) stays cheap and jax-free.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from pagedjax import generation_config
from pagedjax.config import (
    ATTENTION_BACKENDS,
    CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DTYPE_ALIASES,
    DTYPES,
    GGUF_ACTIVATIONS,
    GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    _bad,
)
from pagedjax.paths import cache_root

logger = logging.getLogger(__name__)


def _gguf_quantization(quantization, source, dtype_arg: str, one_device: bool):
    """A GGUF file keeps its quantized blocks ("gguf") by default; an explicit `dtype`
    without `quantization` dequantizes it on load (the exactness baseline), and so does a
    replica of more than one device (GGUF blocks are not sharded)."""
    if source.kind != "gguf":
        return quantization
    if quantization is None and dtype_arg == "auto":
        quantization = "gguf"
    if quantization == "gguf" and not one_device:
        logger.warning("GGUF weights are dequantized on load: a replica of several devices")
        return None
    return quantization


def _graph_sizes(value) -> tuple[int, ...] | None:
    """`cuda_graph_sizes` as given (a list of ints, or "1,4,16") -> sorted ints, or None
    (`SchedulerConfig` checks that they are at least 1).

    Raises:
        ValueError: naming the field, for an item that is not an integer.
    """
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(sorted({int(str(v).strip()) for v in items if str(v).strip()}))
    except ValueError:
        raise _bad("cuda_graph_sizes", "integers (e.g. '1,4,16')", value) from None


def _check_vllm_only_args(args, source) -> tuple[int, ...] | None:
    """Checks vLLM's arguments that select nothing here but must agree with what is loaded
    (load_format, async_scheduling) and reads compilation_config; returns the step sizes
    its cudagraph_capture_sizes give (None: none given).

    Raises:
        ValueError: naming the field: a value not among its choices, a load_format the
            source is not in, or a compilation_config that is not a dict, an int or their
            JSON.
    """
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(args)}
    for name in ("load_format", "config_format", "runner"):
        if getattr(args, name) not in choices[name]:
            raise _bad(name, f"one of {choices[name]}", getattr(args, name))
    want = {"safetensors": "hf", "gguf": "gguf"}.get(args.load_format)
    if want is not None and source.kind != want:
        raise _bad(
            "load_format", f"the format of {source.path!r} ({source.kind})", args.load_format
        )
    if args.async_scheduling:
        logger.warning("async_scheduling=True has no effect: steps are scheduled one by one")
    _check_structured_outputs_config(args.structured_outputs_config)
    config = args.compilation_config
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            raise _bad("compilation_config", "a dict, an int or their JSON", config) from None
    if config is None or isinstance(config, int):
        return None
    if not isinstance(config, dict):
        raise _bad("compilation_config", "a dict, an int or their JSON", config)
    sizes = config.get("cudagraph_capture_sizes")
    return None if sizes is None else _graph_sizes(sizes)


def _check_structured_outputs_config(config) -> None:
    """vLLM's `structured_outputs_config`: only its backend is read, and llguidance (vLLM's
    "guidance") serves every backend's constraints here (a warning for the others).

    Raises:
        ValueError: naming the field: not a dict or its JSON, or another key.
    """
    if config is None:
        return
    rule = "a dict (or its JSON) with a backend"
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            raise _bad("structured_outputs_config", rule, config) from None
    if not isinstance(config, dict) or set(config) - {"backend"}:
        raise _bad("structured_outputs_config", rule + " (no other key is read)", config)
    backend = config.get("backend", "auto")
    if backend not in ("auto", "guidance"):
        logger.warning(
            "structured_outputs_config backend %r: constraints are served by llguidance "
            "(vLLM's 'guidance' backend)",
            backend,
        )


def _served_names(value) -> tuple[str, ...]:
    """`served_model_name` as given (None, a name, or a list of names) -> the names in
    order, duplicates dropped (empty: use the default name).

    Raises:
        ValueError: naming the field, for an empty name or one that is not a string.
    """
    items = [value] if isinstance(value, str) else list(value or ())
    for v in items:
        if not isinstance(v, str) or not v.strip():
            raise _bad("served_model_name", "non-empty strings", value)
    return tuple(dict.fromkeys(items))


def resolve_engine_config(args) -> EngineConfig:
    """Validates engine arguments (an `engine_args.EngineArgs`) and resolves defaults against
    the checkpoint and device.

    Raises:
        ValueError: an invalid value (the message names the field and the limit), a
            missing model, or an unsupported architecture.
    """
    import jax

    from pagedjax.models import loader, quant_loader
    from pagedjax.sharding import distributed, stages

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)

    if args.dtype in DTYPE_ALIASES:  # vLLM's "half" and "float"
        args = dataclasses.replace(args, dtype=DTYPE_ALIASES[args.dtype])
    if args.dtype not in DTYPES:
        raise _bad("dtype", f"one of {DTYPES} (or 'half', 'float')", args.dtype)
    if args.tokenizer_mode not in ("auto", "hf"):
        raise _bad(
            "tokenizer_mode",
            "'auto' or 'hf' (the checkpoint's fast tokenizer)",
            args.tokenizer_mode,
        )
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise _bad("attention_backend", f"one of {ATTENTION_BACKENDS}", args.attention_backend)
    if args.linear_backend not in LINEAR_BACKENDS:
        raise _bad("linear_backend", f"one of {LINEAR_BACKENDS}", args.linear_backend)
    if args.gguf_activations not in GGUF_ACTIVATIONS:
        raise _bad("gguf_activations", f"one of {GGUF_ACTIVATIONS}", args.gguf_activations)
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise _bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}", args.kv_cache_dtype)
    if args.quantization is not None and args.quantization not in QUANTIZATION_METHODS:
        raise _bad("quantization", f"None or one of {QUANTIZATION_METHODS}", args.quantization)
    if args.max_logprobs < 0:
        raise _bad("max_logprobs", ">= 0", args.max_logprobs)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise _bad("max_model_len", ">= 1", args.max_model_len)
    source = loader.resolve_model_source(args.model, args.revision)
    if source.from_hub_cache:
        logger.info("%s: loaded from the Hugging Face cache (%s)", source.alias, source.path)
    elif source.alias is not None:
        logger.info("%s: no such local path; the bundled default model is loaded", source.alias)
    for field in ("revision", "tokenizer_revision"):
        if getattr(args, field) is not None and not (field == "revision" and source.from_hub_cache):
            logger.warning(
                "%s=%r is ignored: local paths have no revisions (only a hub id loaded from "
                "the Hugging Face cache has)",
                field,
                getattr(args, field),
            )
    compiled_sizes = _check_vllm_only_args(args, source)
    quantization = quant_loader.resolve_quantization(args.quantization, source)
    arch = loader.load_arch_config(source)
    pp_partition = stages.parse_layer_partition(args.pp_layer_partition)
    stage_sizes = stages.stage_partition(
        arch.num_hidden_layers, args.pipeline_parallel_size, args.pp_layer_partition
    )
    if args.pipeline_parallel_size > 1 and len(set(stage_sizes)) > 1:
        logger.info("pipeline stages of uneven size: %s layers", list(stage_sizes))
    arch = _expert_parallel_arch(arch, args)
    on_cpu = jax.default_backend() == "cpu"
    _check_cpu_offload(args.cpu_offload_gb, on_cpu)
    dtype = args.dtype
    if dtype == "auto":
        dtype = loader.checkpoint_dtype(source)
        if dtype not in DTYPES:
            logger.warning("checkpoint dtype %s is not supported; using float32", dtype)
            dtype = "float32"
    one_device = args.tensor_parallel_size * args.pipeline_parallel_size == 1 and (
        args.data_parallel_size == 1 and args.num_processes == 1
    )
    quantization = _gguf_quantization(quantization, source, args.dtype, one_device)
    max_model_len = args.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_model_len}) must be <= the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    backend = args.attention_backend
    from pagedjax.ops import cpu_kernels

    # Raises a ValueError naming cpu_kernel_isa for an unknown path or one the CPU lacks.
    cpu_kernel_isa = cpu_kernels.set_default_isa(args.cpu_kernel_isa)
    if backend == "cpu":
        _check_native("attention_backend", on_cpu and one_device)
    if backend == "auto":
        backend = "xla" if on_cpu else "pallas"
        if on_cpu and one_device and cpu_kernels.available():
            backend = "cpu"
        if backend == "pallas":
            from pagedjax.ops.paged_attention_pallas import unsupported_reason

            reason = unsupported_reason(arch.head_dim, args.block_size)
            if reason:
                logger.warning("attention_backend 'auto' uses 'xla': %s", reason)
                backend = "xla"
    linear_backend = args.linear_backend
    if linear_backend == "cpu":
        _check_native("linear_backend", on_cpu and one_device)
    if linear_backend == "auto":
        linear_backend = "cpu" if on_cpu and one_device and cpu_kernels.available() else "xla"
    default_tokens = (
        CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS if on_cpu else GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    max_tokens = args.max_num_batched_tokens or default_tokens
    max_seqs = args.max_num_seqs or min(DEFAULT_MAX_NUM_SEQS, max_tokens)
    # vLLM's default name: the model as given (a path or hub id, not resolved).
    names = _served_names(args.served_model_name) or (
        loader.DEFAULT_MODEL_NAME if args.model is None else args.model,
    )
    sampling_defaults = generation_config.default_sampling_fields(
        args.generation_config, source.kind, source.path, args.override_generation_config
    )
    if sampling_defaults:
        logger.info(
            "default sampling parameters from the generation config: %s "
            "(generation_config='vllm' ignores them)",
            sampling_defaults,
        )
    cache_dir = args.compilation_cache_dir
    if cache_dir is None:
        cache_dir = str(cache_root(args.download_dir) / "xla-cache")
    model_config = ModelConfig(
        model=args.model or source.path,
        source_kind=source.kind,
        source_path=source.path,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=names[0],
        served_model_names=names,
        default_sampling_fields=sampling_defaults,
        dtype=dtype,
        seed=args.seed,
        max_model_len=max_model_len,
        arch=arch,
        attention_backend=backend,
        max_logprobs=args.max_logprobs,
        linear_backend=linear_backend,
        cpu_kernel_isa=cpu_kernel_isa,
        batch_invariant=bool(args.batch_invariant),
        gguf_activations=args.gguf_activations,
        enforce_eager=bool(args.enforce_eager),
        download_dir=args.download_dir,
        quantization=quantization,
    )
    spec = SpeculativeConfig.from_value(args.speculative_config)
    if spec is not None and args.pipeline_parallel_size > 1:
        raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1")
    if spec is not None and spec.method == "draft_model":
        spec = _draft_config(spec, model_config, args.preemption_mode)
    if args.num_processes > 1 and args.preemption_mode == "swap":
        raise ValueError(
            "preemption_mode='swap' is not supported across processes "
            "(num_processes > 1); use 'recompute'"
        )
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            swap_space=args.swap_space,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            preemption_mode=args.preemption_mode,
            cuda_graph_sizes=compiled_sizes
            if args.cuda_graph_sizes is None
            else _graph_sizes(args.cuda_graph_sizes),
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            pp_layer_partition=pp_partition,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            distributed_executor_backend=args.distributed_executor_backend,
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        ),
        compilation_cache_dir=cache_dir,
        log_stats=not args.disable_log_stats,
        speculative_config=spec,
    )


def _expert_parallel_arch(arch, args):
    """The architecture with expert parallelism switched on where `enable_expert_parallel`
    asks for it.

    Raises:
        ValueError: expert parallelism for a model without experts, or a tensor-parallel
            size that does not divide the number of experts (the message names the field).
    """
    if not args.enable_expert_parallel:
        return arch
    num_experts = getattr(arch, "num_experts", None)
    if num_experts is None:
        raise ValueError(
            f"enable_expert_parallel: {arch.architecture} is not a mixture-of-experts model"
        )
    if num_experts % args.tensor_parallel_size:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size ({args.tensor_parallel_size}) must "
            f"divide the model's {num_experts} experts"
        )
    return dataclasses.replace(arch, expert_parallel=True)


def _check_cpu_offload(gb, on_cpu: bool) -> None:
    """vLLM's cpu_offload_gb: a number >= 0; > 0 only where the weights are in host memory
    anyway (CPU).

    Raises:
        ValueError: a negative or non-numeric value, or > 0 on an accelerator.
    """
    if isinstance(gb, bool) or not isinstance(gb, int | float) or gb < 0:
        raise ValueError(f"cpu_offload_gb must be a number >= 0, got {gb!r}")
    if gb > 0 and not on_cpu:
        raise ValueError(
            f"cpu_offload_gb={gb} is not supported: weights are not offloaded to host memory "
            "on an accelerator (use quantization or more devices to fit a larger model)"
        )


def _check_native(field: str, on_one_cpu_device: bool) -> None:
    """An explicit "cpu" backend (`field`) needs one CPU device and the native kernels.

    Raises:
        ValueError: naming `field`, when either is missing.
    """
    from pagedjax.ops import cpu_kernels

    if not on_one_cpu_device:
        raise ValueError(
            f"{field} 'cpu' runs on one CPU device (no tensor, pipeline or data parallelism, "
            "one process); use 'xla'"
        )
    if not cpu_kernels.available():
        raise ValueError(f"{field} 'cpu' is unavailable: {cpu_kernels.unavailable_reason()}")


def _draft_config(
    spec: SpeculativeConfig, target: ModelConfig, preemption_mode: str
) -> SpeculativeConfig:
    """`spec` with the draft's `ModelConfig` (float weights, the target's dtype, backends and
    max_model_len). A draft model must share the target's vocabulary; its KV cache follows
    the target's blocks, which swapping does not carry.

    Raises:
        ValueError: naming speculative_config.model (another vocabulary size) or
            preemption_mode.
    """
    import dataclasses

    from pagedjax.models import loader

    try:
        source = loader.resolve_model_source(spec.model)
        draft = loader.load_arch_config(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e
    if draft.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"speculative_config.model {spec.model!r} has a vocabulary of {draft.vocab_size} "
            f"tokens, the target {target.arch.vocab_size}: the draft must share the target's "
            "vocabulary"
        )
    if preemption_mode == "swap":
        raise ValueError(
            "speculative_config with method 'draft_model' needs preemption_mode='recompute'"
        )
    draft_mc = dataclasses.replace(
        target,
        model=spec.model,
        source_kind=source.kind,
        source_path=source.path,
        arch=draft,
        # A GGUF draft keeps its blocks when the target does (else dequantized on load).
        quantization="gguf" if source.kind == "gguf" and target.quantization == "gguf" else None,
    )
    return dataclasses.replace(spec, draft_model_config=draft_mc)
