"""The engine core: the step loop. schedule() -> model_runner.execute() -> scheduler.update().

It speaks token ids only, so it can run in a process of its own behind a small message protocol
(the server puts it there); the offline `LLM` drives it in-process.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from traceback import format_exception_only

import torch

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.kv_event_publisher import EventPublisher, KVEventsConfig, medium_of
from fulcrum.engine.kv_offload import KVOffload
from fulcrum.engine.kv_transfer import KVTransfer, KVTransferConfig
from fulcrum.engine.messages import SchedulerStats
from fulcrum.engine.model_runner import ModelRunner, ModelRunnerOutput, PendingStep
from fulcrum.engine.multimodal import ImageInput
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.engine.request import Request, RequestStatus
from fulcrum.engine.scheduler import Scheduler, SchedulerOutput
from fulcrum.engine.spec import SpecDecodeStats, SpeculativeConfig, make_proposer
from fulcrum.engine.spec.speculator import Speculator
from fulcrum.engine.structured import StructuredOutputs
from fulcrum.engine.structured.pending import PendingGrammars
from fulcrum.engine.workers import Workers
from fulcrum.errors import InvalidRequestError, WorkerDiedError, is_fatal
from fulcrum.model_folder.hf_config import layer_sliding_windows
from fulcrum.runtime import cpu_threads
from fulcrum.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def needs_every_token(req: Request) -> bool:
    """A request whose next step needs all its tokens on the host: its grammar's mask, its penalties' counts, or its
    prompt's scoring or pooling reads them (async scheduling runs such steps synchronously)."""
    return req.grammar is not None or req.sampling_params.penalized or req.wants_prompt_logprobs or req.pools


class EngineCore:
    def __init__(self, config: EngineConfig, own_process: bool = False):
        """`own_process`: the core runs in a process of its own beside a frontend (fulcrum serve): on CPU its
        threads are pinned, the frontend is left a core, and they compute below the frontend's priority
        (runtime/cpu_threads)."""
        # the niceness this process and its workers compute at, decided once here (the workers, processes of their
        # own, cannot tell a frontend's engine from a user's)
        config = replace(config, cpu_nice=cpu_threads.engine_nice(config.cpu_nice, own_process))
        self.config = config
        self.model_config = ModelConfig.from_engine(config)
        # speculative decoding: a draft model loads first, so that the target sizes the cache for both
        spec = SpeculativeConfig.parse(config.speculative_config, config.device)
        if spec and config.enable_lora:
            raise InvalidRequestError("speculative decoding with LoRA adapters is not supported yet", "enable_lora")
        if spec and self.model_config.task == "embed":
            raise InvalidRequestError("an embedding model generates nothing to speculate on", "speculative_config")
        proposer = make_proposer(spec, config, self.model_config) if spec else None
        draft = getattr(proposer, "runner", None)
        self.structured = StructuredOutputs(self.model_config.path, self.vocab_size, self.model_config.eos_token_ids)
        # a parallel engine: this process is rank 0 (scheduler, sampler, last pipeline stage), the workers the rest
        self.workers = Workers(config, self.model_config, exit_on_death=own_process) if config.world_size > 1 else None
        try:
            agree = self.workers.agree_blocks if self.workers else None
            self.runner = ModelRunner(
                config, self.model_config, own_process, draft=draft, agree_blocks=agree, structured=self.structured
            )
        except BaseException:
            self.shutdown()
            raise
        if draft is not None:
            proposer.attach(config.enable_prefix_caching)
        self.speculator = Speculator(spec, proposer, self.model_config.max_model_len) if spec else None
        # blocks fall out of the window only when they do for every layer (Gemma's global layers keep them all)
        windows = {a.sliding_window for a in self.runner.attn_layers}
        if self.workers is not None:  # this rank holds one pipeline stage's layers; the window is every layer's
            windows = set(layer_sliding_windows(self.model_config.hf_config))
        window = None if None in windows else max(windows)
        # KV-cache events (vLLM's kv_events_config): the cache records them, each step's go out on a ZMQ PUB socket
        events_cfg = KVEventsConfig.parse(config.kv_events_config)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, window,
            events_medium=medium_of(config.device) if events_cfg else None,
        )  # fmt: skip
        self.kv_events = EventPublisher(events_cfg) if events_cfg else None
        # P/D disaggregation: this engine offers finished prefills' blocks and/or pulls others' (engine/kv_transfer)
        transfer = KVTransferConfig.parse(config.kv_transfer_config)
        self.kv_transfer = KVTransfer(transfer, self.kv, self.runner, self.model_config.path) if transfer else None
        # offload tiers: blocks the pool lets go are kept in host memory and on disk, and come back as prefix hits
        self.kv_offload = None
        if config.kv_offloading_size or config.kv_offload_dir:
            if draft is not None:
                self.shutdown()
                raise InvalidRequestError(
                    "KV offload does not keep a draft model's cache: use ngram speculation or no offload",
                    "kv_offload_dir",
                )
            self.kv_offload = KVOffload(self.kv, self.runner, config, self.model_config)
            if self.kv_transfer is not None:  # a consumer that finds the blocks in its tiers pulls nothing
                self.kv_transfer.local_tiers = self.kv_offload.found_below
        for module in config.lora_modules or []:  # --lora-modules: a bad adapter stops the start, naming it
            try:
                self.add_lora(module["name"], module["path"])
            except BaseException:
                self.shutdown()
                raise
        on_finish = self.kv_transfer.on_finish if self.kv_transfer is not None else None
        self.scheduler = Scheduler(config, self.model_config.max_model_len, self.kv, on_finish=on_finish)
        if self.kv_offload is not None:
            self.scheduler.load_below = self.kv_offload.load_below
        self.compiling = PendingGrammars(self.structured)  # requests whose grammar compiles, out of the scheduler
        # async scheduling (config.async_scheduling): the launched step not yet read back, with its sampling requests
        self.in_flight: tuple[SchedulerOutput, list[str], PendingStep] | None = None
        self.async_scheduling = config.async_scheduling and not (self.speculator or self.workers or self.kv_transfer)
        if config.async_scheduling and not self.async_scheduling:
            log.info("async scheduling off: speculative decoding, P/D and parallel engines run synchronously")
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s)",
            self.kv.num_blocks,
            config.block_size,
            self.kv.num_blocks * config.block_size,
            self.runner.kv_cache_dtype_name,
        )

    def shutdown(self) -> None:
        """Stop a parallel engine's workers (and release this process's torch.distributed group), the grammar
        compiler's threads, the KV connector's threads and the KV-events publisher."""
        if getattr(self, "workers", None) is not None:
            self.workers.shutdown()
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        if getattr(self, "kv_transfer", None) is not None:
            self.kv_transfer.close()
        if getattr(self, "kv_offload", None) is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
            self.kv_events = None

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.hf_config.vocab_size

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        lora_name: str | None = None,
        images: ImageInput | None = None,
    ) -> None:
        """Queue one sample of a request the frontend has checked (engine/request.py: check_request).
        `kv_transfer_params`: vLLM's P/D handshake (engine/kv_transfer/transfer.py). `lora_name`: a loaded LoRA
        adapter it runs with (add_lora)."""
        if lora_name is not None:
            lora = self.runner.lora
            if lora is None:
                raise InvalidRequestError(f"adapter {lora_name!r}: this engine serves no LoRA adapters (enable_lora)",
                                          "model")  # fmt: skip
            if lora_name not in lora:
                raise InvalidRequestError(f"no LoRA adapter named {lora_name!r} is loaded", "model")
        req = Request(request_id, list(prompt_token_ids), params, list(self.model_config.eos_token_ids), priority)
        req.kv_transfer_params = kv_transfer_params
        req.lora_name = lora_name
        if images is not None:
            req.mm = self.runner.prepare_images(prompt_token_ids, images)
        if arrival_time:
            req.arrival_time = arrival_time
        if params.structured_outputs is not None:
            self.compiling.add(req)
        else:
            self._route(req)

    def _route(self, req: Request) -> None:
        """A request ready to run: it pulls a remote prefill's blocks, or loads its prefix from the offload tiers,
        or goes to the scheduler."""
        if self.kv_offload is not None:
            self.kv_offload.flush()  # a pull writes blocks that may be freed ones not yet copied out
        if self.kv_transfer is not None and self.kv_transfer.add(req):
            return
        if self.kv_offload is not None and self.kv_offload.add(req):
            return
        self.scheduler.add_request(req)

    # -- LoRA adapters --------------------------------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter (PEFT's layout) under `name`; a bad one raises LoRAError, and nothing changes."""
        if self.runner.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters: start it with enable_lora", "lora_name")
        self.runner.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; refused while a request that names it is queued or running."""
        if self.runner.lora is None or name not in self.runner.lora:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        users = [r.request_id for r in self._all_requests() if r.lora_name == name]
        if users:
            raise InvalidRequestError(
                f"adapter {name!r} has {len(users)} request(s) queued or running; unload it once they finish",
                "lora_name",
            )
        self.runner.lora.remove(name)

    def list_loras(self) -> list[str]:
        return self.runner.lora.names() if self.runner.lora is not None else []

    def lora(self, op: str, name: str = "", path: str = "") -> list[str]:
        """A LoRA call, as the engine-core protocol carries it (messages.LoRACall): "load", "unload" or "list";
        the adapters loaded after it."""
        if op == "load":
            self.add_lora(name, path)
        elif op == "unload":
            self.remove_lora(name)
        elif op != "list":
            raise InvalidRequestError(f"unknown LoRA call {op!r}")
        return self.list_loras()

    def _all_requests(self) -> list[Request]:
        reqs = list(self.scheduler.requests.values()) + list(self.compiling.requests())
        if self.kv_transfer is not None:
            reqs += self.kv_transfer.requests()
        if self.kv_offload is not None:
            reqs += self.kv_offload.requests()
        return reqs

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        done = self.compiling.drop(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.kv_transfer is not None:
            done += self.kv_transfer.abort(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.kv_offload is not None:
            done += self.kv_offload.abort(request_ids, RequestStatus.FINISHED_ABORTED)
        done += self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._release_drafts()
        return [self._output(r, []) for r in done]

    def finish_requests(self, request_ids: list[str], stop_reason: str | None = None) -> None:
        """A stop string matched in the frontend: the request is done, free its blocks now."""
        self.compiling.drop(request_ids, RequestStatus.FINISHED_STOPPED)
        for r in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED):
            r.stop_reason = stop_reason
        self._release_drafts()

    def has_unfinished_requests(self) -> bool:
        busy = self.kv_transfer is not None and self.kv_transfer.busy()
        busy = busy or (self.kv_offload is not None and self.kv_offload.busy())
        return self.scheduler.has_unfinished() or bool(self.compiling) or busy or self.in_flight is not None

    def housekeeping(self) -> None:
        """What goes on between steps, idle ones too: KV pulls and disk reads that ended join the scheduler, leases
        end, freed blocks are copied out to the offload tiers."""
        if self.kv_transfer is not None:
            for req in self.kv_transfer.poll():
                self.scheduler.add_request(req)
        if self.kv_offload is not None:
            for req in self.kv_offload.poll():
                self.scheduler.add_request(req)
            self.kv_offload.flush()  # on idle ticks too: what the last requests freed reaches disk now

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready join the scheduler (or first pull a remote prefill's blocks); those whose
        grammar failed end with the compiler's message."""
        ready, failed = self.compiling.take()
        for req in ready:
            self._route(req)
        return [self._output(req, []) for req in failed]

    def step(self) -> list[EngineCoreOutput]:
        failed = self._admit_compiled() if self.compiling else []
        self.housekeeping()
        if self.async_scheduling:
            return failed + self._step_async()
        return failed + self._step_sync()

    def _step_sync(self) -> list[EngineCoreOutput]:
        sched = self._schedule()
        if not sched.scheduled:
            self._wait_idle()
            return []
        return self._execute(sched)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if self.kv_transfer is not None:
            self.kv_transfer.after_schedule(self.scheduler.requests)
        if self.kv_offload is not None:
            self.kv_offload.after_schedule(self.scheduler.requests)
            self.kv_offload.flush()  # the step may overwrite freed blocks: copy out those no tier holds yet
        return sched

    def _wait_idle(self) -> None:
        if self.compiling:  # nothing to run until a compile ends: wait for it, do not spin
            self.compiling.wait(0.05)
        elif self.kv_transfer is not None and self.kv_transfer.busy():  # the same for KV pulls
            self.kv_transfer.wait(0.05)
        elif self.kv_offload is not None and self.kv_offload.busy():  # and for reads from the disk tier
            self.kv_offload.wait(0.05)

    def _execute(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Run a scheduled step and take its tokens, synchronously; a step that fails is retried request by request
        (those that fail alone end with an error)."""
        failed = []
        generators = self._generator_states(sched)
        try:
            if self.workers is not None:
                self.workers.check()
            result = self.runner.execute(sched)
        except Exception as e:
            if self.workers is not None:  # the ranks may disagree on where they are: none can go on
                self.workers.check()
                raise WorkerDiedError(f"a rank of the parallel engine failed: {type(e).__name__}: {e}") from e
            if is_fatal(e):
                raise
            log.warning("a step of %d requests failed (%s); running them one by one", len(sched.scheduled), e)
            self._restore_generators(generators)
            result, failed_now = self._execute_one_by_one(sched)
            failed += failed_now
        for rid, entries in result.prompt_logprobs.items():
            self.scheduler.requests[rid].prompt_logprobs.extend(entries)
        if self.speculator is not None:
            self.speculator.observe(sched, result)
        before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        finished = {r.request_id for r in self.scheduler.update(sched, result.sampled)}
        outputs = failed + self._outputs(sched, result, set(result.sampled), finished, before)
        if self.speculator is not None:
            self.speculator.propose(sched, result, self.scheduler.requests, len(self.scheduler.running))
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())
        return outputs

    def _outputs(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, taken: set[str], finished: set[str], before: dict
    ) -> list[EngineCoreOutput]:
        """One output per request whose tokens this step took (`taken`) or that finished in it."""
        outputs = []
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if rid not in taken and rid not in finished:
                continue  # a prefill chunk that did not reach the end of the prompt, or a token dropped
            # the tokens taken: with speculation several, fewer than sampled when a stop came first
            new = req.output_token_ids[before[rid] :]
            if req.status == RequestStatus.FINISHED_ERROR:
                new = []  # the token that failed it was not taken
            logprobs = result.logprobs.get(rid)
            outputs.append(self._output(req, new, logprobs[: len(new)] if logprobs else logprobs))
        return outputs

    # -- async scheduling ---------------------------------------------------------------------------

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then read back the one in flight (its tokens become the next step's
        inputs on the device), so that the host's scheduling, input building and launches overlap the device's
        work. Steps that need every token on the host first (grammars, penalties, prompt logprobs) drain the step
        in flight and run synchronously."""
        if not self._can_overlap():
            return self._drain() + self._step_sync()
        sched = self._schedule()
        if not sched.scheduled:
            outputs = self._drain()
            if not outputs:
                self._wait_idle()
            return outputs
        prev = self.in_flight
        generators = self._generator_states(sched)
        try:
            pending = self.runner.launch(sched, prev[2] if prev else None)
        except Exception as e:
            if is_fatal(e):
                raise
            # the step in flight first; then this one, whose in-flight tokens are known by then, as a synchronous
            # step (retried request by request), less the requests that step finished
            self._restore_generators(generators)
            log.warning("an async step of %d requests failed (%s); running it synchronously", len(sched.scheduled), e)
            outputs = self._drain()
            sched.scheduled = [s for s in sched.scheduled if not s.request.status.finished]
            return outputs + (self._execute(sched) if sched.scheduled else [])
        self.in_flight = (sched, self.scheduler.advance(sched), pending)
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())
        return self._complete(prev) if prev else []

    def _complete(self, in_flight: tuple[SchedulerOutput, list[str], PendingStep]) -> list[EngineCoreOutput]:
        """A launched step's tokens read back and taken (waits for the device)."""
        sched, sampling, pending = in_flight
        result = pending.result()
        live = [s for s in sched.scheduled if not s.request.status.finished]
        before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        finished = {r.request_id for r in self.scheduler.resolve(sched, sampling, result.sampled)}
        taken = {s.request.request_id for s in live} & set(sampling)
        return self._outputs(sched, result, taken, finished, before)

    def _drain(self) -> list[EngineCoreOutput]:
        """Complete the step in flight, if any."""
        if self.in_flight is None:
            return []
        in_flight, self.in_flight = self.in_flight, None
        return self._complete(in_flight)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the tokens in flight are known: not when a request's
        sampling reads its own output so far (a grammar, penalties) or its prompt is scored."""
        reqs = itertools.chain(self.scheduler.running, self.scheduler.waiting)
        return not any(needs_every_token(r) for r in reqs)

    def _release_drafts(self) -> None:
        if self.speculator is not None:
            self.speculator.release(self.scheduler.requests)

    def _execute_one_by_one(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, list[EngineCoreOutput]]:
        """After a failed step, find the request(s) that make it fail: each runs alone, those that still
        fail end with an error (their blocks freed), the rest keep the progress of this step.
        A request only writes the KV slots of its own blocks, so a failed forward corrupts no one else's."""
        merged, failed = ModelRunnerOutput(), []
        for s in list(sched.scheduled):
            try:
                alone = self.runner.execute(SchedulerOutput([s]))
            except Exception as e:
                if is_fatal(e):
                    raise
                req = s.request
                log.error("request %s failed and was ended: %s", req.request_id, "".join(format_exception_only(e)))
                sched.scheduled.remove(s)
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
                req.error = f"the engine failed on this request: {type(e).__name__}: {e}"
                failed.append(self._output(req, []))
                continue
            merged.sampled.update(alone.sampled)
            merged.logprobs.update(alone.logprobs)
            merged.prompt_logprobs.update(alone.prompt_logprobs)
        return merged, failed

    @staticmethod
    def _generator_states(sched: SchedulerOutput) -> list[tuple[torch.Generator, torch.Tensor]]:
        """Seeded requests' RNG states before a step, so that a retried step draws the same noise."""
        gens = [s.request.generator for s in sched.scheduled if s.request.generator is not None]
        return [(g, g.get_state()) for g in gens]

    @staticmethod
    def _restore_generators(states) -> None:
        for g, state in states:
            g.set_state(state)

    @staticmethod
    def _output(req: Request, new: list[int], logprobs=None) -> EngineCoreOutput:
        prompt_logprobs = None
        if req.wants_prompt_logprobs and not req.prompt_logprobs_sent:
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            error=req.error,
            error_status=req.error_status,
            kv_transfer_params=req.kv_transfer_params if req.status.finished else None,
            embedding=req.embedding,
        )

    def stats(self, step_time: float = 0.0) -> SchedulerStats:
        """What the engine holds now, for the server's gauges and `LLM.stats()` alike."""
        kv = self.kv.stats()
        draft = self.speculator.proposer.stats() if self.speculator is not None else None
        spec = self.speculator.stats if self.speculator is not None else SpecDecodeStats()
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_blocks - kv.num_used_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            step_time=step_time,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
            draft_num_blocks=draft.num_blocks if draft else 0,
            draft_num_free_blocks=draft.num_blocks - draft.num_used_blocks if draft else 0,
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
            **(self._offload_stats() if self.kv_offload is not None else {}),
            **(self._lora_stats() if self.runner.lora is not None else {}),
        )

    def _lora_stats(self) -> dict:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for counts, reqs in ((running, self.scheduler.running), (waiting, self.scheduler.waiting)):
            for r in reqs:
                if r.lora_name is not None:
                    counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        lora = self.runner.lora
        return dict(lora_running=running, lora_waiting=waiting, lora_loads=lora.loads, lora_evictions=lora.evictions)

    def _offload_stats(self) -> dict:
        counts, latency = self.kv_offload.stats()
        return dict(kv_offload=counts, kv_offload_latency=latency)
