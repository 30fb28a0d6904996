"""`FlexibleArgumentParser`: command-line flags spelled with underscores or dashes, and JSON
flags given key by key.

vLLM's scripts and examples build their parsers with `FlexibleArgumentParser` (imported from
`vllm.utils.argparse_utils`, or `vllm.utils` in older releases) and its CLI takes
`--max_model_len` as well as `--max-model-len`, and `--speculative-config.method ngram
--speculative-config.num_speculative_tokens 3` for `--speculative-config '{"method": "ngram",
"num_speculative_tokens": 3}'`; the same import from `pagedjax.utils` gives a parser that does
the same, so such a script needs only its imports changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def normalize_flag_names(args: Sequence[str]) -> list[str]:
    """`args` with underscores in long option names read as dashes: `--max_model_len=64` ->
    `--max-model-len=64`; values (after `=`, or separate arguments that do not start with
    `--`), a dotted flag's keys (`--speculative_config.num_speculative_tokens`) and everything
    after a bare `--` are left as they are."""
    out: list[str] = []
    rest = False
    for arg in args:
        if rest or not arg.startswith("--") or arg == "--":
            rest = rest or arg == "--"
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        flag, dot, keys = name.partition(".")  # a dotted flag's keys keep their underscores
        out.append(flag.replace("_", "-") + dot + keys + eq + value)
    return out


def merge_dotted_flags(args: Sequence[str]) -> list[str]:
    """`args` with each group of `--flag.key value` / `--flag.key=value` (keys nested by further
    dots: `--flag.a.b 1`) replaced, where the first of them was, by one `--flag <JSON object>`;
    a value is read as JSON where it parses (`3`, `true`, `[1, 2]`), else as a string.

    Raises:
        ValueError: a dotted flag without a value, or a key given twice.
    """
    out: list[str] = []
    merged: dict[str, dict] = {}
    at: dict[str, int] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        name, eq, value = arg.partition("=")
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            i += 1
            continue
        flag, _, path = name.partition(".")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"{name} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        target = merged.setdefault(flag, {})
        if flag not in at:
            at[flag] = len(out)
            out.append(flag)  # replaced by the JSON below
        *parents, key = path.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        if key in target:
            raise ValueError(f"{name} is given twice")
        try:
            target[key] = json.loads(value)
        except ValueError:
            target[key] = value
    for flag, index in sorted(at.items(), key=lambda kv: kv[1], reverse=True):
        out[index : index + 1] = [flag, json.dumps(merged[flag])]
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose long options may be given with underscores
    (`--max_model_len 512`), and JSON options key by key (`--speculative-config.method
    ngram`, see `merge_dotted_flags`), as vLLM's parser of the same name allows. Options are
    declared with dashes (`add_argument("--max-model-len")`), as `EngineArgs.add_cli_args`
    does."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        if args is None:
            args = sys.argv[1:]
        try:
            args = merge_dotted_flags(normalize_flag_names(args))
        except ValueError as e:
            self.error(str(e))
        return super().parse_known_args(args, namespace)
