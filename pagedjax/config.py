"""Engine configuration: the frozen, validated configs the engine runs with, and allowed values.

An `EngineConfig` is made of small frozen dataclasses, one per concern; each checks its own
fields. They are made by `engine_args.EngineArgs.create_engine_config()` (what users and the
CLI set; the resolution of "auto" and None is in `config_resolution`). Jax-free and
argparse-free: the scheduler imports this module. Nothing is read from environment variables.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pagedjax.ops import choices

if TYPE_CHECKING:  # jax-free at import time: the scheduler imports this module
    from pagedjax.models.arch_config import DecoderArchConfig

ALLOWED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of two of them (its --dtype choices), read as the names above.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
ATTENTION_BACKENDS = ("auto", *choices.ATTENTION_BACKENDS)
LINEAR_BACKENDS = ("auto", *choices.LINEAR_BACKENDS)
CPU_KERNEL_ISAS = ("auto", *choices.CPU_KERNEL_ISAS)
GGUF_ACTIVATIONS = choices.GGUF_ACTIVATIONS
# vLLM's names; "fp8" is float8_e4m3fn (as on CUDA), see `ops.choices`.
KV_CACHE_DTYPES = ("auto", *choices.FP8_KV_CACHE_DTYPES)
# vLLM's names (awq_marlin / gptq_marlin read the same files as awq / gptq), see `ops.choices`.
QUANTIZATION_METHODS = choices.QUANTIZATION_CHOICES
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
EXECUTOR_BACKENDS = (None, "mp", "ray")
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
        served_model_name: the name the server reports when a request names none.
        served_model_names: every name the server answers to (the first is
            served_model_name; vLLM's `--served-model-name a b`); default: that one.
        dtype: "float32" | "bfloat16" | "float16".
        seed: the engine seed (requests without their own seed draw one from it).
        max_model_len: prompt + output tokens at most.
        arch: the checkpoint's hyper-parameters.
        attention_backend: "xla" | "cpu" | "reference" | "pallas".
        linear_backend: "xla" | "cpu" ("cpu": float32 linear weights and LM head pre-packed
            for the native CPU matmul, `ops.cpu_linear.pack_params`).
        cpu_kernel_isa: the native CPU kernels' ISA path, "avx512" | "avx2" | "portable"
            (`ops.cpu_kernels`; the engine resolves "auto" to the widest the CPU runs).
        batch_invariant: a request's logits are the same bits whatever else shares its
            steps: under `linear_backend="cpu"` the native matmul runs steps of every size
            (False: steps over `cpu_linear.MAX_TOKENS` tokens use XLA's dot, whose
            rounding depends on the step's shape).
        gguf_activations: "float32" | "int8": what the native GGUF kernel multiplies GGUF
            blocks kept quantized with ("int8": activations quantized per 32-value block,
            integer dot products, for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0; `ops.cpu_gguf`).
        max_logprobs: the most logprobs / prompt_logprobs a request may ask for.
        download_dir: where conversions are cached.
        quantization: None (float weights), "int8" | "w8a8" | "fp8" (float weights quantized
            on load, or an fp8 checkpoint), "awq" | "gptq" (4-bit checkpoints), or "gguf" (a
            GGUF file with its quantized tensors kept in their blocks; a GGUF file with None
            is dequantized on load).
        enforce_eager: compile each step bucket at its first step instead of at start-up
            (`executor.step_executables`; vLLM's name: no ahead-of-time graph capture).
        default_sampling_fields: SamplingParams field -> value from the generation config
            (`generation_config.default_sampling_fields`): the defaults of requests that
            leave those fields unset; empty: pagedjax's own defaults.
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
    arch: DecoderArchConfig
    attention_backend: str
    max_logprobs: int = 20
    download_dir: str | None = None
    quantization: str | None = None
    linear_backend: str = "xla"
    cpu_kernel_isa: str = "auto"
    batch_invariant: bool = True
    gguf_activations: str = "float32"
    enforce_eager: bool = False
    served_model_names: tuple[str, ...] = ()
    default_sampling_fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.served_model_names:  # a config built with one name
            object.__setattr__(self, "served_model_names", (self.served_model_name,))


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
    cuda_graph_sizes: the step sizes (tokens) compiled besides max_num_batched_tokens, or None
        for `executor.input_batch.token_buckets`' ladder (vLLM's name; a step is padded to the
        smallest that holds it).
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    cuda_graph_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise _bad("cuda_graph_sizes", "sizes >= 1", self.cuda_graph_sizes)
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise _bad("scheduling_policy", "'fcfs' or 'priority'", self.scheduling_policy)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise _bad("preemption_mode", "'recompute' or 'swap'", self.preemption_mode)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device layout: tensor, pipeline and data parallel sizes (vLLM's names).

    tensor_parallel_size: devices each layer is split over (heads and MLP columns).
    pipeline_parallel_size: stages the layers are split into.
    pp_layer_partition: the layers of each stage as given by the user (vLLM's
        VLLM_PP_LAYER_PARTITION), or None: vLLM's even split (`sharding.stages`).
    data_parallel_size: replicas of the whole model, each with its own scheduler.
    enable_expert_parallel: a mixture-of-experts model's experts are split by index over the
        tensor-parallel devices (each holds num_experts / tensor_parallel_size whole
        experts) instead of each expert's MLP columns.
    distributed_executor_backend: None or "mp" (processes started by the user, one per host,
        joined by JAX's distributed runtime), or "ray" (processes placed as Ray actors).
    coordinator_address, num_processes, process_id: `jax.distributed.initialize`'s
        arguments, for a model that spans several processes (hosts).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
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
        if self.pp_layer_partition is not None:
            if len(self.pp_layer_partition) != self.pipeline_parallel_size:
                raise ValueError(
                    f"pp_layer_partition {self.pp_layer_partition} has "
                    f"{len(self.pp_layer_partition)} entries; pipeline_parallel_size is "
                    f"{self.pipeline_parallel_size}"
                )
            if any(not isinstance(n, int) or n < 1 for n in self.pp_layer_partition):
                raise _bad("pp_layer_partition", "layer counts >= 1", self.pp_layer_partition)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise _bad(
                "distributed_executor_backend",
                "None, 'mp' or 'ray'",
                self.distributed_executor_backend,
            )
        if not 0 <= self.process_id < self.num_processes:
            raise _bad("process_id", f"in [0, num_processes={self.num_processes})", self.process_id)
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 16  # proposals per step and request at most


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names).

    method: "ngram" (prompt lookup over the request's own tokens, on the host) or
        "draft_model" (a smaller model with the same vocabulary, `model`).
    num_speculative_tokens: k, tokens proposed per step, 1..MAX_NUM_SPECULATIVE_TOKENS.
    prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first (ngram only).
    model: the draft checkpoint (draft_model only).
    draft_model_config: the draft's resolved `ModelConfig` (set by the engine, not by users).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_model_config: ModelConfig | None = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise _bad("speculative_config.method", f"one of {SPECULATIVE_METHODS}", self.method)
        k = self.num_speculative_tokens
        if type(k) is not int or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise _bad(
                "speculative_config.num_speculative_tokens",
                f"an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}]",
                k,
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or lo < 1:
            raise _bad("speculative_config.prompt_lookup_min", "an integer >= 1", lo)
        if not isinstance(hi, int) or hi < lo:
            raise _bad(
                "speculative_config.prompt_lookup_max", f"an integer >= prompt_lookup_min={lo}", hi
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model'")

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """From a dict or its JSON text (`--speculative-config '{...}'`); None stays None.
        Without `method`, vLLM's inference: `model` "ngram" or "[ngram]" means "ngram",
        another `model` "draft_model".

        Raises:
            ValueError: invalid JSON, an unknown key, or an invalid value (named).
        """
        import json

        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _bad("speculative_config", "a JSON object", value)
        names = {f.name for f in dataclasses.fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}")
        value = dict(value)
        if value.get("method") is None:  # inferred from `model`, as vLLM does
            model = value.get("model")
            if model in ("ngram", "[ngram]"):
                value["method"], value["model"] = "ngram", None
            elif model:
                value["method"] = "draft_model"
        for key in ("method", "num_speculative_tokens"):
            if key not in value or value[key] is None:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated. compilation_cache_dir: JAX's persistent
    compilation cache ("" disables it); log_stats: log scheduler stats periodically;
    speculative_config: speculative decoding, or None."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    compilation_cache_dir: str = ""
    log_stats: bool = True
    speculative_config: SpeculativeConfig | None = None
