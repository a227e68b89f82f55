"""`fulcrum serve`: take the port, start the engine core, then uvicorn. Exit codes: 0 after a clean drain,
1 when the engine died (or the server could not start), 3 when SIGTERM cut requests past the drain timeout."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from fulcrum.config import EngineConfig
from fulcrum.defaults import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODY_MB
from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.errors import FulcrumError
from fulcrum.server.api import build_app
from fulcrum.server.drain import ANSWER_GRACE_S, DrainingServer
from fulcrum.server.limits import header_timeout_protocol
from fulcrum.server.metrics import ServerMetrics
from fulcrum.server.stages import WakeStampingLoop
from fulcrum.server.state import ServerState

log = logging.getLogger("fulcrum.serve")


def bind_port(host: str, port: int) -> socket.socket:
    """The server's address, bound before the model loads so that a taken port fails at once, not after the load.
    uvicorn gets this very socket and listens on it once the engine is up (until then connections are refused, as
    before). Only another SO_REUSEADDR socket that is not listening yet, such as a second server starting at the
    same moment, can still bind the port meanwhile; whichever listens second then fails with the same message."""
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto says
    # TCP, and the connections accepted here take this socket's. With proto 0 an answer written as headers then body
    # waited for the client's delayed ACK (~40 ms on a keep-alive connection), and so did each streamed chunk.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # as uvicorn does: a restart may rebind while the last run's connections sit in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _bind_error(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"error: port {port} on {host} is already in use; pick another with --port"
    return f"error: cannot listen on {host}:{port}: {e.strerror or e}"


def default_model_name(model, path) -> str:
    """What clients call the model without --served-model-name: a Hub ID as given (its revision dropped), not the
    snapshot folder it resolved to (a commit hash); else the folder's name (a GGUF file's stem)."""
    if model is not None and not Path(str(model)).exists() and path.name != Path(str(model)).name:
        return str(model).split("@")[0]
    return path.name


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    metrics_compat: str | None = None,
    max_waiting_requests: int = 1024,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    tool_call_parser: str | None = None,
    allowed_origins: list[str] | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    reasoning_parser: str | None = None,
    ui: bool = True,
) -> int:
    try:
        sock = bind_port(host, port)
    except OSError as e:
        print(_bind_error(e, host, port), file=sys.stderr)
        return 1
    with sock:
        return _run(
            sock,
            config,
            api_key,
            served_model_name,
            metrics_compat,
            max_waiting_requests,
            drain_timeout,
            log_level,
            tool_call_parser,
            allowed_origins,
            max_body_mb,
            header_timeout,
            reasoning_parser,
            ui,
        )


def _run(
    sock: socket.socket,
    config: EngineConfig,
    api_key: str | None,
    served_model_name: str | None,
    metrics_compat: str | None,
    max_waiting_requests: int,
    drain_timeout: float,
    log_level: str,
    tool_call_parser: str | None = None,
    allowed_origins: list[str] | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    reasoning_parser: str | None = None,
    ui: bool = True,
) -> int:
    host, port = sock.getsockname()[:2]  # the port is the system's choice under --port 0
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    try:
        engine = AsyncLLM(config, max_waiting_requests=max_waiting_requests)
    except (FulcrumError, ValueError, OSError) as e:  # the model's folder, config or tokenizer
        log.debug("the model failed to load", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = served_model_name or default_model_name(config.model, engine.model_path)
    state = ServerState(engine, name, api_key, ServerMetrics(name, compat_vllm=metrics_compat == "vllm"))
    state.tool_call_parser = tool_call_parser
    state.reasoning_parser = reasoning_parser
    state.allowed_origins = list(allowed_origins or [])
    state.max_body_bytes = int(max_body_mb * 2**20)
    app = build_app(state, ui=ui)
    # our own drain runs first (DrainingServer.shutdown); uvicorn's grace is for the answers it leaves
    uvicorn_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=ANSWER_GRACE_S, access_log=False,
        http=header_timeout_protocol(header_timeout),
    )  # fmt: skip
    server = DrainingServer(uvicorn_config, state, drain_timeout)
    exit_code = {"code": 0}

    def engine_died():
        exit_code["code"] = 1
        server.should_exit = True

    engine.on_dead = engine_died

    async def main():
        ready = await engine.start()
        state.metrics.record_ready(ready)
        state.loras = {m["name"]: m["path"] for m in config.lora_modules or []}
        print(
            f"fulcrum serving {name} on {url} | KV cache: {ready.num_blocks} blocks x "
            f"{ready.block_size} tokens = {ready.num_blocks * ready.block_size} tokens ({ready.kv_cache_dtype}) | "
            f"max_model_len {ready.max_model_len} | step budget {config.max_num_batched_tokens} tokens"
            + (f" | weights: {ready.weights}, {ready.weight_bytes / 2**20:.1f} MiB" if ready.weights else "")
            + (_embedding_line(ready) if ready.task == "embed" else "")
            + (f" | web page: {url}/" if ui else ""),
            flush=True,
        )
        await server.serve(sockets=[sock])

    try:
        with asyncio.Runner(loop_factory=WakeStampingLoop) as runner:  # arrivals stamped when found (stages.py)
            runner.run(main())
    except Exception as e:
        in_use = isinstance(e, OSError) and e.errno == errno.EADDRINUSE  # the listen itself, see bind_port
        if in_use:
            print(_bind_error(e, host, port), file=sys.stderr)
            return 1
        log.debug("the server failed", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, FulcrumError | ValueError) else 1
    return exit_code["code"] or server.exit_code


def _embedding_line(ready) -> str:
    p = ready.pooler
    how = f"{p.pooling_type}-token" if p.pooling_type != "mean" else "mean"
    dims = " (matryoshka)" if p.matryoshka else ""
    norm = ", normalised" if p.normalize else ""
    return f" | embeddings at /v1/embeddings: {how} pooling{norm}, {ready.hidden_size} dimensions{dims} ({p.source})"
