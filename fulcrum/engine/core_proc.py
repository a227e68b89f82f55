"""The engine core in a process of its own: a step loop fed and drained over ZeroMQ sockets,
so that HTTP work in the frontend never stalls the batch."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import msgspec
import zmq

from fulcrum.config import EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.engine.messages import (
    ABORT,
    ADD,
    FINISH,
    LORA,
    SHUTDOWN,
    CallReply,
    CoreOutputs,
    CoreReady,
    decode_add,
    decode_ids,
    decode_lora_call,
    encoder,
)
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.errors import FulcrumError, InvalidRequestError

log = logging.getLogger(__name__)
IDLE_POLL_MS = 200


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the core process. Exits when told to, or when the frontend goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when to stop
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(output_addr)
    try:
        core = EngineCore(config, own_process=True)
    except Exception as e:
        # the frontend reports it in one line; the trace is for --log-level debug
        log.debug("the engine core failed to start", exc_info=True)
        message = str(e) if isinstance(e, FulcrumError) else f"{type(e).__name__}: {e}"
        push.send(encoder.encode(CoreReady(error=message)))
        push.close()
        ctx.term()
        return
    ready = CoreReady(
        core.kv.num_blocks, config.block_size, core.max_model_len, core.vocab_size,
        kv_cache_dtype=core.runner.kv_cache_dtype_name,
        kv_transfer=core.kv_transfer.describe() if core.kv_transfer is not None else None,
        weights=getattr(core.runner, "weights_format", ""), weight_bytes=getattr(core.runner, "weight_bytes", 0),
        task=core.model_config.task, pooler=core.model_config.pooler,
        hidden_size=core.model_config.hf_config.hidden_size,
        max_loras=config.max_loras if config.enable_lora else 0,
    )  # fmt: skip
    push.send(encoder.encode(ready))
    try:
        _loop(core, pull, push)
    except Exception:
        log.error("engine core failed:\n%s", traceback.format_exc())
        raise
    finally:
        core.shutdown()
        pull.close(0)
        push.close()
        ctx.term()


def _add(core: EngineCore, payload: bytes) -> list[EngineCoreOutput]:
    """Admit one request. The frontend validates first; whatever still fails here ends that request
    with an error, never the loop."""
    request_id = "?"
    try:
        m = decode_add(payload)
        request_id = m.request_id
        core.add_request(
            m.request_id, m.prompt_token_ids, m.sampling_params, m.priority, m.arrival_time, m.kv_transfer_params,
            m.lora_name, m.images,
        )  # fmt: skip
        return []
    except (InvalidRequestError, msgspec.ValidationError, msgspec.DecodeError) as e:
        log.error("rejected request %s: %s", request_id, e)
        return [
            EngineCoreOutput(request_id, [], finish_reason="error", error=f"invalid request: {e}", error_status=400)
        ]


def _lora(core: EngineCore, payload: bytes) -> CallReply:
    """A LoRA call: load, unload or list adapters. A failure is the reply's error, never the loop's."""
    call_id = -1
    try:
        call = decode_lora_call(payload)
        call_id = call.call_id
        return CallReply(call_id, names=core.lora(call.op, call.name, call.path))
    except (FulcrumError, msgspec.ValidationError, msgspec.DecodeError) as e:
        log.error("LoRA call failed: %s", e)
        return CallReply(call_id, error=str(e), names=core.list_loras(), param=getattr(e, "param", None))


def _loop(core: EngineCore, pull: zmq.Socket, push: zmq.Socket) -> None:
    step_time = 0.0
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the frontend died without telling us (SIGKILL): do not linger as an orphan
            log.error("the frontend process is gone; engine core exiting")
            return
        outputs, replies = [], []
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        while pull.poll(timeout):
            timeout = 0
            kind, payload, *more = pull.recv_multipart()
            if kind == ADD:  # a request's samples come as one message of several parts
                for part in (payload, *more):
                    outputs.extend(_add(core, part))
            elif kind == ABORT:
                outputs.extend(core.abort_requests(decode_ids(payload)))
            elif kind == FINISH:
                core.finish_requests(decode_ids(payload))
            elif kind == LORA:
                replies.append(_lora(core, payload))
            elif kind == SHUTDOWN:
                return
        if not core.has_unfinished_requests():
            core.housekeeping()  # KV leases end on idle ticks too
        if core.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs.extend(core.step())
            step_time = time.perf_counter() - t0
        waiting_for_kv = core.kv_transfer is not None and core.kv_transfer.busy()  # its gauges move meanwhile
        if outputs or timeout or waiting_for_kv or replies:  # after work, and on idle ticks (fresh gauges)
            msg = CoreOutputs(outputs, core.stats(step_time), time.time(), replies)
            push.send(encoder.encode(msg))
