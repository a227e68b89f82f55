"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools

import msgspec
from tqdm import tqdm

from fulcrum.config import EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.engine.dp_cores import DataParallelCores
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import RequestOutput
from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.engine.request import check_request, fan_out
from fulcrum.engine.spec.stats import acceptance_rate, mean_accepted_length
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from fulcrum.utils.tokenizer import chat_prompt_ids, load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.config = EngineConfig(model=model, **engine_kwargs)
        # data parallel: that many engine cores, each in a process of its own, behind EngineCore's interface
        self.core = DataParallelCores(self.config) if self.config.data_parallel_size > 1 else EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.core.model_config.path)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop a parallel engine's worker processes now (they stop at exit otherwise)."""
        self.core.shutdown()

    # -- request intake ---------------------------------------------------------------------------

    def add_request(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> str:
        """Queue one prompt (its n samples become n engine requests sharing the prompt's blocks)."""
        rid = str(next(self._ids))
        params = check_request(prompt_ids, params, priority, self.core.max_model_len, self.core.vocab_size)
        children = fan_out(rid, params)
        for child_id, child_params in children:
            self.core.add_request(child_id, prompt_ids, child_params, priority)
        self.processor.add_request(rid, prompt, list(prompt_ids), params, [c for c, _ in children])
        return rid

    def abort(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort(request_id))

    # -- running ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[RequestOutput, dict[int, str]]]:
        """One engine step; returns the requests that progressed, with each sample's new text."""
        results, stop_now = self.processor.process(self.core.step())
        if stop_now:
            self.core.finish_requests(stop_now)
        return results

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        items = tokenize_prompts(prompts, self.tokenizer)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequestError("give one SamplingParams, or one per prompt", param="sampling_params")
        order: list[str] = []
        try:
            for i, ((p, ids), sp) in enumerate(zip(items, params)):
                order.append(self.add_request(p, ids, sp, priority[i] if priority else 0))
        except BaseException:
            for rid in order:  # a bad prompt further down the list leaves none of the earlier ones queued
                self.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm or len(order) < 2, unit="req")
        try:
            while len(done) < len(order):
                for ro, _ in self.step():
                    if ro.finished:
                        done[ro.request_id] = ro
                        bar.update(1)
        except BaseException:
            for rid in order:
                if rid not in done:
                    self.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        """Chat replies; without sampling_params as long as `fulcrum generate`'s (a 16-token reply is cut mid-sentence)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if sampling_params is None:
            sampling_params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.tokenizer, m)} for m in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """The engine's gauges and counters now (KV blocks, prefix cache, preemptions, queue; with speculative
        decoding its counters, their acceptance rate and mean accepted length, and the draft's KV blocks)."""
        s = msgspec.structs.asdict(self.core.stats())
        s["spec_acceptance_rate"] = acceptance_rate(s["spec_num_accepted_tokens"], s["spec_num_draft_tokens"])
        s["spec_mean_accepted_length"] = mean_accepted_length(s["spec_num_accepted_tokens"], s["spec_num_drafts"])
        return s
