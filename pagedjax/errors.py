"""Errors that cross the engine's public boundary.

`InvalidInputError` is a `ValueError` (so callers that catch `ValueError` keep working) that
also names the request field at fault, `param`, which the server returns as the `param` of an
OpenAI error body with status 400.
"""

from __future__ import annotations


class InvalidInputError(ValueError):
    """A request the engine refuses because of its input.

    Args:
        message: what is wrong, naming the field and the limit.
        param: the request field at fault (vLLM's / OpenAI's name), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
