"""Host side of the engine: requests, validation, blocks, scheduling, outputs.

How a request flows (each file named in the order a request meets it):

1. `llm.py` (`LLM.generate`) or `server/serving_completion.py` / `serving_chat.py` through
   `engine/async_llm.py` (the engine thread) call `LLMEngine.add_request` in
   `engine/engine.py`; `engine/factory.py` built that engine (`engine/dp_engine.py` for
   data-parallel replicas, `engine/ray_engine.py` for Ray actors).
2. `engine/input_processor.py` validates the prompt and `SamplingParams` once (every refusal
   an `errors.InvalidInputError` naming the field), tokenizes it and truncates it; a
   `structured_outputs` constraint is checked by `structured_output/grammar.py` and compiled
   by `structured_output/manager.py` on its thread pool.
3. `engine/request.py`: one `Request` per output sequence holds all of its state (tokens,
   progress, status, its `engine/detokenizer.py` text) and a frozen
   `engine/interface.RequestSpec` made here once; `engine/forks.py` holds the n > 1 samples
   of a prompt until the first has computed it.
4. Each `LLMEngine.step()`: `engine/scheduler.py` (`Scheduler.schedule`) picks requests and
   token counts under the budget and gets their blocks from `engine/kv_cache_manager.py`
   (prefix cache, copy-on-write, swap pool); it returns an `engine/interface.SchedulerOutput`
   of ids, counts and specs, no `Request`, and the token bitmask of the constrained rows
   (`structured_output/scheduling.py`; requests whose grammar is compiling wait there).
   With `speculative_config`, `engine/spec_decode/` proposes tokens for decoding requests
   (n-gram lookup in `ngram.py`, or the draft model's proposals of the previous step,
   `executor/draft_model.py`), scheduled after the request's last token.
5. `executor/model_runner.py` (`ModelRunner.execute`) keeps per-request rows
   (`executor/request_state.py`), packs the step (`executor/input_batch.py`) and runs the
   compiled `executor/step.py`: the model from `models/registry.py` (`models/llama.py` over
   `ops/attention.py`, `ops/linear.py`, `ops/kv_cache.py`) and the sampler
   (`ops/sampling.py`); it returns an `engine/interface.ModelRunnerOutput` of sampled ids.
   The model was loaded onto its devices by `executor/model_loading.py`.
6. `Scheduler.update_from_output` appends each sampled token to its `Request`, grows its
   text, and decides in one place whether it finished (EOS, stop token ids, max_tokens /
   max_model_len, stop strings, a completed grammar; each constrained request's matcher,
   `structured_output/request.py`, advances by the token); with speculation, the tokens a
   step kept (`ops/rejection_sampler.py`) are taken one by one, the same checks after each;
   finished requests free their blocks.
7. `engine/output_processor.py` gathers logprobs and builds the `outputs.RequestOutput`s of
   the caller's `output_kind`; `engine/metrics.py` and `engine/prometheus.py` record stats.

The modules `scheduler`, `kv_cache_manager`, `request`, `forks`, `interface`,
`input_processor`, `output_processor` and `detokenizer` import no jax (a test checks it).
"""
