"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timings follow vLLM's benchmark: TTFT is the arrival of the first chunk that carries content, every later
content chunk adds one inter-token gap, and end-to-end latency ends at the last content chunk. Whatever the
server does wrong becomes a failed result, never an exception, so one bad request never ends a run (`send`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError


def gaps(times: list[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive content chunks."""
    return [b - a for a, b in zip(times, times[1:])]


@dataclass
class RequestResult:
    session: int
    turn: int
    tag: str = ""
    input_len: int = 0  # intended prompt tokens of the new text
    start: float = 0.0  # seconds since the run started
    ok: bool = False
    error: str | None = None  # failure class: http_503, timeout, connection, malformed_chunk, ...
    error_detail: str = ""
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, seconds since the request started
    prompt_tokens: int | None = None
    output_tokens: int = 0
    token_source: str = ""  # usage | tokenizer | chunks (set after the run when the server sent no usage)
    text: str = ""

    @property
    def itl(self) -> list[float]:
        return gaps(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        """None for a failed request and for a single output token (no time per output token to speak of)."""
        if not self.ok or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class Target:
    """The server under test: where to post, with which model and key."""

    def __init__(self, base_url: str, model: str, endpoint: str = "completions", api_key: str | None = None):
        if endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be completions or chat")
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/v1/{path}"


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def discover_model(session: aiohttp.ClientSession, base_url: str, headers: dict, timeout: float = 30) -> str:
    """The first model the server lists under /v1/models."""
    url = f"{normalize_base_url(base_url)}/v1/models"
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models answered {resp.status}: {(await resp.text())[:200]}")
        try:
            return (await resp.json(content_type=None))["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"GET /v1/models lists no model ({type(e).__name__}); pass --model") from None


def build_payload(target: Target, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """The request body: chat messages as they are, or for /v1/completions their text joined. Usage is
    asked for in the stream unless `extra` says otherwise (`stream_options: None`, for servers that refuse it)."""
    body = {
        "model": target.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if body["stream_options"] is None:
        del body["stream_options"]
    if target.endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in messages)
    return body


def _content_of(choice) -> str:
    """The text a choice carries: completions' `text`, or chat's `delta` content and reasoning (vLLM and SGLang
    send `reasoning_content`, Ollama and newer servers `reasoning`). Anything not a string counts as none."""
    if not isinstance(choice, dict):
        raise ValueError(f"a choice is not an object: {choice!r:.100}")
    if "text" in choice:
        parts = [choice.get("text")]
    else:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
    return "".join(p for p in parts if isinstance(p, str))


def _read_chunk(chunk, result: RequestResult) -> str:
    """Take usage from a parsed chunk into `result`; return its content. Raises ValueError on a shape no
    OpenAI-compatible server sends."""
    if not isinstance(chunk, dict):
        raise ValueError(f"a chunk is not an object: {chunk!r:.100}")
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > 0:
            result.output_tokens, result.token_source = usage["completion_tokens"], "usage"
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError(f"choices is not a list: {choices!r:.100}")
    return "".join(_content_of(c) for c in choices)


async def send(
    http: aiohttp.ClientSession,
    target: Target,
    body: dict,
    result: RequestResult,
    clock: Callable[[], float] = time.perf_counter,
    timeout: float | None = None,
    read_timeout: float | None = None,
) -> RequestResult:
    """Post `body`, read the stream, fill `result` (timings, usage, text, or the failure). Output tokens come from
    the server's usage; without it `token_source` stays empty and the caller counts them after the run.
    `timeout` bounds the whole request, `read_timeout` each wait for data (the headers and every line), so a server
    that stops sending mid-stream is cut then, not when the whole deadline runs out. An error status or event, a
    malformed chunk, a dropped connection, a timeout or a stream without `[DONE]` is a failed result, not a raise."""
    st = clock()
    last = st
    text_parts: list[str] = []
    done = False
    try:
        to = aiohttp.ClientTimeout(total=timeout, sock_read=read_timeout)
        async with http.post(target.url, json=body, headers=target.headers, timeout=to) as resp:
            if resp.status != 200:
                return _fail(result, f"http_{resp.status}", _error_message(await resp.text(errors="replace")))
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                now = clock()
                if not line.startswith(b"data:"):
                    continue  # SSE comments and event names carry no data
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and chunk.get("error"):
                        return _fail(result, "server_error", _error_message(chunk))
                    content = _read_chunk(chunk, result)
                except ValueError as e:  # not JSON, not UTF-8, or a shape no server sends
                    return _fail(result, "malformed_chunk", f"{e}: {data[:200].decode(errors='replace')}")
                if content:
                    if result.ttft is None:
                        result.ttft = now - st
                    result.chunk_times.append(now - st)
                    text_parts.append(content)
                    last = now
    except asyncio.TimeoutError as e:
        # aiohttp raises the read deadline as a ServerTimeoutError "on reading data", the whole deadline as a
        # TimeoutError (a ServerTimeoutError too when it runs out while connecting)
        if isinstance(e, aiohttp.ServerTimeoutError) and "reading data" in str(e):
            return _fail(result, "timeout", f"timed out: no data for {_seconds(read_timeout)} (the stream went silent)")
        return _fail(result, "timeout", f"timed out after {_seconds(timeout)} without a complete answer")
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        return _fail(result, "connection", f"{type(e).__name__}: {e}")
    except (aiohttp.ClientError, HttpProcessingError, ValueError) as e:
        # e.g. an SSE line past aiohttp's line limit (a server that ignored `stream` and sent one huge body)
        return _fail(result, "client_error", f"{type(e).__name__}: {e}")
    except Exception as e:
        # anything else (aiohttp raises RuntimeError("Connection closed.") on a socket gone under a read) is one
        # failed request too: raised, it would end its user's loop and then the run, losing what it measured
        return _fail(result, "client_error", f"{type(e).__name__}: {e}")
    result.text = "".join(text_parts)
    if not done:
        return _fail(result, "incomplete_stream", "the stream ended without [DONE]")
    if result.ttft is None:
        return _fail(result, "no_content", "the stream carried no content")
    result.e2e = last - st
    result.ok = True
    return result


def _seconds(v: float | None) -> str:
    return "no limit" if v is None else f"{v:g} s"


def _fail(result: RequestResult, kind: str, detail: str) -> RequestResult:
    result.ok, result.error, result.error_detail = False, kind, detail
    return result


def _error_message(body: str | dict) -> str:
    """The message of an OpenAI-style error body, or the start of whatever came."""
    try:
        obj = json.loads(body) if isinstance(body, str) else body
        err = obj.get("error", obj)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return str(body)[:300]


SERVER_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "e2e": "e2e_request_latency_seconds"}


async def server_histograms(session: aiohttp.ClientSession, base_url: str, headers: dict) -> dict | None:
    """The server's own TTFT and end-to-end histograms, (sum of seconds, count) each, from its /metrics: fulcrum's
    names, else vLLM's, summed over their labels; None when the server shows neither."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        url = f"{normalize_base_url(base_url)}/metrics"
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                totals[s.name] = totals.get(s.name, 0.0) + s.value
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None
    for prefix in ("fulcrum:", "vllm:"):  # a histogram shows no series before its first request: zeros then
        if any(name.startswith(prefix) for name in totals):
            return {key: (totals.get(f"{prefix}{name}_sum", 0.0), totals.get(f"{prefix}{name}_count", 0.0))
                    for key, name in SERVER_HISTOGRAMS.items()}  # fmt: skip
    return None


def server_means(before: dict | None, after: dict | None) -> dict | None:
    """The server's mean TTFT and E2E (ms) over the requests it finished between two scrapes, and their count."""
    if before is None or after is None:
        return None
    out: dict[str, float | None] = {}
    for key in SERVER_HISTOGRAMS:
        total, n = (a - b for a, b in zip(after[key], before[key]))
        out[f"{key}_mean_ms"] = total / n * 1e3 if n > 0 else None
    out["requests"] = after["ttft"][1] - before["ttft"][1]
    return out
