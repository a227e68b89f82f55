"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timings follow vLLM's benchmark: TTFT is the arrival of the first chunk that carries content, every
later content chunk adds one inter-token gap, and end-to-end latency ends at the last content chunk.
Whatever the server does wrong (an error status, an error event, a malformed chunk, a dropped
connection, a timeout, a stream without `[DONE]`) becomes a failed result, never an exception.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


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
    token_source: str = ""  # usage | tokenizer | chunks
    text: str = ""

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.ok:
            return None
        if self.output_tokens <= 1:
            return 0.0
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


async def discover_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    """The first model the server lists under /v1/models."""
    async with session.get(f"{normalize_base_url(base_url)}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models answered {resp.status}: {(await resp.text())[:200]}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError("the server lists no models; pass --model")
    return data[0]["id"]


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


def _content_of(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(
    http: aiohttp.ClientSession,
    target: Target,
    body: dict,
    result: RequestResult,
    clock: Callable[[], float] = time.perf_counter,
    count_tokens: Callable[[str], int] | None = None,
    timeout: float | None = None,
) -> RequestResult:
    """Post `body`, read the stream, fill `result` (timings, tokens, text or the failure)."""
    st = clock()
    last = st
    text_parts: list[str] = []
    done = False
    try:
        to = aiohttp.ClientTimeout(total=timeout)
        async with http.post(target.url, json=body, headers=target.headers, timeout=to) as resp:
            if resp.status != 200:
                return _fail(result, f"http_{resp.status}", _error_message(await resp.text()))
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
                except ValueError:
                    return _fail(result, "malformed_chunk", data[:200].decode(errors="replace"))
                if not isinstance(chunk, dict):
                    return _fail(result, "malformed_chunk", data[:200].decode(errors="replace"))
                if "error" in chunk:
                    return _fail(result, "server_error", _error_message(chunk))
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    if usage.get("completion_tokens") is not None:
                        result.output_tokens = int(usage["completion_tokens"])
                        result.token_source = "usage"
                content = "".join(_content_of(c) for c in chunk.get("choices") or [])
                if content:
                    if result.ttft is None:
                        result.ttft = now - st
                    result.chunk_times.append(now - st)
                    text_parts.append(content)
                    last = now
    except asyncio.TimeoutError:
        return _fail(result, "timeout", f"no complete answer within {timeout} s")
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        return _fail(result, "connection", f"{type(e).__name__}: {e}")
    except aiohttp.ClientError as e:
        return _fail(result, "client_error", f"{type(e).__name__}: {e}")
    result.text = "".join(text_parts)
    if not done:
        return _fail(result, "incomplete_stream", "the stream ended without [DONE]")
    if result.ttft is None:
        return _fail(result, "no_content", "the stream carried no content")
    result.e2e = last - st
    if result.token_source != "usage":
        if count_tokens is not None:
            result.output_tokens, result.token_source = count_tokens(result.text), "tokenizer"
        else:
            result.output_tokens, result.token_source = len(result.chunk_times), "chunks"
    result.ok = True
    return result


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
