"""Prompt forms accepted by `LLM.generate` and the engine (vLLM's TextPrompt / TokensPrompt)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as given."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None, str | None]:
    """Splits a prompt into (text, token ids, cache salt); exactly one of text/ids is used.

    Raises:
        ValueError: not one of the accepted forms.
    """
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt given as a list must be a list of token ids (int)")
        return None, list(prompt), None
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of token ids (int)")
            return prompt.get("prompt"), list(ids), salt
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None, salt
    raise ValueError(
        "a prompt must be a string, a list of token ids, {'prompt': str} or "
        f"{{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}"
    )
