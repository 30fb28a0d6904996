"""Helpers that vLLM scripts import from `vllm.utils`, under the same names."""

from pagedjax.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
