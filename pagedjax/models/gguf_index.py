"""A GGUF file's small metadata and tensor table, kept on disk so that later opens skip the parse.

`gguf.GGUFReader` parses every metadata field in Python when it opens a file: for the default
model (49,152 tokens and 48,900 merges in its tokenizer fields) that takes ~3.4 s on an AMD
EPYC (Zen 3), and every process that loads the file paid it (each engine start, each
`pagedjax serve`). A load reads only the small fields (the architecture's hyper-parameters,
token ids) and the tensor table (name, dims, format, where the bytes are). So the first open
of a file parses it with `GGUFReader` and writes those as JSON under the cache directory
(`paths.cache_root()` / "gguf-index", named by `paths.file_fingerprint`: the file's real
path, size and modification time, this module's `INDEX_VERSION` and the `gguf` package's
version); later opens read the JSON and map the file, and give each tensor's bytes as the
same numpy view (dtype, shape, offset) that `GGUFReader` gave when the index was written. A
field left out of the index (an array of more than `MAX_ARRAY` elements, or a value JSON
cannot hold) is read through a full `GGUFReader`, opened on first need. A file whose
metadata arrays are short (fewer than `INDEX_MIN_ELEMENTS` elements in all) parses in
milliseconds and gets no index. An index that cannot be read (a partial or foreign file) is
rebuilt; a cache directory that cannot be written only costs the parse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.paths import cache_root, file_fingerprint

logger = logging.getLogger(__name__)

INDEX_VERSION = 1  # bump when the index's layout or meaning changes
MAX_ARRAY = 64  # array fields longer than this stay out of the index (read on demand)
# Files whose metadata arrays hold fewer elements than this in all parse in milliseconds and
# get no index (a file written by a test, a model without a tokenizer in it).
INDEX_MIN_ELEMENTS = 1024


@dataclasses.dataclass(frozen=True)
class IndexedField:
    """A metadata field's value, as `gguf.ReaderField.contents()` gave it."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclasses.dataclass(frozen=True)
class IndexedTensor:
    """One tensor of the file, with the attributes of `gguf.ReaderTensor` a load uses.

    Attributes:
        name: the GGUF tensor name ("blk.0.attn_q.weight").
        shape: uint64 [n_dims], ggml's order (innermost first), as `ReaderTensor.shape`.
        tensor_type: its `gguf.GGMLQuantizationType`.
        data: a read-only view of its bytes in the mapped file, with `ReaderTensor.data`'s
            dtype and shape (float arrays for F32 / F16, rows of uint8 blocks for the
            quantized formats).
    """

    name: str
    shape: np.ndarray
    tensor_type: Any
    data: np.ndarray


class _Fields:
    """`GGUFReader.fields` for the indexed fields; the others through `full()`."""

    def __init__(self, values: dict, large: set, full: Callable[[], Any]):
        self._values = values
        self._large = large
        self._full = full

    def get(self, key: str, default=None):
        if key in self._values:
            return IndexedField(self._values[key])
        if key in self._large:
            return self._full().fields.get(key, default)
        return default


class GGUFIndex:
    """A GGUF file opened from its index: `fields.get(key)` and `tensors`, as `GGUFReader`
    gives them (see the module docstring)."""

    def __init__(self, path: str, index: dict):
        import gguf

        self.path = path
        self._reader = None
        self.fields = _Fields(index["fields"], set(index["large_fields"]), self._full_reader)
        mapped = np.memmap(path, np.uint8, "r")
        self.tensors = []
        for t in index["tensors"]:
            dtype = np.dtype(t["dtype"])
            n = math.prod(t["shape"]) * dtype.itemsize
            if t["offset"] + n > mapped.shape[0]:
                raise ValueError(f"tensor {t['name']!r} lies past the end of {path}")
            data = mapped[t["offset"] : t["offset"] + n].view(dtype).reshape(t["shape"])
            self.tensors.append(
                IndexedTensor(
                    t["name"],
                    np.asarray(t["dims"], np.uint64),
                    gguf.GGMLQuantizationType(t["type"]),
                    data,
                )
            )

    def _full_reader(self):
        if self._reader is None:
            import gguf

            self._reader = gguf.GGUFReader(self.path, "r")
        return self._reader


def index_of(reader) -> dict:
    """The index (a JSON-able dict) of an open `gguf.GGUFReader`."""
    from gguf import GGUFValueType

    fields, large = {}, []
    for name, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > MAX_ARRAY:
            large.append(name)
            continue
        value = field.contents()
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            large.append(name)
            continue
        fields[name] = value
    tensors = [
        {
            "name": t.name,
            "dims": [int(d) for d in t.shape],
            "type": int(t.tensor_type),
            "offset": int(t.data_offset),
            "dtype": t.data.dtype.str,
            "shape": [int(d) for d in t.data.shape],
        }
        for t in reader.tensors
    ]
    return {"version": INDEX_VERSION, "fields": fields, "large_fields": large, "tensors": tensors}


def index_path(path: str) -> Path:
    """Where the index of the GGUF file at `path` is kept (see the module docstring)."""
    digest = file_fingerprint(path, f"index-v{INDEX_VERSION}", f"gguf-{_gguf_version()}")
    return cache_root() / "gguf-index" / f"{Path(os.path.realpath(path)).stem}-{digest}.json"


@functools.cache
def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


def open_gguf(path: str):
    """The GGUF file at `path`, as a `GGUFIndex` when its index is there and readable, else
    as a `gguf.GGUFReader` (whose index is then written for the next open)."""
    where = index_path(path)
    if where.is_file():
        try:
            index = json.loads(where.read_text())
            if index.get("version") == INDEX_VERSION:
                return GGUFIndex(path, index)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.info("rebuilding the GGUF index %s (%s)", where, e)
    import gguf

    reader = gguf.GGUFReader(path, "r")
    if _array_elements(reader) >= INDEX_MIN_ELEMENTS:
        with contextlib.suppress(OSError):
            _write_atomically(where, json.dumps(index_of(reader)))
    return reader


def _array_elements(reader) -> int:
    """The elements of the reader's array fields, in all (what its parse's time grows with)."""
    from gguf import GGUFValueType

    return sum(
        len(f.data) for f in reader.fields.values() if f.types and f.types[0] == GGUFValueType.ARRAY
    )


def _write_atomically(where: Path, text: str) -> None:
    """`text` into `where` through a temporary file renamed over it (readers never see half)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=f".{where.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, where)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
