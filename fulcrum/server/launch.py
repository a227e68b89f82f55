"""`fulcrum serve`: start the engine core, then uvicorn; exit non-zero if the engine dies."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

from fulcrum.config import EngineConfig
from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.server.api import ServerState, build_app
from fulcrum.server.metrics import ServerMetrics

log = logging.getLogger("fulcrum.serve")


class _Server(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM after its graceful shutdown (so the process dies of the
    signal); a drained, clean shutdown is ours to report as exit code 0."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


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
) -> int:
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    engine = AsyncLLM(config, max_waiting_requests=max_waiting_requests)
    name = served_model_name or engine.model_config.path.name
    state = ServerState(engine, name, api_key, ServerMetrics(name, compat_vllm=metrics_compat == "vllm"))
    app = build_app(state)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=int(drain_timeout),
            access_log=False,
        )
    )
    exit_code = {"code": 0}

    def engine_died():
        exit_code["code"] = 1
        server.should_exit = True

    engine.on_dead = engine_died

    async def main():
        ready = await engine.start()
        print(
            f"fulcrum serving {name} on http://{host}:{port} | KV cache: {ready.num_blocks} blocks x "
            f"{ready.block_size} tokens = {ready.num_blocks * ready.block_size} tokens | "
            f"max_model_len {ready.max_model_len}",
            flush=True,
        )
        await server.serve()

    try:
        asyncio.run(main())
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return exit_code["code"]
