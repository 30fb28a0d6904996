"""A checkpoint's generation_config.json gives the default sampling parameters (vLLM's
`generation_config="auto"`): read from the file, overridden, ignored with "vllm", applied
by `LLM.generate` without sampling_params and by server requests that leave a field unset."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedjax.engine_args import EngineArgs
from pagedjax.generation_config import default_sampling_fields
from pagedjax.server.protocol import ChatCompletionRequest, CompletionRequest

CREATOR = {  # as Hugging Face writes it: only what differs from its defaults, and more
    "bos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
}
EXPECTED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def creator_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny checkpoint with a model creator's generation_config.json."""
    folder = tmp_path_factory.mktemp("with-generation-config") / "tiny"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(CREATOR))
    return folder


def test_the_sampling_fields_of_the_file_are_read_in_samplingparams_names(creator_dir, tmp_path):
    assert default_sampling_fields("auto", "hf", str(creator_dir)) == {
        **EXPECTED,
        "max_tokens": 7,
    }
    assert default_sampling_fields("vllm", "hf", str(creator_dir)) == {}
    assert default_sampling_fields("auto", "gguf", str(creator_dir / "x.gguf")) == {}
    assert default_sampling_fields("auto", "hf", str(tmp_path)) == {}  # no file: none
    # a folder given explicitly is read whatever the model is
    assert default_sampling_fields(str(creator_dir), "gguf", "x.gguf")["top_k"] == 20
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        default_sampling_fields(str(tmp_path), "hf", str(creator_dir))
    (tmp_path / "generation_config.json").write_text('{"top_k": 2.5}')
    with pytest.raises(ValueError, match="top_k is not an integer"):
        default_sampling_fields(str(tmp_path), "hf", str(creator_dir))
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature is not a number"):
        default_sampling_fields(str(tmp_path), "hf", str(creator_dir))


def test_overrides_take_the_generation_config_names_and_win(creator_dir, tmp_path):
    def fields(overrides, folder=creator_dir):
        return default_sampling_fields("auto", "hf", str(folder), overrides)

    base = {**EXPECTED, "max_tokens": 7}
    assert fields('{"temperature": 0, "max_new_tokens": 3}') == {
        **base,
        "temperature": 0.0,
        "max_tokens": 3,
    }
    assert fields(None) == base
    with pytest.raises(ValueError, match="override_generation_config: unknown field 'seed'"):
        fields({"seed": 1})
    with pytest.raises(ValueError, match="override_generation_config is not JSON"):
        fields("{temperature")
    with pytest.raises(ValueError, match="override_generation_config: max_new_tokens is not an"):
        fields({"max_new_tokens": 2.5})  # was truncated to 2
    # a file's value that every request would be refused for, unless an override replaces it
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text('{"top_p": 7, "top_k": 3}')
    with pytest.raises(ValueError, match="generation_config: invalid .* top_p"):
        fields(None, bad)
    assert fields({"top_p": 0.5}, bad) == {"top_p": 0.5, "top_k": 3}


def test_engine_config_carries_the_defaults_unless_told_otherwise(creator_dir):
    def fields(**kw):
        args = EngineArgs(model=str(creator_dir), **kw)
        return args.create_engine_config().model_config.default_sampling_fields

    assert fields() == {**EXPECTED, "max_tokens": 7}
    assert fields(generation_config="vllm") == {}
    assert fields(override_generation_config={"top_k": 5})["top_k"] == 5
    # a default every request would be refused for is refused at start-up (it was accepted)
    with pytest.raises(ValueError, match="override_generation_config: invalid .* top_p"):
        fields(override_generation_config={"top_p": 7})
    with pytest.raises(ValueError, match="override_generation_config: invalid .* max_tokens"):
        fields(override_generation_config={"max_new_tokens": -1})


def test_a_request_field_left_unset_takes_the_default():
    defaults = {**EXPECTED, "max_tokens": 7}
    comp = CompletionRequest(prompt="x").to_sampling_params(defaults)
    assert (comp.temperature, comp.top_p, comp.top_k) == (0.6, 0.9, 20)
    assert comp.repetition_penalty == 1.05
    assert comp.max_tokens == 16  # the completions API's own default comes first
    assert (
        CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(defaults).max_tokens == 7
    )
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params(defaults).max_tokens == 7
    given = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], temperature=0, top_k=-1, max_tokens=3
    ).to_sampling_params(defaults)
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, -1, 3)
    assert given.top_p == 0.9  # the fields the request left unset still take the defaults
    plain = chat.to_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, None)


def test_generate_without_sampling_params_uses_the_generation_config(
    make_llm, tiny_llama_dir, tmp_path, hf_greedy_cache
):
    """A creator who asks for greedy decoding of 5 tokens gets it from `LLM.generate(prompt)`
    and `LLM.chat(messages)`."""
    folder = tmp_path / "greedy"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5})
    )
    llm = make_llm(folder)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompt = [5, 17, 33, 70]
    out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy_cache(prompt, 5)
    chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)[0].outputs[0]
    assert len(chat.token_ids) <= 5
