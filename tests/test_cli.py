"""The `pagedjax` command as a newcomer meets it: whole help text, usage errors from the
subcommand that was typed (with a suggestion for a near-miss flag), a missing model named as
missing, and `serve` on a busy port failing at once, before any model is loaded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pagedjax import cli
from pagedjax.models.sources import resolve_model_source
from tests.server_utils import HOST, ROOT, free_port, tiny_server_args


def _run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_top_level_help_has_the_whole_description(capsys):
    code, out, _ = _run_main(capsys, ["--help"])
    assert code == 0
    text = " ".join(out.split())
    assert "answer one chat turn" in text
    assert "pagedjax serve" in text  # the examples are in the help


def test_unknown_flag_under_serve_gives_serves_usage_and_a_suggestion(capsys):
    code, _, err = _run_main(capsys, ["serve", "--prot", "8000"])
    assert code == 2
    assert err.startswith("usage: pagedjax serve")
    assert "unrecognized arguments: --prot" in err
    assert "did you mean --port?" in err


def test_unknown_flag_under_generate_with_value_suggests(capsys):
    code, _, err = _run_main(capsys, ["generate", "x", "--max-tokns=3"])
    assert code == 2
    assert err.startswith("usage: pagedjax generate")
    assert "did you mean --max-tokens?" in err


def test_a_port_out_of_range_is_a_usage_error(capsys):
    code, _, err = _run_main(capsys, ["serve", "--port", "99999"])
    assert code == 2
    assert err.startswith("usage: pagedjax serve")
    assert "argument --port: must be in 0-65535, got 99999" in err


def test_vllm_flags_that_change_nothing_here_are_accepted():
    """Copied vLLM command lines keep working: --trust-remote-code (pagedjax never runs a
    checkpoint's code), --disable-log-requests (no request is logged), --tokenizer-mode auto,
    --revision (local paths have none: ignored with a warning)."""
    ns = cli.build_parser().parse_args(
        ["serve", "--trust-remote-code", "--disable-log-requests", "--tokenizer-mode", "auto"]
        + ["--revision", "main"]
    )
    assert ns.trust_remote_code and ns.disable_log_requests and ns.tokenizer_mode == "auto"
    assert ns.revision == "main"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--tokenizer-mode", "slow"])


def test_flags_may_be_spelled_with_underscores_as_in_vllm():
    """`vllm serve --max_model_len 512` works; so does ours. Values keep their underscores,
    and an unknown flag is still refused."""
    ns = cli.build_parser().parse_args(
        ["serve", "--max_model_len", "512", "--block_size=16", "--enable_prefix_caching"]
        + ["--served_model_name", "my_model"]
    )
    assert (ns.max_model_len, ns.block_size, ns.enable_prefix_caching) == (512, 16, True)
    assert ns.served_model_name in (["my_model"], "my_model")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--max_model_lenn", "512"])


def test_vllms_short_parallel_flags_and_dtype_spellings():
    """vLLM's `-tp 2`, `-pp`, `-dp` and `--dtype half` / `float` (each was a usage error)."""
    ns = cli.build_parser().parse_args(["serve", "-tp", "2", "-pp", "1", "-dp", "1"])
    assert (ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.data_parallel_size) == (
        2,
        1,
        1,
    )
    assert cli.build_parser().parse_args(["serve", "--dtype", "half"]).dtype == "half"
    assert cli.build_parser().parse_args(["serve", "--dtype", "float"]).dtype == "float"


def test_vllm_scripts_argument_parsing_runs_unchanged():
    """vLLM's example scripts: `FlexibleArgumentParser` from `<package>.utils` (or
    `.utils.argparse_utils`), `parser = EngineArgs.add_cli_args(parser)`, then
    `LLM(**vars(args))`-style use of the namespace."""
    from pagedjax import EngineArgs
    from pagedjax.utils import FlexibleArgumentParser
    from pagedjax.utils.argparse_utils import FlexibleArgumentParser as same
    from pagedjax.utils.argparse_utils import normalize_flag_names

    assert same is FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser is not None
    ns = parser.parse_args(["--max_model_len=256", "--kv_cache_dtype", "fp8", "-tp", "1"])
    assert (ns.max_model_len, ns.kv_cache_dtype, ns.tensor_parallel_size) == (256, "fp8", 1)
    assert EngineArgs.from_cli_args(ns).max_model_len == 256
    # vLLM's dotted JSON flags: --flag.key value, keys nested and keeping underscores, values
    # read as JSON where they parse (they were unrecognized arguments)
    ns = parser.parse_args(
        ["--speculative_config.method", "ngram", "--max-model-len", "64"]
        + ["--speculative-config.num_speculative_tokens=3", "--compilation-config.a.b", "[1]"]
    )
    assert json.loads(ns.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert json.loads(ns.compilation_config) == {"a": {"b": [1]}} and ns.max_model_len == 64
    for bad in (["--speculative-config.method"], ["--x.k", "1", "--x.k", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    # values and whatever follows a bare "--" keep their underscores
    assert normalize_flag_names(["--a_b=c_d", "x_y", "-t_p", "--", "--e_f"]) == [
        "--a-b=c_d",
        "x_y",
        "-t_p",
        "--",
        "--e_f",
    ]


@pytest.mark.parametrize(
    "text, tokens",
    [("2048", 2048), ("2k", 2000), ("2K", 2048), ("25.6k", 25600), ("0.3k", 300), ("1M", 2**20)],
)
def test_token_counts_take_vllms_size_suffixes(text, tokens):
    """As in vLLM: lowercase k/m/g are powers of 1000, uppercase powers of 1024 ("2k" was an
    "invalid int value")."""
    ns = cli.build_parser().parse_args(
        ["serve", "--max-model-len", text, "--max-num-batched-tokens", text]
    )
    assert ns.max_model_len == ns.max_num_batched_tokens == tokens


@pytest.mark.parametrize("text", ["2.5K", "1.0001k", "2kb", "1.5", "k"])
def test_a_bad_size_suffix_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--max-model-len", text])
    assert f"argument --max-model-len: invalid value '{text}'" in capsys.readouterr().err


def test_log_level_is_accepted_after_the_subcommand():
    ns = cli.build_parser().parse_args(["serve", "--log-level", "DEBUG"])
    assert ns.log_level == "DEBUG"
    assert cli.build_parser().parse_args(["--log-level", "DEBUG", "serve"]).log_level == "DEBUG"
    assert cli.build_parser().parse_args(["serve"]).log_level == "INFO"


def test_missing_model_path_is_said_not_to_exist(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_source(str(missing))
    code, _, err = _run_main(capsys, ["serve", str(missing), "--port", str(free_port())])
    assert code == 2 and "does not exist" in err and str(missing) in err


def test_a_file_that_is_not_a_model_is_still_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a folder nor a .gguf file"):
        resolve_model_source(str(f))


def test_serve_on_a_busy_port_fails_before_loading(tiny_llama_dir, compile_cache_dir):
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
        args = tiny_server_args(
            tiny_llama_dir, compile_cache_dir, **{"--uvicorn-log-level": "info"}
        )
        cmd = [sys.executable, "-m", "pagedjax.cli", "serve", *args, "--host", HOST]
        cmd += ["--port", str(port)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert f"{HOST}:{port}" in log and "in use" in log, log
    assert "loaded" not in log and "compiled" not in log, log  # no model was loaded
    assert "serving" not in log, log
    assert elapsed < 15, (elapsed, log)


def test_sampling_flags_reach_the_sampling_params():
    ns = cli.build_parser().parse_args(
        ["generate", "x", "--stop", "a", "--stop", "b c", "--min-p", "0.1"]
        + ["--repetition-penalty", "1.2", "--top-k", "5"]
    )
    p = cli._params(ns)
    assert (p.stop, p.min_p, p.repetition_penalty, p.top_k) == (["a", "b c"], 0.1, 1.2, 5)
    assert cli._params(cli.build_parser().parse_args(["chat", "x"])).stop == []


def test_unset_sampling_flags_take_the_generation_config_then_greedy_64():
    """A flag given wins; an unset one takes the model's generation-config default; else
    greedy decoding of 64 tokens (the config's max_new_tokens was ignored before)."""
    config = {"temperature": 0.6, "max_tokens": 7}
    plain = cli._params(cli.build_parser().parse_args(["generate", "x"]), config)
    assert (plain.temperature, plain.max_tokens, plain.top_p) == (0.6, 7, 1.0)
    flags = cli.build_parser().parse_args(["generate", "x", "--temperature", "0", "--top-k", "3"])
    given = cli._params(flags, config)
    assert (given.temperature, given.max_tokens, given.top_k) == (0.0, 7, 3)
    bare = cli._params(cli.build_parser().parse_args(["chat", "x"]))
    assert (bare.temperature, bare.max_tokens) == (0.0, 64)


def test_flags_offer_only_what_a_command_can_use(capsys):
    """No --served-model-name without a server; None is not a value to type."""
    code, _, err = _run_main(capsys, ["generate", "x", "--served-model-name", "m"])
    assert code == 2 and "unrecognized arguments: --served-model-name" in err
    code, _, err = _run_main(capsys, ["serve", "--distributed-executor-backend", "None"])
    assert code == 2 and "invalid choice: 'None' (choose from 'mp', 'ray')" in err


def test_generate_labels_each_of_n_samples(tiny_llama_dir, compile_cache_dir, capsys):
    engine = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "128"]
    engine += ["--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--enforce-eager"]
    engine += ["--cuda-graph-sizes", "16,32", "--compilation-cache-dir", compile_cache_dir]
    argv = ["generate", "hello", "--n", "2", "--temperature", "1", "--max-tokens", "3"]
    code, out, _ = _run_main(capsys, argv + engine + ["--ignore-eos"])
    lines = [line for line in out.splitlines() if "->" in line]
    assert code == 0 and len(lines) == 2, out
    assert lines[0].startswith("[0.0] 'hello' -> ") and lines[1].startswith("[0.1] 'hello' -> ")
    assert all(line.endswith("(length)") for line in lines)


def test_an_unknown_engine_argument_is_named_with_the_closest_known_one():
    """`LLM(max_model_lenn=...)` (`EngineArgs.from_kwargs`) names the typo and, like the
    command line, the argument it probably meant."""
    from pagedjax.engine_args import EngineArgs

    with pytest.raises(ValueError) as e:
        EngineArgs.from_kwargs(max_model_lenn=64, zzz=1)
    assert str(e.value) == (
        "unknown engine argument(s): max_model_lenn (did you mean max_model_len?), zzz"
    )
