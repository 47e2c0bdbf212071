"""`LLMEngine`: one synchronous engine, stepped by its caller (the `LLM` class, or `AsyncLLMEngine`'s thread).

    step():  schedule -> run the model -> update the ledger -> turn tokens into outputs

A request added with `hand_off` (a prefill engine's, docs/design/disaggregation.md) ends as any
other, then its prompt's full blocks go to the store and its last output is held until their writes
have settled (landed, failed or past the store's deadline), and carries what reached the store.

A step that raises (the model, the sampler, a bug) costs the requests of that step, never the
engine: they end with finish reason "error", everything they held is released, and `audit()`
proves it. Only an audit that fails after that recovery is fatal (`EngineDeadError`).

`LLMEngine` is not thread-safe: `AsyncLLMEngine` (kvstrata.engine.async_engine) gives it one thread
of its own, and other threads see it only through the snapshots that thread publishes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from kvstrata.core.config import EngineConfig
from kvstrata.core.errors import RequestRejected
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.outputs import HandOff, RequestOutput, best_samples
from kvstrata.core.request import Request, RequestStatus, SampleFamily
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.core.timeline import RequestTimeline
from kvstrata.engine.adapters import Adapters
from kvstrata.engine.detokenizer import IncrementalDetokenizer
from kvstrata.engine.prompts import Prompt, PromptEncoder, Tokenized
from kvstrata.engine.snapshots import EngineInfo, EngineSnapshot, EngineStats, RequestCounts, copied
from kvstrata.engine.timelines import TimelineRecorder
from kvstrata.engine.tracking import HeldHandOff, Tracked, combine
from kvstrata.kvcache.faults import FaultInjector, FaultyMover
from kvstrata.kvcache.stores import open_store
from kvstrata.kvcache.tiers import TierManager
from kvstrata.model.adapters.lora import AdapterError
from kvstrata.model.arch import resolve_max_model_len
from kvstrata.model.loader import LoadedModel, load_model, plan_load
from kvstrata.scheduler.drafts import PREDICTION_LOOKAHEAD
from kvstrata.scheduler.output import SchedulerOutput
from kvstrata.scheduler.scheduler import Scheduler
from kvstrata.scheduler.step_cost import StepCostModel
from kvstrata.structured.grammar import compile_grammar
from kvstrata.worker.memory_check import check_memory
from kvstrata.worker.runner import ModelRunner, StepResult

logger = logging.getLogger(__name__)



class EngineDeadError(RuntimeError):
    """The books did not balance after recovering from a failed step: the engine cannot go on."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 faults: FaultInjector | None = None):
        config.validate()
        if loaded is None:
            plan = plan_load(config.model)
            check_memory(plan, config.cache)   # before any allocation
            loaded = load_model(config.model)
        self.loaded = loaded
        # The one value of the config learned from the model: a new (frozen) config, never a mutation.
        scheduler_config = dataclasses.replace(
            config.scheduler, max_model_len=resolve_max_model_len(config.scheduler.max_model_len, self.loaded.arch))
        self.config = config = dataclasses.replace(config, scheduler=scheduler_config).validate()
        self.tokenizer = self.loaded.tokenizer
        self.prompts = PromptEncoder(self.tokenizer, self.loaded.chat_template, self.loaded.name)
        self.runner = ModelRunner(self.loaded, config.cache)
        self.faults = faults
        cache = config.cache
        self.store = open_store(cache.store, cache.store_path, cache.store_capacity, cache.store_timeout)
        mover = self.runner.buffers if faults is None else FaultyMover(self.runner.buffers, faults)
        self.tiers = TierManager(cache, self.runner.num_device_blocks, self.runner.num_host_blocks,
                                 store=self.store, mover=mover, groups=self.runner.kv_groups,
                                 max_chunk_tokens=config.scheduler.max_num_batched_tokens
                                 if config.scheduler.enable_chunked_prefill else None)
        self.scheduler = Scheduler(config.scheduler, self.tiers, self.loaded.eos_token_ids,
                                   speculative=config.speculative_config)
        self.hasher = BlockHasher.create(config.cache.block_size, self.runner.fingerprint, config.cache.cache_salt)
        self.adapters = Adapters(config.lora, self.loaded, self.hasher)
        self.stats = EngineStats()
        self._tracked: dict[str, Tracked] = {}
        self._families: dict[str, list[str]] = {}     # family id -> its samples' request ids (n > 1)
        self._ids = itertools.count()
        self._timelines = TimelineRecorder()
        self._handoffs: dict[str, HeldHandOff] = {}     # request id -> its held last output
        self.step_cost = StepCostModel()         # what a step costs here, learned from the steps run

    # ---- intake ---------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> list[int]:
        """Token ids of a chat rendered with the model's own template, ready for the reply."""
        return self.prompts.chat_prompt(messages, tools)

    def add_request(self, prompt: Prompt | Tokenized, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prediction: str | Sequence[int] | None = None, hand_off: bool = False,
                    lora: str | None = None) -> Request:
        """Tokenize, validate and queue a request; ValueError (nothing queued) if it cannot run.

        `params.max_tokens` None means as many as the context leaves after the prompt. With n or
        best_of above 1 the request is a family of samples `{request_id}/{index}` sharing one
        prefill (see SampleFamily); its outputs carry `request_id` and their `index`. Returns the
        request (a family's leader). `prediction` (OpenAI predicted outputs: the text or token ids
        the output is expected to be) is where its speculative drafts come from. `hand_off`: write
        the prompt's full blocks to the store for a decode engine before the last output goes out
        (see HandOff); needs a store and n == 1. `lora`: the name of a LoRA adapter to run under (None
        or the base model's name: none); a request waits, holding nothing, while every adapter slot is busy
        or its adapter is read again from disk (off this thread).
        """
        params = params or SamplingParams()
        if isinstance(prompt, Tokenized):
            assert prediction is None, "a Tokenized prompt carries its prediction"
            tokenized = prompt
        else:
            tokenized = self.prompts.tokenize(prompt, params.bad_words, prediction)
        token_ids = list(tokenized.prompt)
        params = self._resolved(params, token_ids)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        request_id = request_id or f"req-{next(self._ids)}"
        arrival = time.monotonic() if arrival_time is None else arrival_time
        num_samples = params.num_samples
        if hand_off:
            self._check_hand_off(num_samples)
        bad_words, predicted = tokenized.bad_words, tokenized.prediction
        adapter = self.adapters.resolve(lora)
        hasher = self.adapters.hasher_for(adapter)
        samples = [Request(request_id if num_samples == 1 else f"{request_id}/{index}", token_ids,
                           params.for_sample(index) if num_samples > 1 else params, hasher,
                           arrival_time=arrival, priority=priority, sample_index=index, bad_words_token_ids=bad_words,
                           num_lookahead_tokens=self._lookahead(params, predicted), prediction_token_ids=predicted,
                           adapter=adapter)
                   for index in range(num_samples)]
        if request_id in self._families or any(sample.request_id in self._tracked for sample in samples):
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_samples > 1:
            family = SampleFamily(request_id, samples)
            for sample in samples:
                sample.family = family
        self.scheduler.check(samples[0])
        try:
            admitted = self.adapters.admit(samples[0])
        except AdapterError as exc:
            raise RequestRejected(str(exc), "model") from exc
        if admitted:
            self.scheduler.add_request(samples[0])
        if num_samples > 1:
            self._families[request_id] = [sample.request_id for sample in samples]
        prompt_logprobs = [None] * len(token_ids) if params.prompt_logprobs is not None else None
        for sample in samples:
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
                                                 params.skip_special_tokens, params.spaces_between_special_tokens)
            self._tracked[sample.request_id] = Tracked(sample, detokenizer, request_id, params.logprobs is not None,
                                                        prompt_logprobs, RequestTimeline(arrival), hand_off=hand_off)
        return samples[0]

    def _check_hand_off(self, num_samples: int) -> None:
        if self.store is None:
            raise RequestRejected("this engine has no store to hand KV over through (--store)", "kv_transfer_params")
        if not self.config.cache.enable_prefix_caching:
            raise RequestRejected("handing KV over needs prefix caching on this engine", "kv_transfer_params")
        if num_samples > 1:
            raise RequestRejected("a handed-off request takes one sample (n and best_of 1)", "n")

    def _lookahead(self, params: SamplingParams, prediction: Sequence[int]) -> int:
        """Draft tokens a request verifies per step: with --speculative-config or a prediction."""
        spec = self.config.speculative_config
        if spec is None and not prediction:
            return 0
        return spec.num_speculative_tokens if spec is not None else PREDICTION_LOOKAHEAD

    def _resolved(self, params: SamplingParams, token_ids: list[int]) -> SamplingParams:
        """`params` checked against this model, with max_tokens resolved; RequestRejected if they cannot run."""
        num_prompt = min(len(token_ids), params.truncate_prompt_tokens or len(token_ids))
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, self.config.scheduler.max_model_len - num_prompt))
        params = params.validate()
        if params.structured is not None:
            compile_grammar(params.structured)     # a grammar the library rejects: RequestRejected, nothing queued
        if params.structured is not None and self.runner.sampler.grammars is None:
            raise RequestRejected("structured output needs the model's tokenizer, and this model has none",
                                  params.structured.param)
        if params.stop and self.tokenizer is None:
            raise RequestRejected("stop strings need the model's tokenizer, and this model has none (stop on "
                                  "token ids with stop_token_ids)", "stop")
        vocab = self.loaded.arch.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise RequestRejected(f"token ids must be in [0, {vocab})", "prompt")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(not 0 <= t < vocab for t in ids):
                raise RequestRejected(f"{name}: token ids must be in [0, {vocab})", name)
        return params

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.loaded.name, self.config.scheduler.max_model_len, self.loaded.arch.vocab_size,
                          self.config.cache.block_size, self.hasher.root, MappingProxyType(self.loaded.runs()),
                          self.config.lora.runtime_updating)

    def snapshot(self) -> EngineSnapshot:
        """The engine as of now, copied, for other threads (see kvstrata.engine.snapshots). Engine thread only."""
        counts = Counter(request.status for request in self.scheduler.requests.values())
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.scheduler.requests.values())
        requests = RequestCounts(counts[RequestStatus.RUNNING], counts[RequestStatus.LOADING],
                                 counts[RequestStatus.WAITING] + counts[RequestStatus.PREEMPTED]
                                 + len(self.adapters.parked))
        return EngineSnapshot(requests, len(self.scheduler.requests), queued,
                              MappingProxyType(self.tiers.counts()), copied(self.tiers.stats), copied(self.stats),
                              self.scheduler.num_preemptions,
                              None if self.store is None else MappingProxyType(self.store.stats().errors),
                              self.tiers.num_unpersisted,
                              sum(cache.unmapped_bytes for cache in self.runner.buffers.caches.values()))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._handoffs) or bool(self.adapters.parked)

    @property
    def has_work(self) -> bool:
        """Requests to serve, transfers to settle or handed-off outputs to release; step() until this is
        False to reach rest."""
        return self.scheduler.has_work or bool(self._handoffs) or bool(self.adapters.parked)

    def map_kv_pages(self, max_bytes: int) -> bool:
        """Map up to `max_bytes` of the device, then the host KV buffers' fresh pages (see
        `PagedKVCache.map_pages`), for an idle engine; False once all are mapped."""
        return any(cache.map_pages(max_bytes) for cache in self.runner.buffers.caches.values())

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        began = time.monotonic()            # the clock of arrivals and timelines
        output = None
        unparked = self._admit_parked()
        try:
            output = self.scheduler.schedule(self.step_cost.limiter(self.config.scheduler),
                                             self.step_cost.draft_break_even)
            self.stats.schedule_seconds += time.perf_counter() - started
            if output.is_empty:         # only transfers or adapter reads are running: do not spin
                self.tiers.wait_for_transfers(timeout=0.005)
                self.adapters.wait_for_reads(timeout=0.005)
            if self.faults is not None and not output.is_empty:
                self.faults.check("execute")
            executed = time.perf_counter()
            result = self.runner.execute(output, self.adapters.resident)
            self.stats.model_seconds += time.perf_counter() - executed
            self._timelines.step(self._timeline_of, output, self.scheduler, began, time.monotonic())
            before = {c.request.request_id: c.request.num_output_tokens for c in output.chunks if c.sample}
            finished = self.scheduler.update(output, result.token_ids, result.accepted)
            self.stats.count_drafts({c.request.request_id: len(c.draft_token_ids) for c in output.chunks
                                     if c.draft_token_ids}, result.accepted)
            outputs = self._outputs(before, result, finished)
            outputs = [out for out in outputs if out.request_id not in self._handoffs] + self._settled_handoffs()
        except Exception as exc:
            return unparked + self._recover(exc, output)
        self._account(output, result.accepted, started)
        return unparked + outputs

    def _admit_parked(self) -> list[RequestOutput]:
        """Requests that waited for an adapter slot enter the scheduler as slots free; those whose adapter
        could not be read again end with an error (they held nothing)."""
        if not self.adapters.parked:
            return []
        admitted, failed = self.adapters.admit_parked()
        for leader in admitted:
            self.scheduler.add_request(leader)
        for leader, exc in failed:
            logger.error("request %s ends with an error: %s", leader.request_id, exc)
            for sample in leader.samples:
                sample.status = RequestStatus.FINISHED_ERROR
        return self._final_outputs() if failed else []

    def _timeline_of(self, request_id: str) -> RequestTimeline | None:
        tracked = self._tracked.get(request_id)
        return tracked.timeline if tracked is not None else None

    def _recover(self, exc: Exception, output: SchedulerOutput | None) -> list[RequestOutput]:
        """End the failed step's requests with an error, release what they held, and prove it."""
        self.stats.step_failures += 1
        requests = [chunk.request for chunk in output.chunks] if output is not None else self.scheduler.in_step
        logger.error("engine step failed; ending its %d requests with an error: %r", len(requests), exc,
                     exc_info=exc)
        for request in dict.fromkeys(requests):
            if not request.is_finished:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ERROR)
        outputs = self._final_outputs()        # with the samples that ended with their leader
        try:
            self.scheduler.audit()
        except AssertionError as audit_error:
            self.stats.audit_failures += 1
            logger.critical("audit failed after recovering from a failed step: %s", audit_error)
            raise EngineDeadError(f"audit failed after a failed step ({exc!r}): {audit_error}") from audit_error
        return outputs

    def _outputs(self, before: dict[str, int], result: StepResult, finished: list[Request]) -> list[RequestOutput]:
        """Detokenize the tokens each request took this step (`before`: its outputs until then; a
        speculative step's accepted drafts come first), apply stop strings, and describe its progress."""
        done = {r.request_id for r in finished}
        for request_id, (first, entries) in result.prompt_logprobs.items():
            scored = self._tracked[request_id].prompt_logprobs
            scored[first:first + len(entries)] = entries
        outputs = []
        for request_id in result.token_ids:
            tracked = self._tracked[request_id]
            request = tracked.request
            new = request.token_ids[request.num_prompt_tokens + before.get(request_id, 0):]
            for index, token_id in enumerate(new):
                if tracked.detokenizer.add(token_id) is None:
                    continue
                if request_id in done:       # a stop string: "stop", even at the length limit
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
                    done.add(request_id)
                new = new[:index + 1]        # tokens a speculative step accepted after it were never generated
                request.truncate_output(before.get(request_id, 0) + len(new))
                break
            entries = result.logprobs.get(request_id, [])[:len(new)]      # one per token taken, in order
            tracked.logprobs += entries
            tracked.cumulative_logprob += sum(entry.logprob for entry in entries)
            outputs.append(self._output(tracked, new))
        return outputs

    def _output(self, tracked: Tracked, new_token_ids: list[int]) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        shown = tracked.logprobs if tracked.show_logprobs else []
        logprobs = shown[-len(new_token_ids):] if shown and new_token_ids else []
        first = not tracked.reported
        tracked.reported = True
        if finished:
            del self._tracked[request.request_id]
            self.adapters.release(request)
            self._timelines.forget(request.request_id)
            tracked.timeline.finished = time.monotonic()
            if tracked.family_id in self._families and not any(
                    rid in self._tracked for rid in self._families[tracked.family_id]):
                del self._families[tracked.family_id]
        output = RequestOutput(tracked.family_id, new_token_ids, tracked.detokenizer.delta(final=finished),
                               finished, request.status.finish_reason, request.num_prompt_tokens,
                               max(0, request.num_cached_tokens), request.num_output_tokens, logprobs,
                               request.first_scheduled_time, request.sample_index,
                               tracked.cumulative_logprob if tracked.logprobs else None,
                               list(request.prompt_token_ids) if first else None,
                               list(tracked.prompt_logprobs) if first and tracked.prompt_logprobs else None,
                               tracked.timeline if finished else None, request.num_draft_tokens,
                               request.num_accepted_tokens)
        if finished and tracked.hand_off and request.status in (RequestStatus.FINISHED_LENGTH,
                                                                RequestStatus.FINISHED_STOPPED):
            self._handoffs[request.request_id] = HeldHandOff(output, self.tiers.hand_off(request), time.monotonic())
        return output

    def _settled_handoffs(self) -> list[RequestOutput]:
        """The held last outputs whose requests' store writes have settled, with what reached the store."""
        settled = []
        for request_id, held in list(self._handoffs.items()):
            num_stored, pending = self.tiers.stored_run(held.hashes)
            if pending:
                continue
            del self._handoffs[request_id]
            settled.append(dataclasses.replace(held.output, kv_transfer=HandOff(
                tuple(held.hashes), num_stored, time.monotonic() - held.since)))
        return settled

    def _final_outputs(self) -> list[RequestOutput]:
        """The last output of every tracked request that has finished (each is reported once)."""
        return [self._output(tracked, []) for tracked in list(self._tracked.values()) if tracked.request.is_finished]

    def _account(self, output: SchedulerOutput, accepted: dict[str, int], started: float) -> None:
        seconds = time.perf_counter() - started
        self.stats.count_step(seconds)
        if not output.is_empty:
            self.step_cost.observe_step(output, seconds)
        self.stats.generated_tokens += sum(chunk.sample + len(chunk.forks) for chunk in output.chunks) \
            + sum(accepted.values())
        step_began = time.monotonic() - (time.perf_counter() - started)     # on the clock the server uses
        for request in (r for chunk in output.chunks for r in (chunk.request, *chunk.forks)):
            if request.first_scheduled_time is None:
                request.first_scheduled_time = step_began
        self.stats.prompt_tokens_computed += sum(
            max(0, min(chunk.start + chunk.num_tokens, chunk.request.num_prompt_tokens) - chunk.start)
            for chunk in output.chunks)
        if self.config.audit_every_step:
            try:
                self.scheduler.audit()
                self.adapters.audit()
            except AssertionError:
                self.stats.audit_failures += 1
                raise

    # ---- other transitions ----------------------------------------------------------------------
    def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request (every sample of a family) in any state and release its blocks; the final
        outputs of what was still running (none if the id is unknown or done)."""
        held = self._handoffs.pop(request_id, None)
        if held is not None:            # it had ended; only its answer was waiting for the store
            return [held.output]
        parked = self.adapters.unpark(request_id)
        for sample in () if parked is None else parked.samples:
            sample.status = RequestStatus.FINISHED_ABORTED
        for sample_id in self._families.get(request_id, [request_id]):
            self.scheduler.finish(sample_id)
        return self._final_outputs()

    def close(self, timeout: float = 5.0) -> None:
        """Abort what is left, write the cache to the store (`persist`), let transfers settle (up to
        `timeout` s in all), and close the store."""
        for request_id in list(self._tracked):
            self.abort(request_id)
        deadline = time.monotonic() + timeout
        while (self.tiers.persist() or self.tiers.has_transfers) and time.monotonic() < deadline:
            self.step()
        if self.tiers.num_unpersisted:
            logger.warning("%d cached blocks were not written to the store within %.0fs",
                           self.tiers.num_unpersisted, timeout)
        if self.store is not None:
            self.store.close()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one combined output per prompt and returned sample (n of them,
        the best by cumulative logprob when best_of > n), in prompt order, then index order. `lora`:
        one adapter name for every prompt, or one per prompt (None: the base model)."""
        params = params or SamplingParams()
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapter names for {len(prompts)} prompts")
        requests = [self.add_request(p, params, lora=name) for p, name in zip(prompts, adapters)]
        ids = [r.family.family_id if r.family is not None else r.request_id for r in requests]
        collected: dict[tuple[str, int], list[RequestOutput]] = {}
        while self.has_unfinished:
            for out in self.step():
                collected.setdefault((out.request_id, out.index), []).append(out)
        return [out for rid in ids for out in best_samples(
            [combine(collected[(rid, index)]) for index in range(params.num_samples)], params.n)]
