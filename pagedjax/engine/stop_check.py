"""Whether a request ends with its last sampled token: the scheduler's one stop decision
(vLLM's `check_stop`), called after each token it appends."""

from __future__ import annotations

from pagedjax.engine.request import Request, RequestStatus


def check_stop(req: Request, max_model_len: int) -> RequestStatus | None:
    """Whether `req` ends with its last output token, and how (None: it goes on); sets
    `req.stop_reason` to the stop token id, stop string or grammar error that ended it.

    In this order: EOS (unless `ignore_eos`) or a stop token id, once `min_tokens` are out
    (its text is left out of the output unless `include_stop_str_in_output`);
    a structured-output error, or a complete grammar; `max_tokens` or `max_model_len`
    tokens; a stop string in the detokenized text (updated with every token, whatever ends
    the request).
    """
    p = req.sampling_params
    token = req.output_token_ids[-1]
    eos = token == req.eos_token_id and not p.ignore_eos
    stop_token = bool(p.stop_token_ids) and token in p.stop_token_ids
    terminated = req.num_output_tokens >= p.min_tokens and (eos or stop_token)
    # The text grows with every token, whatever ends the request (but for the EOS or stop
    # token that ends it: the detokenizer leaves its text out, as vLLM does).
    stop_string = None
    if req.detokenizer:
        stop_string = req.detokenizer.update(req.output_token_ids, stop_terminated=terminated)
    if terminated:
        if not eos:
            req.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    so = req.structured_output
    if so is not None and so.error is not None:
        req.stop_reason = so.error
        return RequestStatus.FINISHED_ERROR
    if so is not None and so.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # the grammar is complete
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if stop_string is not None:
        req.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    return None
