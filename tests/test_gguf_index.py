"""The on-disk index of a GGUF file (`models.gguf_index`): a file opened from its index gives
the fields, tensors and architecture that `gguf.GGUFReader` gives, without parsing the file;
a changed file or an unreadable index is parsed afresh."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_writer import write_gguf

from pagedjax.models import gguf_index, loader
from pagedjax.models.gguf_file import gguf_arch_config


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache folder of the test's own, and every file indexed (the tiny files written here
    have no tokenizer arrays, which a file needs for an index otherwise)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(folder))
    monkeypatch.setattr(gguf_index, "INDEX_MIN_ELEMENTS", 0)
    return folder


def _assert_same_file(opened, reader, fields=None):
    """`opened` (a GGUFIndex) gives what `reader` (a GGUFReader) gives: every field in
    `fields` (default: all), every tensor's name, dims, format and bytes, and the
    architecture config."""
    for key in reader.fields if fields is None else fields:
        assert opened.fields.get(key).contents() == reader.fields[key].contents(), key
    assert opened.fields.get("no.such.key") is None
    assert [t.name for t in opened.tensors] == [t.name for t in reader.tensors]
    for got, want in zip(opened.tensors, reader.tensors, strict=True):
        assert got.shape.tolist() == want.shape.tolist(), want.name
        assert got.tensor_type == want.tensor_type, want.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, want.name
        assert np.array_equal(got.data.view(np.uint8), want.data.view(np.uint8)), want.name
    assert gguf_arch_config(opened) == gguf_arch_config(reader)


@pytest.mark.parametrize("quantize", [None, "Q4_1"])
def test_a_file_opened_from_its_index_reads_as_parsed(
    cache_dir, tmp_path, tiny_llama_dir, quantize
):
    """The first open parses the file and writes its index; the second reads the index, and
    gives the same fields, tensors (float32 and Q4_1 blocks) and config as a fresh parse."""
    path = str(
        write_gguf(
            tmp_path / "m.gguf",
            tiny_llama_dir,
            quantize=None
            if quantize is None
            else (lambda name: quantize if "ffn" in name else None),
        )
    )
    first = gguf_index.open_gguf(path)
    assert isinstance(first, gguf.GGUFReader)
    assert gguf_index.index_path(path).is_file()
    assert gguf_index.index_path(path).parent == cache_dir / "gguf-index"
    second = gguf_index.open_gguf(path)
    assert isinstance(second, gguf_index.GGUFIndex)
    if quantize:
        assert {t.tensor_type.name for t in second.tensors} >= {"F32", quantize}
    _assert_same_file(second, gguf.GGUFReader(path, "r"))


def test_the_second_open_does_not_parse_and_a_long_array_is_read_on_demand(
    cache_dir, tmp_path, monkeypatch
):
    """An index open constructs no GGUFReader until a field left out of the index (an array
    longer than MAX_ARRAY, like a tokenizer's vocabulary) is asked for; that one is read from
    the file."""
    path = str(tmp_path / "tok.gguf")
    tokens = [f"tok{i}" for i in range(gguf_index.MAX_ARRAY + 1)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list(tokens)
    w.add_array("tiny.list", [1, 2, 3])
    w.add_float32("tiny.eps", 1e-5)
    w.add_tensor("t.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf_index.open_gguf(path)  # parses, writes the index

    parsed = []
    real_reader = gguf.GGUFReader

    def counting_reader(*args, **kwargs):
        parsed.append(args)
        return real_reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    opened = gguf_index.open_gguf(path)
    assert isinstance(opened, gguf_index.GGUFIndex)
    assert opened.fields.get("tiny.list").contents() == [1, 2, 3]
    assert opened.fields.get("tiny.eps").contents() == np.float32(1e-5)
    assert opened.tensors[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert parsed == []
    assert opened.fields.get("tokenizer.ggml.tokens").contents() == tokens
    assert len(parsed) == 1


def test_a_changed_file_and_an_unreadable_index_are_parsed_afresh(
    cache_dir, tmp_path, tiny_llama_dir
):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama_dir, extra_fields={"llama.expert_used_count": 1})
    gguf_index.open_gguf(str(path))
    old_index = gguf_index.index_path(str(path))
    # the same path rewritten with other contents: another index, the new values
    write_gguf(tmp_path / "new.gguf", tiny_llama_dir, extra_fields={"llama.expert_used_count": 2})
    (tmp_path / "new.gguf").replace(path)
    assert gguf_index.index_path(str(path)) != old_index
    assert isinstance(gguf_index.open_gguf(str(path)), gguf.GGUFReader)
    opened = gguf_index.open_gguf(str(path))
    assert isinstance(opened, gguf_index.GGUFIndex)
    assert opened.fields.get("llama.expert_used_count").contents() == 2
    # a truncated index is parsed again and rewritten
    gguf_index.index_path(str(path)).write_text('{"version": 1, "fields": {')
    assert isinstance(gguf_index.open_gguf(str(path)), gguf.GGUFReader)
    assert isinstance(gguf_index.open_gguf(str(path)), gguf_index.GGUFIndex)


def test_a_file_with_short_metadata_arrays_gets_no_index(tmp_path, monkeypatch, tiny_llama_dir):
    """Below INDEX_MIN_ELEMENTS array elements the parse is quick: no index is written (the
    tiny files that tests write leave nothing in the cache folder)."""
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf(tmp_path / "m.gguf", tiny_llama_dir))
    for _ in range(2):
        assert isinstance(gguf_index.open_gguf(path), gguf.GGUFReader)
    assert not gguf_index.index_path(path).exists()


def test_an_unwritable_cache_directory_only_costs_the_parse(tmp_path, monkeypatch, tiny_llama_dir):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(gguf_index, "INDEX_MIN_ELEMENTS", 0)
    path = str(write_gguf(tmp_path / "m.gguf", tiny_llama_dir))
    for _ in range(2):
        opened = gguf_index.open_gguf(path)
        assert isinstance(opened, gguf.GGUFReader)
        assert gguf_arch_config(opened).num_hidden_layers > 0


@pytest.mark.slow
def test_the_default_model_from_its_index(tmp_path, monkeypatch):
    """The default model's file (Q4_1, its tokenizer's 49,152 tokens in the metadata): the
    index holds its small fields and tensor table, the tokenizer arrays stay out of it, and
    the file opened from the index reads as parsed."""
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    path = loader.resolve_model_source(None).path
    reader = gguf.GGUFReader(path, "r")
    index = gguf_index.index_of(reader)
    # only the tokenizer's long arrays are read on demand: nothing a load reads
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= set(index["large_fields"])
    assert set(index["large_fields"]) <= {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    }
    assert len(index["tensors"]) == len(reader.tensors)
    opened = gguf_index.GGUFIndex(path, index)
    small = [k for k in reader.fields if k in index["fields"]]
    _assert_same_file(opened, reader, fields=small)
