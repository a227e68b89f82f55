"""Frontend side of the engine: turns token-id outputs into text, applies stop strings, and
assembles RequestOutputs (n samples of one prompt gathered under one request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from fulcrum.engine.detokenizer import IncrementalDetokenizer
from fulcrum.engine.outputs import CompletionOutput, EngineCoreOutput, RequestMetrics, RequestOutput
from fulcrum.sampling_params import SamplingParams


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer
    out: CompletionOutput


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child] = field(default_factory=dict)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None  # None for the first prompt token, then one entry per token
    kv_transfer_params: dict | None = None  # from a KV producer, once finished
    embedding: list[float] | None = None  # an embedding request's vector


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, child_ids: list[str]
    ) -> None:
        parent = _Parent(request_id, prompt, prompt_ids, params)
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output,
                params.min_tokens,
            )  # fmt: skip
            lp = [] if params.logprobs is not None else None
            parent.children[cid] = _Child(i, detok, CompletionOutput(index=i, logprobs=lp))
            self.child_to_parent[cid] = request_id
        self.parents[request_id] = parent

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[tuple[RequestOutput, dict[int, str]]], list[str]]:
        """Returns (updated parents with the text delta of each changed child, children to stop
        because a stop string matched)."""
        updated: dict[str, dict[int, str]] = {}
        stop_now: list[str] = []
        for o in outputs:
            pid = self.child_to_parent.get(o.request_id)
            if pid is None:  # finished here already (a stop string, an abort): what came after is not output
                o.new_token_ids = []
                continue
            parent = self.parents[pid]
            child = parent.children[o.request_id]
            out = child.out
            if out.finished:  # a stop string ended it here already: what the engine made after is not output
                o.new_token_ids = []
                continue
            if o.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *o.prompt_logprobs]  # every sample scores the same prompt
            new_ids = o.new_token_ids
            text_ids = new_ids
            eos_finish = o.finish_reason == "stop" and o.stop_reason is None
            if eos_finish and text_ids:
                text_ids = text_ids[:-1]  # the eos token itself is not part of the text
            matched = child.detok.add_tokens(text_ids)
            if matched is not None:
                # several tokens in one step (speculation): those after the one that completed the stop string are
                # dropped, so ids, logprobs and usage are what one token per step gives
                new_ids = new_ids[: child.detok.taken]
                o.new_token_ids = new_ids  # what the server's token counters see too
            out.token_ids.extend(new_ids)
            if o.new_logprobs and out.logprobs is not None:
                out.logprobs.extend(o.new_logprobs[: len(new_ids)])
            if matched is not None:
                out.finish_reason, out.stop_reason = "stop", matched
                if o.finish_reason is None:
                    stop_now.append(o.request_id)
            elif o.finish_reason is not None:
                child.detok.flush()
                out.finish_reason, out.stop_reason, out.error = o.finish_reason, o.stop_reason, o.error
                out.error_status = o.error_status
            out.text = child.detok.output_text
            self._merge_metrics(parent, o)
            if o.kv_transfer_params is not None:
                parent.kv_transfer_params = o.kv_transfer_params
            if o.embedding is not None:
                parent.embedding = o.embedding
            updated.setdefault(pid, {})[child.index] = child.detok.take_delta(out.finished)
        results = []
        for pid, deltas in updated.items():
            parent = self.parents[pid]
            done = all(c.out.finished for c in parent.children.values())
            ro = RequestOutput(
                request_id=pid,
                prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids,
                outputs=[c.out for c in sorted(parent.children.values(), key=lambda c: c.index)],
                finished=done,
                metrics=parent.metrics,
                prompt_logprobs=parent.prompt_logprobs,
                kv_transfer_params=parent.kv_transfer_params,
                embedding=parent.embedding,
            )
            results.append((ro, deltas))
            if done:
                self._drop(pid)
        return results, stop_now

    @staticmethod
    def _merge_metrics(parent: _Parent, o: EngineCoreOutput) -> None:
        m = parent.metrics
        if m is None:
            m = parent.metrics = RequestMetrics(arrival_time=o.arrival_time, num_cached_tokens=o.num_cached_tokens)
        if o.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = o.first_scheduled_time
        if o.first_token_time is not None:
            m.first_token_time = min(m.first_token_time or o.first_token_time, o.first_token_time)
        if o.finish_time is not None:
            m.finish_time = max(m.finish_time or 0.0, o.finish_time)

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent; returns its children's ids, for the core to abort."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._drop(request_id)
        return list(parent.children)

    def _drop(self, pid: str) -> None:
        parent = self.parents.pop(pid)
        for cid in parent.children:
            self.child_to_parent.pop(cid, None)
