"""The router's `pd` mode: prefill/decode disaggregation over two pools of engines, as vLLM's disagg proxy does.

A request's prompt first goes to a prefill engine (a KV producer) with max_tokens 1 and kv_transfer_params
{"do_remote_decode": true}; its answer's kv_transfer_params go with the original request to a decode engine (a KV
consumer), whose answer is the client's. Any engine that speaks vLLM's kv_transfer_params fits either pool."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram

from fulcrum.router.app import Router, RouterConfig
from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.pool import SATURATED, Pool
from fulcrum.router.tokens import PromptTokenizer

log = logging.getLogger("fulcrum.router")
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# fields a prefill request does without: it computes the prompt and one token that nobody reads
PREFILL_DROPS = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "n",
                 "best_of", "max_completion_tokens")  # fmt: skip


@dataclass
class PDConfig:
    min_prompt_tokens: int = 32  # shorter prompts are prefilled on the decode engine (not worth a transfer)
    # a busy prefill pool: when even its least-loaded engine has more requests than this (in flight + waiting),
    # the decode engine prefills instead (None: only when every prefill engine is down or saturated)
    max_prefill_load: float | None = None


class _BothPools:
    """The two pools as one, for the router's per-replica gauges."""

    def __init__(self, *pools: Pool):
        self.pools = pools
        self.stale_after = pools[0].stale_after

    @property
    def replicas(self) -> dict:
        return {url: r for p in self.pools for url, r in p.replicas.items()}

    def available(self, exclude: set[str] = frozenset()) -> list:
        return [r for p in self.pools for r in p.available(exclude)]


class PDRouter:
    """Fronts a prefill pool and a decode pool; presents the interface router/app.py's build_app serves. Engines are
    chosen within each pool by the router's --policy."""

    def __init__(self, prefill: Pool, decode: Pool, cfg: RouterConfig, pd: PDConfig | None = None):
        self.cfg, self.pd = cfg, pd or PDConfig()
        # the prefill answer is read whole: no stream to retry past; the decode side keeps the usual retries
        self.prefill = Router(prefill, replace(cfg, validate=False))
        self.decode = Router(decode, cfg)
        self.metrics = RouterMetrics(_BothPools(prefill, decode))
        self.prefill.metrics = self.decode.metrics = self.metrics
        r = self.metrics.registry
        self.routes = Counter(
            "fulcrum_router:pd_requests", "Requests by path: disaggregated, or straight to decode and why",
            ["path"], registry=r,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "fulcrum_router:pd_prefill_seconds", "Prefill leg, sent to answered", registry=r, buckets=PREFILL_BUCKETS
        )
        # the threshold counts tokens when the router knows the model (else UTF-8 bytes stand in for them)
        self.tokenizer = self.decode.tokenizer or PromptTokenizer(cfg.model)

    @property
    def pool(self) -> Pool:
        return self.decode.pool  # healthy while a decode engine is: it can always prefill locally

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    async def get(self, path: str) -> Response:
        return await self.decode.get(path)

    def _direct_reason(self, endpoint: str, body: dict) -> str | None:
        """Why this request skips the prefill engines (None: it is disaggregated): one the handshake cannot carry
        (n > 1, several prompts), one that brings its own kv_transfer_params, a prompt shorter than
        `min_prompt_tokens`, or no prefill engine able to take it. The decode engine then prefills it locally."""
        if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
            return "multi-sample"
        prompt = body.get("prompt")
        if (
            endpoint == "completions"
            and isinstance(prompt, list)
            and len(prompt) > 1
            and not isinstance(prompt[0], int)
        ):
            return "multi-prompt"
        if body.get("kv_transfer_params") is not None:
            return "client-params"  # the client runs its own handshake
        if len(self.tokenizer.token_ids(endpoint, body)) < self.pd.min_prompt_tokens:
            return "short-prompt"
        pool = self.prefill.pool
        low = min((r.load(pool.stale_after) for r in pool.available()), default=SATURATED)
        if low == SATURATED:
            return "no-prefill-engine"  # none healthy, or all saturated
        if self.pd.max_prefill_load is not None and low > self.pd.max_prefill_load:
            return "prefill-busy"
        return None

    async def forward(self, request: Request, path: str, endpoint: str, body: dict, raw: bytes) -> Response:
        """Prefill, then decode with the prefill's kv_transfer_params (a failed prefill: decode alone). The decode
        engine computes the first token itself (from the last prompt token, its KV pulled), so the prefill engine's
        token is dropped and the client sees each token once, streamed or whole."""
        reason = self._direct_reason(endpoint, body)
        if reason is None:
            params, failed = await self._prefill(request, path, endpoint, body)
            if failed is not None:
                return failed  # the client's own error (a 4xx): the decode engine would say the same
            if params is not None:
                self.routes.labels("disaggregated").inc()
                decode_body = {**body, "kv_transfer_params": params}
                return await self.decode.forward(request, path, endpoint, decode_body, json.dumps(decode_body).encode())
            reason = "prefill-failed"
        self.routes.labels(reason).inc()
        return await self.decode.forward(request, path, endpoint, body, raw)

    async def _prefill(self, request: Request, path: str, endpoint: str, body: dict):
        """(kv_transfer_params, None) after a good prefill; (None, response) for a client error to pass on;
        (None, None) when the prefill failed and the decode engine should prefill instead."""
        pbody = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        t0 = time.perf_counter()
        resp = await self.prefill.forward(request, path, endpoint, pbody, json.dumps(pbody).encode())
        self.prefill_seconds.observe(time.perf_counter() - t0)
        try:
            answer = json.loads(resp.body)
        except (ValueError, AttributeError):
            answer = {}
        if resp.status_code == 200 and isinstance(answer.get("kv_transfer_params"), dict):
            return answer["kv_transfer_params"], None
        error = answer.get("error") if isinstance(answer, dict) else None
        param = error.get("param") if isinstance(error, dict) else None
        if 400 <= resp.status_code < 500 and resp.status_code != 429 and param != "kv_transfer_params":
            return None, resp
        log.warning("prefill leg failed (HTTP %s: %s); the decode engine prefills locally", resp.status_code,
                    str(error)[:200])  # fmt: skip
        return None, None
