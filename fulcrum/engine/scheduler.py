"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Running requests are served first (usually one decode token each, or the next chunk of a long prompt), then waiting
requests are admitted in priority/arrival order with whatever budget is left, so a long prompt never stalls the
decodes. No prefill/decode distinction in the data: a request has `num_tokens - num_computed_tokens` to compute."""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from fulcrum.config import EngineConfig
from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens to compute, then the proposals to verify
    block_table: list[int]
    # speculative decoding: the proposals this step verifies (the last len() of num_new_tokens), and the draft
    # distribution they were drawn from (a [len, vocab] tensor) or None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: object = None

    @property
    def samples_next_token(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a next token is sampled."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        req = self.request
        if getattr(req, "pools", False):  # an embedding request pools its prompt instead
            return False
        return req.num_computed_tokens + known == req.num_tokens + getattr(req, "num_placeholders", 0)

    @property
    def pools_last_chunk(self) -> bool:
        """An embedding request whose prompt this step finishes: its vector is complete after it."""
        req = self.request
        return getattr(req, "pools", False) and req.num_computed_tokens + self.num_new_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class WaitingQueue:
    """Priority queue: lower `priority` first, then arrival order (FCFS). Preempted requests
    go back in with their original place."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._tiebreak), req))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in self._heap)


class Scheduler:
    def __init__(self, config: EngineConfig, max_model_len: int, kv: KVCacheManager, on_finish=None):
        self.config = config
        self.max_model_len = max_model_len
        # without chunking a whole prompt must fit one step, so the step budget grows to the context length
        self.token_budget = (
            config.max_num_batched_tokens
            if config.enable_chunked_prefill
            else max(config.max_num_batched_tokens, max_model_len)
        )
        self.kv = kv
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # called with (request, status) as a request finishes, before its blocks are freed: a KV producer hands
        # the prompt's blocks over to a lease there (engine/kv_transfer)
        self.on_finish = on_finish
        # (request, its pool hits) -> its hits extended from the KV offload tiers, copied in (engine/kv_offload)
        self.load_below = None

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> SchedulerOutput:
        """The step's requests and token counts. With speculative decoding a request's proposals ride after its known
        tokens, verified in the same step, and are dropped first when the budget or the cache is short. When the KV
        cache runs out, the lowest-priority, latest-arrived running request is preempted: its blocks are freed and it
        is recomputed later."""
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled: list[ScheduledRequest] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_placeholders and self._at_length_limit(req, req.num_placeholders):
                i += 1  # its last token is being sampled now: nothing more to compute
                continue
            known = req.num_tokens + req.num_placeholders - req.num_computed_tokens
            # proposals ride along only when every known token fits the budget, and as many as fit
            spec, probs = req.spec_token_ids, req.spec_token_probs
            req.spec_token_ids, req.spec_token_probs = [], None
            n = min(known + len(spec), budget)
            spec = spec[: max(n - known, 0)]
            self.kv.release_out_of_window(req)
            while not self.kv.allocate_slots(req, n):
                if spec:  # proposals are optional: they go before anyone is preempted for their slots
                    n, spec = n - len(spec), []
                    continue
                # only requests not yet scheduled in this step may be preempted
                victim = max(self.running[i:], key=lambda r: (r.priority, r.arrival_time))
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                probs = probs[: len(spec)] if spec and probs is not None else None
                scheduled.append(ScheduledRequest(req, n, [], spec, probs))
                budget -= n
                i += 1

        # admit waiting requests, unless this step already had to preempt; a request whose LoRA adapter would be one
        # more than a step may hold waits (set aside, keeping its place) while those behind it go on
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        max_loras = self.config.max_loras if getattr(self.config, "enable_lora", False) else 0
        set_aside: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting.peek()
            if req.lora_name is not None and req.lora_name not in adapters and len(adapters) >= max_loras:
                set_aside.append(self.waiting.pop())
                continue
            # prompt logprobs need the logits of every prompt position, and pooling every position's hidden state:
            # such a prompt is computed, not looked up
            skip_cache = req.num_computed_tokens or req.wants_prompt_logprobs or req.pools
            computed, num_cached = ([], 0) if skip_cache else self.kv.get_computed_blocks(req)
            if self.load_below is not None and not skip_cache:
                computed = self.load_below(req, computed)
                num_cached = len(computed) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.config.enable_chunked_prefill and n < req.num_tokens - num_cached:
                break  # the whole prompt waits for a step with room for it
            if not self.kv.allocate_slots(req, n, computed):
                break
            self.waiting.pop()
            if req.status == RequestStatus.WAITING:  # first admission, not a resumption after preemption
                req.num_cached_tokens = num_cached
                if self.kv.enable_prefix_caching and not (req.wants_prompt_logprobs or req.pools):
                    self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n, []))
            budget -= n
            if req.lora_name is not None:
                adapters.add(req.lora_name)
        for req in set_aside:
            self.waiting.push(req)

        for s in scheduled:
            s.block_table = self.kv.block_table(s.request.request_id)
        out.scheduled = scheduled
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_token_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)

    def _at_length_limit(self, req: Request, ahead: int = 0) -> bool:
        """Whether the request reaches max_tokens or the context limit with `ahead` more tokens (its tokens in
        flight, under async scheduling: a stop token cannot be foreseen, a length can)."""
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and req.num_output_tokens + ahead >= max_tokens:
            return True
        return req.num_tokens + ahead >= self.max_model_len

    def advance(self, out: SchedulerOutput) -> list[str]:
        """Async scheduling, once a step is launched: its requests move past its tokens now, and each that samples
        holds a placeholder for its token, so the next step can be scheduled before this one's results are back.
        Returns the ids of the requests that sample (what `resolve` takes back)."""
        sampling = []
        for s in out.scheduled:
            req = s.request
            if s.samples_next_token:
                sampling.append(req.request_id)
                req.num_placeholders += 1
            req.num_computed_tokens += s.num_new_tokens
        return sampling

    def resolve(self, out: SchedulerOutput, sampling: list[str], sampled: dict[str, list[int]]) -> list[Request]:
        """Async scheduling: a launched step's results are back. Each placeholder becomes its token, checked for a
        stop; a request that ended meanwhile (a stop in the step before, a stop string, an abort) drops it. Returns
        the requests that finished."""
        finished, now = [], time.time()
        wanted = set(sampling)
        for s in out.scheduled:
            req = s.request
            if req.request_id not in wanted:
                continue
            req.num_placeholders -= 1
            if req.status.finished:
                continue
            if self._take_tokens(req, sampled.get(req.request_id, []), now):
                finished.append(req)
        return finished

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance the scheduled requests by what was computed and append the sampled tokens (with speculation
        several: the accepted proposals, then one the target drew). Each is checked for a stop in turn, so a
        request that stops at the first never takes the rest. Returns the requests that finished in this step
        (their blocks are already freed)."""
        finished = []
        now = time.time()
        for s in out.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id, [])
            # The KV of the accepted proposals is valid; that of the rejected ones lies past num_computed_tokens, in
            # slots the tokens that take their place overwrite (the request keeps those blocks, none leaks).
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids) + max(len(tokens) - 1, 0)
            if req.pools:
                if req.embedding is not None:  # its prompt is pooled: done
                    req.first_token_time = now
                    self._finish(req, RequestStatus.FINISHED_STOPPED, now)
                    finished.append(req)
                continue
            if self._take_tokens(req, tokens, now):
                finished.append(req)
        return finished

    def _take_tokens(self, req: Request, tokens: list[int], now: float) -> bool:
        """Append sampled tokens in turn, each checked for a stop; True when the request finished."""
        for tok in tokens:
            if req.grammar is not None and not req.grammar.accept(tok):
                # the sampler masks what the grammar forbids, so this is the engine's fault, not the client's
                req.error = f"token {tok} broke the request's grammar"
                self._finish(req, RequestStatus.FINISHED_ERROR, now)
                return True
            req.append_output_token(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, tok)
            if status is not None:
                self._finish(req, status, now)
                return True
        return False

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Stop requests from outside the step loop (abort, or a stop string found by the detokenizer)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status, time.time(), already_removed=True)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus, now: float, already_removed: bool = False) -> None:
        if not already_removed:
            if req in self.running:
                self.running.remove(req)
            else:  # async scheduling: preempted while its last token was in flight
                self.waiting.remove(req)
        if self.on_finish is not None:
            self.on_finish(req, status)
        self.kv.free(req)
        req.spec_token_ids, req.spec_token_probs = [], None
        req.status = status
        req.finish_time = now
        del self.requests[req.request_id]
