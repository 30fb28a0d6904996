"""Writes the default model (SmolLM2-135M-Instruct GGUF, dequantized to float32) as a plain
Hugging Face folder (config.json, model.safetensors, tokenizer), for engines that cannot read
the GGUF file: `python -m benchmarks.export_hf OUT_DIR`.

transformers refuses to save a model loaded from GGUF while its config carries the GGUF
`quantization_config`, so the weights are copied into a fresh model first. It needs torch,
gguf and accelerate (transformers reads GGUF through them): the `test` extra has them
(`pip install -e '.[test]'`).
"""

from __future__ import annotations

import os
import sys

NEEDS = ("torch", "accelerate", "gguf")


def export(out: str) -> str:
    """Writes the folder; returns `out`.

    Raises:
        SystemExit: torch, accelerate or gguf is not installed (the message says how).
    """
    import importlib.util

    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"export_hf needs {', '.join(missing)} (transformers loads GGUF through them): "
            "pip install -e '.[test]' (or pip install torch==2.13.0 accelerate gguf)"
        )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagedjax.models.loader import default_model_path

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(src.state_dict())
    fresh.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(export(sys.argv[1] if len(sys.argv) > 1 else "smollm2-hf"))
