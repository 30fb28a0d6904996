"""The model creator's default sampling parameters: a checkpoint's `generation_config.json`.

vLLM's rule (its `generation_config="auto"` default, `ModelConfig.get_diff_sampling_param`):
the sampling fields a checkpoint's `generation_config.json` sets become the defaults of
every request that does not set them itself: `LLM.generate` / `LLM.chat` without
`sampling_params` (`LLM.get_default_sampling_params`) and server requests that omit the
field. `generation_config="vllm"` ignores the file (pagedjax's own defaults: temperature
1.0, top_p 1.0, ...); a folder path reads that folder's file instead.

Fields read (Hugging Face name -> SamplingParams name): temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens -> max_tokens. Hugging Face writes only the values
that differ from its own defaults, so a field in the file is one the creator chose. Other
fields (do_sample, eos_token_id, ...) are not sampling defaults here. A GGUF file or a
converted folder carries no generation config: their defaults are pagedjax's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"
# Hugging Face's field -> SamplingParams' field, with the type it must have
FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


def _field(hf_name: str, value: Any, where: str) -> tuple[str, Any]:
    """One Hugging Face field -> (SamplingParams name, value of its type).

    Raises:
        ValueError: naming `where` and the field: an unknown field, a value that is not a
            number, or an integer field with a fraction.
    """
    if hf_name not in FIELDS:
        raise ValueError(f"{where}: unknown field {hf_name!r} (one of {sorted(FIELDS)})")
    name, typ = FIELDS[hf_name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {hf_name} is not a number: {value!r}")
    if typ is int and value != int(value):
        raise ValueError(f"{where}: {hf_name} is not an integer: {value!r}")
    return name, typ(value)


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    where = f"generation_config: {path}'s"
    return dict(_field(k, data[k], where) for k in FIELDS if data.get(k) is not None)


def _file_fields(generation_config: str, source_kind: str, source_path: str) -> dict[str, Any]:
    """The fields of the file `generation_config` selects (see `default_sampling_fields`)."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(source_path) / FILE_NAME
        if source_kind != "hf" or not path.exists():
            return {}
    else:
        path = Path(generation_config).expanduser()
        path = path / FILE_NAME if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding "
                f"{FILE_NAME}, got {generation_config!r}"
            )
    return _from_file(path)


def _overrides(overrides: dict[str, Any] | str | None) -> dict[str, Any]:
    """`override_generation_config` (a dict, or a JSON object as given on the command line,
    in Hugging Face's names as vLLM's flag takes them) in SamplingParams' names."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as e:
            raise ValueError(f"override_generation_config is not JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {overrides!r}")
    return dict(_field(k, v, "override_generation_config") for k, v in overrides.items())


def _check(defaults: dict[str, Any], source: str) -> None:
    from pagedjax.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: invalid default sampling parameter: {e}") from None


def default_sampling_fields(
    generation_config: str,
    source_kind: str,
    source_path: str,
    overrides: dict[str, Any] | str | None = None,
) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field -> value) that `generation_config` and
    `override_generation_config` select.

    Args:
        generation_config: "auto" (the checkpoint's own file, when it is a Hugging Face
            folder that has one), "vllm" (none: pagedjax's defaults), or a folder holding a
            `generation_config.json` (or the file's own path).
        source_kind, source_path: the resolved model source ("hf" | "gguf" | "orbax").
        overrides: `override_generation_config`, fields over the file's.

    Returns:
        e.g. {"temperature": 0.6, "top_p": 0.9, "max_tokens": 512}; empty for none.

    Raises:
        ValueError: naming generation_config or override_generation_config: a folder
            without the file, an unreadable file, not a JSON object, an unknown field, a
            field that is not a number, or a value every request would be refused for (a
            top_p of 7, a max_new_tokens of -1: SamplingParams' own rule, checked here at
            start-up rather than on each request).
    """
    from_file = _file_fields(generation_config, source_kind, source_path)
    given = _overrides(overrides)
    _check({k: v for k, v in from_file.items() if k not in given}, "generation_config")
    _check(given, "override_generation_config")
    return {**from_file, **given}
