"""The server's frontend to the engine: checks requests, sends them to the engine-core processes (through
engine/core_client.py), detokenizes and streams outputs back per request, and ends them all if a core dies."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from fulcrum.config import EngineConfig, ModelConfig, model_path
from fulcrum.engine.core_client import AsyncCoreClient
from fulcrum.engine.kv_transfer import KVTransferConfig, KVTransferError, check_remote_prefill
from fulcrum.engine.messages import AddRequest, CoreReady
from fulcrum.engine.multimodal import ImageInput, ImagePrompts
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import RequestOutput
from fulcrum.engine.request import check_request, check_task, fan_out
from fulcrum.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024):
        self.config = config
        self._image_prompts: ImagePrompts | None = None  # built at the first request with images
        self.kv_trust = KVTransferConfig.parse(config.kv_transfer_config)  # which producers a consumer may contact
        self.model_path = model_path(config.model)  # the rest of the model's facts come in the core's ready message
        self.tokenizer = load_tokenizer(self.model_path)
        self.processor = OutputProcessor(self.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.queues: dict[str, asyncio.Queue] = {}
        self.client: AsyncCoreClient | None = None  # the engine-core processes, from start()
        self.ready: CoreReady | None = None
        self.dead = False
        self.stat_loggers: list = []  # objects with record(core_outputs: CoreOutputs, now: float)
        self.on_dead: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> CoreReady:
        """Start the engine core(s): one process each (data parallel: `data_parallel_size` of them, each with its
        own KV cache and a share of the cores), and wait until all are ready."""
        self.client = AsyncCoreClient(self.config)
        self.ready = await self.client.start()  # one model's limits, the cache of every core together
        self._loop_task = asyncio.create_task(self._output_loop())
        return self.ready

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.client is not None:
            await self.client.shutdown()

    @property
    def healthy(self) -> bool:
        return not self.dead and self.client is not None and self.client.alive

    # -- requests ---------------------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests not yet running: the core's last count, plus those it has not reported yet."""
        in_flight = len(self.processor.child_to_parent)
        stats = self.client.latest_stats
        return max(stats.num_waiting, in_flight - stats.num_running)

    def image_prompts(self, field: str) -> ImagePrompts:
        """What turns a prompt's images into its expanded ids and ImageInput; a 400 naming `field` for a model
        that takes no images."""
        if self._image_prompts is None:
            model_config = ModelConfig.from_engine(self.config)
            if model_config.multimodal_config is None:
                raise InvalidRequestError(f"{field}: model {model_config.path.name} takes no image input", field)
            self._image_prompts = ImagePrompts(model_config, self.tokenizer)
        return self._image_prompts

    async def generate(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
        lora_name: str | None = None,
        arrival_time: float | None = None,
        images: ImageInput | None = None,
    ) -> AsyncIterator[tuple[RequestOutput, dict[int, str]]]:
        """Stream (output so far, new text per sample) once per engine step until finished.
        Leaving the iteration early (client gone) aborts the request and frees its blocks.
        `kv_transfer_params`: vLLM's P/D handshake, checked here (engine/kv_transfer/config.py).
        `arrival_time` (time.time()): when the request arrived (the server's HTTP arrival), where its TTFT, end-to-end
        and queue clocks start; now when not given."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        rid = request_id or f"req-{next(self._ids)}"
        now = arrival_time or time.time()
        check_task(params, self.ready.task)
        params = check_request(prompt_ids, params, priority, self.ready.max_model_len, self.ready.vocab_size)
        if kv_transfer_params is not None:
            check_kv_transfer(kv_transfer_params, self.ready.kv_transfer, prompt_ids, params, self.kv_trust)
        samples = [
            AddRequest(cid, prompt_ids, cp, priority, now, kv_transfer_params, lora_name, images)
            for cid, cp in fan_out(rid, params)
        ]
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self.processor.add_request(rid, prompt, list(prompt_ids), params, [s.request_id for s in samples])
        finished = False
        try:
            self.client.add_requests(samples)  # together, to one core
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                item = _coalesce(item, queue)
                ro = item[0]
                finished = ro.finished
                failed = next((o for o in ro.outputs if o.finish_reason == "error"), None)
                if failed is not None:
                    if failed.error_status == 400:  # the request's own fault: its grammar cannot be compiled
                        error: Exception = InvalidRequestError(failed.error)
                    else:
                        error = RequestFailedError(failed.error or "the engine failed on this request")
                    # text of steps before the failure, read together with it (the frontend behind a fast engine):
                    # sent first, so a stream has them before its error event as when it keeps up
                    if any(item[1].values()):
                        yield _before_failure(item)
                    raise error
                yield item
                if finished:
                    return
        finally:
            # every path, an exception between registering and sending included, releases what it holds
            self.queues.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def encode(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[RequestOutput]:
        """Embedding requests (`params.pooling`), one per prompt, sent to the core in one message so that they are
        scheduled together (one step when they fit its budget); their finished outputs, in order. Leaving early (the
        client gone) aborts those not finished. `arrival_time`: as generate's."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if self.num_waiting() + len(prompts) > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the waiting queue cannot take {len(prompts)} more requests ({self.max_waiting_requests} at most)"
            )
        check_task(params, self.ready.task)
        checked = [check_request(ids, params, priority, self.ready.max_model_len, self.ready.vocab_size)
                   for _, ids in prompts]  # fmt: skip
        base, now = f"emb-{next(self._ids)}", arrival_time or time.time()
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        queue: asyncio.Queue = asyncio.Queue()
        samples = []
        for rid, (text, ids), sp in zip(rids, prompts, checked):
            self.queues[rid] = queue
            child = fan_out(rid, sp)[0][0]
            self.processor.add_request(rid, text, list(ids), sp, [child])
            samples.append(AddRequest(child, list(ids), sp, priority, now))
        done: dict[str, RequestOutput] = {}
        try:
            self.client.add_requests(samples)
            while len(done) < len(rids):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ro = item[0]
                if not ro.finished:
                    continue
                failed = ro.outputs[0] if ro.outputs[0].finish_reason == "error" else None
                if failed is not None:
                    raise RequestFailedError(failed.error or "the engine failed on this request")
                done[ro.request_id] = ro
            return [done[r] for r in rids]
        finally:
            for rid in rids:
                self.queues.pop(rid, None)
                if rid not in done:
                    await self.abort(rid)

    async def lora(self, op: str, name: str = "", path: str = "") -> list[str]:
        """Load ("load"), unload ("unload") or list ("list") LoRA adapters in every engine core; the adapters loaded
        after the call. A failure raises InvalidRequestError (a bad adapter, a name taken or unknown, adapters in use)."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        reply = await self.client.lora(op, name, path)
        if reply.error:
            raise InvalidRequestError(reply.error, reply.param)
        return reply.names

    def cut_all(self, error: Exception) -> list[tuple[str, int]]:
        """End every request in flight with `error` (shutdown past the drain timeout); returns each one's
        id and the tokens it had generated. Their iterators raise it, and their `finally` aborts them."""
        cut = []
        for rid, q in list(self.queues.items()):
            parent = self.processor.parents.get(rid)
            tokens = sum(len(c.out.token_ids) for c in parent.children.values()) if parent else 0
            cut.append((rid, tokens))
            q.put_nowait(error)
        return cut

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    async def abort(self, request_id: str) -> None:
        children = self.processor.abort(request_id)
        if self.client is not None:
            self.client.abort_requests(children)

    # -- the output loop ---------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.get_output()  # its stats those of every core
                now = time.time()
                # processed first: outputs keep only the tokens the frontend took (none past a stop string), which
                # is what the loggers count
                results, stop_now = self.processor.process(msg.outputs)
                for logger in self.stat_loggers:
                    logger.record(msg, now)
                for ro, deltas in results:
                    q = self.queues.get(ro.request_id)
                    if q is not None:
                        q.put_nowait((ro, deltas))
                if stop_now:
                    self.client.finish_requests(stop_now)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("engine failed: %s", e)
            self.dead = True
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine failed: {e}")
            for q in self.queues.values():
                q.put_nowait(err)
            if self.on_dead:
                self.on_dead()


def check_kv_transfer(
    params: dict, local: dict | None, prompt_ids: list[int], sp: SamplingParams, trust: KVTransferConfig | None = None
) -> None:
    """The frontend's check of a request's kv_transfer_params, so that a refusal is a 400 before it is queued."""
    if not isinstance(params, dict):
        raise KVTransferError("kv_transfer_params must be an object", "kv_transfer_params")
    if local is None:  # a plain engine: the field would do nothing, and a silent 200 would hide the mistake
        raise KVTransferError(
            "kv_transfer_params needs an engine started with --kv-role or --kv-transfer-config", "kv_transfer_params"
        )
    if sp.n != 1:
        raise KVTransferError("kv_transfer_params takes one sample per request (n 1)", "kv_transfer_params")
    if params.get("do_remote_prefill"):
        check_remote_prefill(params, local, prompt_ids, trust)
    elif params.get("do_remote_decode") and local.get("role") == "kv_consumer":
        raise KVTransferError(
            "kv_transfer_params asks for a remote decode, but this engine offers no KV "
            "(start it with --kv-role producer or both)",
            "kv_transfer_params",
        )


def _before_failure(item: tuple[RequestOutput, dict[int, str]]) -> tuple[RequestOutput, dict[int, str]]:
    """A failed request's output as it stood before the failure: its tokens and texts, unfinished (a copy: the
    output is one object, updated in place)."""
    ro, deltas = item
    outputs = [dataclasses.replace(o, finish_reason=None, stop_reason=None, error=None) for o in ro.outputs]
    return dataclasses.replace(ro, outputs=outputs, finished=False), deltas


def _coalesce(item: tuple[RequestOutput, dict[int, str]], queue: asyncio.Queue) -> tuple[RequestOutput, dict[int, str]]:
    """`item` and the steps queued behind it as one: the output so far is the newest (one object, updated in
    place), so its tokens are those of every queued step, and their texts are joined to match. A consumer that
    falls behind (a slow client) then sends each token's text with its own logprobs, in fewer chunks. An error
    queued behind is raised now: the request has failed."""
    ro, deltas = item
    merged = dict(deltas)
    while not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, Exception):
            raise nxt
        ro, more = nxt
        for j, text in more.items():
            merged[j] = merged.get(j, "") + text
    return ro, merged
