"""Loading a model source's Hugging Face tokenizer (from its folder, from a GGUF file's
metadata, or from the folder/file the user names)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedjax.models.sources import CONVERTED_MARKER, ModelSource, cached_hub_snapshot


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """The Hugging Face tokenizer of a source (or of the folder/file `tokenizer` names).

    Raises:
        ValueError: no tokenizer files where one was expected.
    """
    from transformers import AutoTokenizer

    if tokenizer is not None:
        tok_path = Path(tokenizer).expanduser()
        if not tok_path.exists():  # a hub id: its snapshot in the Hugging Face cache, if any
            tok_path = cached_hub_snapshot(tokenizer) or tok_path
        if tok_path.is_file() and tok_path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(tok_path.parent), gguf_file=tok_path.name)
        if not tok_path.is_dir():
            raise ValueError(
                f"tokenizer {tokenizer!r} is not a local folder or .gguf file, nor a hub id in "
                "the local Hugging Face cache"
            )
        return AutoTokenizer.from_pretrained(str(tok_path))
    if source.kind == "gguf":
        if importlib.util.find_spec("torch") is None:
            # transformers reads a GGUF file's metadata through a module that imports torch
            raise ValueError(
                f"reading the tokenizer of {source.path!r} needs torch (transformers' GGUF "
                "reader imports it): pip install torch, or pass tokenizer=<HF tokenizer folder>"
            )
        p = Path(source.path)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    folder = Path(source.path)
    if (folder / CONVERTED_MARKER).exists() and not (folder / "tokenizer_config.json").exists():
        raise ValueError(
            f"the conversion {source.path!r} has no tokenizer: its GGUF file's could not be read "
            "(transformers needs torch for that; with torch installed the next load adds it), "
            "or pass tokenizer=<HF tokenizer folder>"
        )
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer could be loaded from {source.path!r}: {e}") from e
