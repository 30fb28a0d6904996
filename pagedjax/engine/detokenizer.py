"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per request.

It holds text, not tokens: each call gets the request's output token ids (the request's own
list) and decodes those it has not seen yet.

Text grows token by token through the `tokenizers` library's `DecodeStream`, which holds a
token back while it ends inside a multi-byte UTF-8 character, so every delta is valid text
and the deltas join to the full decode. The stream is primed with the prompt's last tokens,
so the first output token is spaced as it is after that prompt.

Stop strings are searched in the new text only (plus the longest stop string's length of
what came before, so a stop string split across tokens is found). The output ends just
before the stop string, or just after it with `include_stop_str_in_output`. While streaming,
the last `len(longest stop) - 1` characters are held back, since they could still turn into
a stop string; they are released when the request ends another way. Bytes that never
complete a character are released at the end as the full decode shows them (U+FFFD).

A request that ends on its EOS or one of its `stop_token_ids` leaves that token's text out
(the token stays in the output's ids), unless `include_stop_str_in_output`, as vLLM does:
with `skip_special_tokens=False` the EOS text (e.g. "<|im_end|>") is not in the answer, and a
stop token's text (e.g. a newline) ends it without appearing.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedjax.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one output sequence as its tokens arrive.

    Args:
        tokenizer: a Hugging Face tokenizer (fast tokenizers use `DecodeStream`; others are
            decoded in full at every step).
        prompt_token_ids: the prompt, for the leading context.
        params: the request's SamplingParams (stop, include_stop_str_in_output,
            skip_special_tokens, min_tokens, detokenize).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.params = params
        self.output_text = ""
        self.num_tokens = 0  # output tokens decoded so far
        self._sent = 0  # characters of output_text already returned as deltas
        self._stop_hold = (
            max((len(s) for s in params.stop), default=1) - 1
            if params.stop and not params.include_stop_str_in_output
            else 0
        )
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer else None
        self._stream = None
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._stopped = False
        self._decoded: list[int] | None = None  # the ids the text shows, when not all of them
        if self._backend is not None and params.detokenize:
            self._stream = DecodeStream(
                ids=list(self._context), skip_special_tokens=params.skip_special_tokens
            )

    def update(self, output_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Adds the tokens of `output_token_ids` (the request's whole output so far) not yet
        decoded to the text; returns the stop string matched, if any (the text is then cut
        as the module docstring says). `stop_terminated`: the last token ends the request
        (its EOS or a stop token id): its text is left out unless
        `include_stop_str_in_output`."""
        new_token_ids = output_token_ids[self.num_tokens :]
        self.num_tokens = len(output_token_ids)
        if not self.params.detokenize or self._tokenizer is None:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]
            output_token_ids = output_token_ids[:-1]
            self._decoded = output_token_ids  # what the text shows, for `flush`
        before = len(self.output_text)
        if self._stream is not None:
            for t in new_token_ids:
                piece = self._stream.step(self._backend, t)
                if piece:
                    self.output_text += piece
        else:
            self.output_text = self._tokenizer.decode(
                output_token_ids, skip_special_tokens=self.params.skip_special_tokens
            )
        if not self.params.stop or self.num_tokens < self.params.min_tokens:
            return None
        return self._find_stop(before)

    def _find_stop(self, before: int) -> str | None:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, before - longest + 1)
        best_idx, best = -1, None
        for s in self.params.stop:
            idx = self.output_text.find(s, start)
            if idx != -1 and (best_idx == -1 or idx < best_idx):
                best_idx, best = idx, s
        if best is None:
            return None
        self._stopped = True
        end = best_idx + len(best) if self.params.include_stop_str_in_output else best_idx
        self.output_text = self.output_text[:end]
        return best

    def flush(self, output_token_ids: list[int]) -> None:
        """At the end of a request (not by a stop string): adds what the stream still holds,
        i.e. trailing bytes that never completed a character, as the full decode of
        `output_token_ids` (the request's whole output) shows them."""
        if self._stream is None or self._stopped:
            return
        if self._decoded is not None:  # ended on a stop token whose text is left out
            output_token_ids = self._decoded
        skip = self.params.skip_special_tokens
        full = self._tokenizer.decode(
            self._context + list(output_token_ids), skip_special_tokens=skip
        )
        prefix = self._tokenizer.decode(self._context, skip_special_tokens=skip)
        if full.startswith(prefix):
            tail = full[len(prefix) :]
            if len(tail) > len(self.output_text) and tail.startswith(self.output_text):
                self.output_text = tail

    def get_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (or only what is new, if `delta`), minus the
        characters held back for a possible stop string while not `finished`."""
        end = (
            len(self.output_text)
            if finished
            else max(self._sent, len(self.output_text) - self._stop_hold)
        )
        text = self.output_text[self._sent if delta else 0 : end]
        if delta:
            self._sent = end
        return text
