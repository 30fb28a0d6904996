"""From what a caller gives `add_request` to what the scheduler takes: validation, done once.

`InputProcessor.process` tokenizes a text prompt, truncates it (`truncate_prompt_tokens`),
checks it and the `SamplingParams` against the model (vocabulary, `max_model_len`,
`max_logprobs`), resolves `max_tokens` and tokenizes the bad words. Every refusal is an
`errors.InvalidInputError` naming the field, raised before anything is queued; the server
maps it to a 400 with that `param`. Plain Python, no jax.
"""

from __future__ import annotations

import dataclasses

from pagedjax.config import ModelConfig
from pagedjax.errors import InvalidInputError
from pagedjax.executor.input_batch import MAX_BANNED
from pagedjax.inputs import PromptType, parse_prompt
from pagedjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ProcessedInput:
    """A validated request: its text (None for token ids), prompt token ids (truncated),
    cache salt, a copy of its SamplingParams with `max_tokens` resolved, and the token
    sequences of its bad words."""

    text: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    params: SamplingParams
    bad_words_token_ids: list[list[int]] | None


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
        try:
            text, ids, _ = parse_prompt(prompt)
        except ValueError as e:
            raise InvalidInputError(str(e), "prompt") from None
        if ids is None:
            if self.tokenizer is None:
                raise InvalidInputError(
                    "prompts must be token ids when skip_tokenizer_init is set", "prompt"
                )
            if text == "":
                raise InvalidInputError("prompt must not be empty", "prompt")
            ids = self.tokenizer(text).input_ids
        return ids

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
        ids = self.prompt_token_ids(prompt)
        text, _, salt = parse_prompt(prompt)
        k = params.truncate_prompt_tokens
        if k is not None:
            if k > m:
                raise InvalidInputError(
                    f"truncate_prompt_tokens must be -1 or in [1, max_model_len={m}], got {k}",
                    "truncate_prompt_tokens",
                )
            ids = ids[-(m if k == -1 else k) :]
        if not ids:
            raise InvalidInputError("prompt must not be empty (it has 0 tokens)", "prompt")
        if len(ids) > m and not check_max_tokens:
            raise InvalidInputError(
                f"prompt has {len(ids)} tokens, more than max_model_len={m}", "prompt"
            )
        if check_max_tokens and len(ids) >= m:
            raise InvalidInputError(
                f"This model's maximum context length is {m} tokens. However, your request "
                f"has {len(ids)} input tokens, which leaves no room for output. Please reduce "
                "the length of the prompt.",
                "prompt",
            )
        vocab = mc.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})", "prompt"
            )
        if check_max_tokens and params.max_tokens is not None and len(ids) + params.max_tokens > m:
            raise InvalidInputError(
                f"This model's maximum context length is {m} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.",
                "max_tokens",
            )
        self._check_params(params)
        bad_words = self._bad_words_token_ids(params)
        self._check_banned(params, bad_words)
        params = params.clone()
        room = m - len(ids)
        params.max_tokens = max(1, min(params.max_tokens or room, room)) if room > 0 else 1
        return ProcessedInput(text, ids, salt, params, bad_words)

    def _check_params(self, params: SamplingParams) -> None:
        """Checks what SamplingParams cannot check alone (vocabulary, max_logprobs, ...)."""
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

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Token sequences of each bad word, with and without a leading space (as vLLM),
        each sequence once."""
        if not params.bad_words:
            return None
        seqs: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            for prefix in ("", " "):
                ids = self.tokenizer(prefix + word.lstrip(), add_special_tokens=False).input_ids
                if ids:
                    seqs[tuple(ids)] = None
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
