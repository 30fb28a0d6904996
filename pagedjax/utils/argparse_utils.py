"""`FlexibleArgumentParser`: command-line flags spelled with underscores or dashes.

vLLM's scripts and examples build their parsers with `FlexibleArgumentParser` (imported from
`vllm.utils.argparse_utils`, or `vllm.utils` in older releases) and its CLI takes
`--max_model_len` as well as `--max-model-len`; the same import from `pagedjax.utils` gives a
parser that does the same, so such a script needs only its imports changed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def normalize_flag_names(args: Sequence[str]) -> list[str]:
    """`args` with underscores in long option names read as dashes: `--max_model_len=64` ->
    `--max-model-len=64`; values (after `=`, or separate arguments that do not start with
    `--`) and everything after a bare `--` are left as they are."""
    out: list[str] = []
    rest = False
    for arg in args:
        if rest or not arg.startswith("--") or arg == "--":
            rest = rest or arg == "--"
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        out.append(name.replace("_", "-") + eq + value)
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose long options may be given with underscores
    (`--max_model_len 512`), as vLLM's parser of the same name allows. Options are declared
    with dashes (`add_argument("--max-model-len")`), as `EngineArgs.add_cli_args` does."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(normalize_flag_names(args), namespace)
