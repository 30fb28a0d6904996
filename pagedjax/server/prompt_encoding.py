"""Prompt text to token ids for the server, without handing back the ids of a prompt too
long to serve.

A fast tokenizer encodes with the GIL released, but turning its result into Python lists
holds the GIL for the whole list: for a prompt of millions of tokens that is 0.1 s or
more in which no other thread (the event loop, the engine's) runs. A prompt longer than
the model's context is refused anyway, so its tokens are counted on the tokenizer's own
`Encoding` and only the ids of a prompt that may be served become a list. The backend's
`encode_batch_fast` is used where the installed tokenizers has it: the same ids without
character offsets, in about half the time, and an `Encoding` that is freed (under the GIL)
in 20 ms rather than 100 ms for 3 million tokens. A slow (Python) tokenizer, or a fast one
whose backend truncates, pads or splits special tokens differently from its Hugging Face
wrapper, is called through the wrapper as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PromptTooLongError(ValueError):
    """A prompt of `num_tokens` tokens, over the limit it was encoded against."""

    def __init__(self, index: int, num_tokens: int, limit: int):
        super().__init__(f"prompt {index} has {num_tokens} tokens, over the limit of {limit}")
        self.index = index
        self.num_tokens = num_tokens
        self.limit = limit


def encode_texts(
    tokenizer: Any,
    texts: Sequence[str],
    add_special_tokens: bool,
    limit: int | None = None,
) -> list[list[int]]:
    """Token ids of each text, from one batched tokenizer call (blocking: run it off the
    event loop).

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: the prompts.
        add_special_tokens: add the tokenizer's special tokens (BOS, ...), as its
            `__call__` does.
        limit: the most tokens a text may have (max_model_len), or None for no limit.

    Returns:
        One list of int token ids per text, the same as `tokenizer(texts,
        add_special_tokens=add_special_tokens).input_ids`.

    Raises:
        PromptTooLongError: a text of more than `limit` tokens (the first such, by index);
            its ids are never converted to Python ints.
        TypeError, ValueError: text the tokenizer refuses (e.g. an unpaired surrogate).
    """
    backend = _plain_backend(tokenizer)
    if backend is None:
        ids = [
            list(x) for x in tokenizer(list(texts), add_special_tokens=add_special_tokens).input_ids
        ]
        lengths = [len(x) for x in ids]
    else:
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        encodings = encode(list(texts), add_special_tokens=add_special_tokens)
        lengths = [len(e) for e in encodings]
    if limit is not None:
        for i, n in enumerate(lengths):
            if n > limit:
                raise PromptTooLongError(i, n, limit)
    return ids if backend is None else [e.ids for e in encodings]


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast Hugging Face tokenizer when calling it
    directly gives the wrapper's ids (no truncation or padding set on it, special tokens
    split as the wrapper splits them), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if bool(getattr(backend, "encode_special_tokens", False)) != split:
        return None
    return backend
