"""The engine core: the step loop. schedule() -> model_runner.execute() -> scheduler.update().

It speaks token ids only, so it can run in a process of its own behind a small message protocol
(the server puts it there); the offline `LLM` drives it in-process.
"""

from __future__ import annotations

import logging

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine.kv_cache import KVCacheManager, KVCacheStats
from fulcrum.engine.model_runner import ModelRunner
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.engine.request import Request, RequestStatus, validate_request
from fulcrum.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_path(config.model, config.dtype, config.max_model_len)
        self.runner = ModelRunner(config, self.model_config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.model_config.max_model_len,
                block_size=config.block_size,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv,
        )
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens)",
            self.kv.num_blocks,
            config.block_size,
            self.kv.num_blocks * config.block_size,
        )

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def add_request(self, req: Request) -> None:
        validate_request(req, self.max_model_len, self.model_config.hf_config.vocab_size)
        if not req.eos_token_ids:
            req.eos_token_ids = list(self.model_config.eos_token_ids)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self._output(r, []) for r in done]

    def finish_requests(self, request_ids: list[str], stop_reason: str | None = None) -> None:
        """A stop string matched in the frontend: the request is done, free its blocks now."""
        for r in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED):
            r.stop_reason = stop_reason

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        result = self.runner.execute(sched)
        finished = {r.request_id for r in self.scheduler.update(sched, result.sampled)}
        outputs = []
        for s in sched.scheduled:
            req = s.request
            new = result.sampled.get(req.request_id)
            if not new and req.request_id not in finished:
                continue  # a prefill chunk that did not reach the end of the prompt
            outputs.append(self._output(req, new or [], result.logprobs.get(req.request_id)))
        return outputs

    @staticmethod
    def _output(req: Request, new: list[int], logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
        )

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
