"""The base models of the OpenAI API's pydantic models: requests are strict (JSON types not
coerced, no NaN or infinities, text encodable as UTF-8, unknown fields kept and ignored),
responses forbid fields they do not declare."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class OpenAIBaseModel(BaseModel):
    """Strict JSON types, no NaN/inf, text encodable as UTF-8, unknown fields kept (and
    ignored)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _encodable(cls, value: Any) -> Any:
        if _has_unencodable_text(value):
            raise ValueError("text must be valid Unicode (no unpaired UTF-16 surrogates)")
        return value


def _has_unencodable_text(value: Any) -> bool:
    """Whether a string of `value` (or of its lists and dicts) cannot be encoded as UTF-8.
    A list of numbers (token ids: the types are already checked) is not walked."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        if not value or isinstance(value[0], int | float):
            return False
        if isinstance(value[0], list) and value[0] and isinstance(value[0][0], int):
            return False
        return any(_has_unencodable_text(v) for v in value)
    if isinstance(value, dict):
        return any(_has_unencodable_text(k) or _has_unencodable_text(v) for k, v in value.items())
    return False


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
