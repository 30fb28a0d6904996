"""From what a caller gives `add_request` to what the scheduler takes: validation, done once.

`InputProcessor.process` tokenizes a text prompt, truncates it (`truncate_prompt_tokens`),
checks it and the `SamplingParams` against the model (vocabulary, `max_model_len`,
`max_logprobs`), resolves `max_tokens`, tokenizes the bad words and checks a
`structured_outputs` constraint (`structured_output.validate_structured_outputs`). Every
refusal is an `errors.InvalidInputError` naming the field, raised before anything is queued;
the server maps it to a 400 with that `param`. Plain Python, no jax.

This runs on the engine thread (between two steps), so its cost is bounded: a token-id
prompt longer than max_model_len is refused (or truncated) before its ids are scanned, and a
request's bad words, at most `MAX_BAD_WORDS` of them, are tokenized in one batched call.
"""

from __future__ import annotations

import dataclasses

from pagedjax.config import ModelConfig
from pagedjax.errors import InvalidInputError
from pagedjax.executor.input_batch import MAX_BANNED
from pagedjax.inputs import PromptType, parse_prompt
from pagedjax.sampling_params import SamplingParams
from pagedjax.structured_output import validate_structured_outputs

MAX_BAD_WORDS = 1024  # bad words per request (vLLM sets no limit); more is a 400


def prompt_too_long(n: int, max_model_len: int) -> InvalidInputError:
    """The refusal (param "prompt") of a prompt of n tokens that does not fit max_model_len
    (n > max_model_len), or leaves no room for output (n == max_model_len), in vLLM's
    words (which clients match to shorten a conversation and retry)."""
    full = ", which leaves no room for output" if n == max_model_len else ""
    return InvalidInputError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"request has {n} input tokens{full}. Please reduce the length of the input messages.",
        "prompt",
    )


@dataclasses.dataclass(frozen=True)
class ProcessedInput:
    """A validated request: its text (None for token ids), prompt token ids (truncated),
    cache salt, a copy of its SamplingParams with `max_tokens` resolved, the token
    sequences of its bad words, and its structured-outputs constraint's grammar text (None
    without one)."""

    text: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    params: SamplingParams
    bad_words_token_ids: list[list[int]] | None
    grammar_text: str | None = None


class InputProcessor:
    """Validates and prepares requests for one model.

    Args:
        model_config: the engine's ModelConfig (vocabulary, max_model_len, max_logprobs).
        tokenizer: the engine's tokenizer, or None (token-id prompts only).
    """

    def __init__(self, model_config: ModelConfig, tokenizer):
        self.model_config = model_config
        self.tokenizer = tokenizer

    def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The token ids of a prompt (tokenized if given as text).

        Raises:
            InvalidInputError: a malformed or empty prompt, or text without a tokenizer.
        """
        return self._parse(prompt)[1]

    def _parse(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, cache salt) of a prompt; text is tokenized."""
        try:
            text, ids, salt = parse_prompt(prompt)
        except ValueError as e:
            raise InvalidInputError(str(e), "prompt") from None
        if ids is None:
            if self.tokenizer is None:
                raise InvalidInputError(
                    "prompts must be token ids when skip_tokenizer_init is set", "prompt"
                )
            if text == "":
                raise InvalidInputError("prompt must not be empty", "prompt")
            try:
                ids = self.tokenizer(text).input_ids
            except (TypeError, ValueError) as e:  # e.g. an unpaired UTF-16 surrogate
                raise InvalidInputError(f"the prompt cannot be tokenized: {e}", "prompt") from None
        return text, ids, salt

    def process(
        self, prompt: PromptType, params: SamplingParams, check_max_tokens: bool = False
    ) -> ProcessedInput:
        """Validates a request and resolves what it leaves open.

        Args:
            prompt: text, token ids, or a TextPrompt / TokensPrompt dict.
            params: its SamplingParams (not modified: the result holds a copy).
            check_max_tokens: refuse, as OpenAI's API does, a prompt that leaves no room for
                output and an explicit `max_tokens` that does not fit after the prompt;
                otherwise `max_tokens` is capped to the room left (at least 1).

        Raises:
            InvalidInputError: what is wrong, with the field at fault as `param`.
        """
        mc = self.model_config
        m = mc.max_model_len
        k = params.truncate_prompt_tokens
        if k is not None and k > m:
            raise InvalidInputError(
                f"truncate_prompt_tokens must be -1 or in [1, max_model_len={m}], got {k}",
                "truncate_prompt_tokens",
            )
        keep = None if k is None else (m if k == -1 else k)
        raw = _token_list(prompt)
        if raw is not None:  # cut or refused before its ids are scanned
            if keep is None:
                self._check_prompt_len(len(raw), check_max_tokens)
            elif len(raw) > keep:
                prompt = _with_token_list(prompt, raw[-keep:])
        text, ids, salt = self._parse(prompt)
        if keep is not None:
            ids = ids[-keep:]
        if not ids:
            raise InvalidInputError("prompt must not be empty (it has 0 tokens)", "prompt")
        self._check_prompt_len(len(ids), check_max_tokens)
        vocab = mc.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})", "prompt"
            )
        if check_max_tokens and params.max_tokens is not None and len(ids) + params.max_tokens > m:
            raise InvalidInputError(
                f"This model's maximum context length is {m} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "max_tokens",
            )
        grammar = self._check_params(params)
        bad_words = self._bad_words_token_ids(params)
        self._check_banned(params, bad_words)
        params = params.clone()
        room = m - len(ids)
        params.max_tokens = max(1, min(params.max_tokens or room, room)) if room > 0 else 1
        return ProcessedInput(text, ids, salt, params, bad_words, grammar)

    def _check_prompt_len(self, n: int, check_max_tokens: bool) -> None:
        """Refuses a prompt of n tokens longer than max_model_len (or, when max_tokens is
        checked too, one that leaves no room for output), in one wording either way."""
        m = self.model_config.max_model_len
        if n > m or (check_max_tokens and n == m):
            raise prompt_too_long(n, m)

    def _check_params(self, params: SamplingParams) -> str | None:
        """Checks what SamplingParams cannot check alone (vocabulary, max_logprobs, ...);
        returns the structured-outputs constraint's grammar text (None without one)."""
        mc = self.model_config
        vocab = mc.arch.vocab_size
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > mc.max_logprobs:
                raise InvalidInputError(
                    f"{field} must be <= max_logprobs ({mc.max_logprobs}), got {k}", field
                )
        for field, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids),
        ):
            out = [t for t in ids if not 0 <= t < vocab]
            if out:
                raise InvalidInputError(
                    f"{field} has token id {out[0]} outside the vocabulary [0, {vocab})", field
                )
        if (params.stop or params.bad_words) and self.tokenizer is None:
            field = "stop" if params.stop else "bad_words"
            raise InvalidInputError(
                f"{field} needs a tokenizer (skip_tokenizer_init is set)", field
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidInputError(
                    "structured_outputs needs a tokenizer (skip_tokenizer_init is set)",
                    "structured_outputs",
                )
            return validate_structured_outputs(params.structured_outputs)
        return None

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Token sequences of each bad word, with and without a leading space (as vLLM),
        each sequence once, from one batched tokenizer call.

        Raises:
            InvalidInputError: more than MAX_BAD_WORDS words, or a word that cannot be
                tokenized (e.g. an unpaired UTF-16 surrogate).
        """
        words = params.bad_words
        if not words:
            return None
        if len(words) > MAX_BAD_WORDS:
            raise InvalidInputError(
                f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}",
                "bad_words",
            )
        texts = [prefix + w.lstrip() for w in words for prefix in ("", " ")]
        try:
            encoded = self.tokenizer(texts, add_special_tokens=False).input_ids
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"bad_words cannot be tokenized: {e}", "bad_words") from None
        seqs = dict.fromkeys(tuple(ids) for ids in encoded if ids)
        return [list(s) for s in seqs]

    @staticmethod
    def _check_banned(params: SamplingParams, bad_words: list[list[int]] | None) -> None:
        """A step bans at most MAX_BANNED token ids per request: the stop ids while
        min_tokens is not reached (and EOS), and the last token of every multi-token bad word
        whose other tokens end the output."""
        stops = len(params.stop_token_ids) + 1 if params.min_tokens else 0
        if stops > MAX_BANNED:
            raise InvalidInputError(
                f"with min_tokens, stop_token_ids may hold at most {MAX_BANNED - 1} ids, got "
                f"{len(params.stop_token_ids)}",
                "stop_token_ids",
            )
        endings = {w[-1] for w in bad_words or () if len(w) > 1}
        if stops + len(endings) > MAX_BANNED:
            raise InvalidInputError(
                f"bad_words may end in at most {MAX_BANNED - stops} distinct tokens when their "
                f"words are longer than one token (got {len(endings)})",
                "bad_words",
            )


def _token_list(prompt: PromptType) -> list | None:
    """The list of a token-id prompt, as given (not yet checked), or None."""
    if isinstance(prompt, list):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        return prompt["prompt_token_ids"]
    return None


def _with_token_list(prompt: PromptType, ids: list) -> PromptType:
    return ids if isinstance(prompt, list) else {**prompt, "prompt_token_ids": ids}
