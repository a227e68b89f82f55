"""What the API routes built on the chat path cost: `/v1/responses` and Anthropic's `/v1/messages` against
`/v1/chat/completions` for the same request (the same prompt as one user message, greedy, the same max tokens),
whole and streamed, through one `fulcrum serve` on a free loopback port.

The three routes go in turn within each repetition (the order rotated every repetition, so none always follows
another), whole then streamed, after a few warm-up rounds; all requests share one keep-alive connection. Reported
per route: end-to-end latency p50/p90 (request sent to the body's last byte), and streamed, the time to the first
text delta (chat: a chunk's delta.content; messages: a text_delta; responses: response.output_text.delta) p50/p90,
each with its ratio to chat's; the events and bytes a streamed answer takes. The greedy texts are checked equal
across routes. The prompt is the first of a few whose greedy answer fills --max-tokens (the routes cannot ask to
ignore EOS), else the one with the longest answer; the answers' token counts are reported.

    python benchmarks/bench_api_routes.py [--model bundled|PATH] [--repeats 100] [--max-tokens 48]
        [--out benchmarks/results/api_routes/bench-api-routes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import BUNDLED, cpu_summary, fulcrum_server, print_table, save_json  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "api_routes" / "bench-api-routes.json"
ROUTES = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
PROMPTS = ("ROMEO:", "JULIET:", "First Citizen:", "KING RICHARD III:", "Tell me of Verona.", "MENENIUS:")


def body(route: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """The same request in each route's words."""
    if route == "responses":
        return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}
    out = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
           "temperature": 0, "stream": stream}  # fmt: skip
    if route == "chat" and stream:
        out["stream_options"] = {"include_usage": True}  # as the other two always report usage
    return out


def whole_text(route: str, answer: dict) -> tuple[str, int]:
    """The answer's text and its output tokens."""
    if route == "chat":
        return answer["choices"][0]["message"]["content"] or "", answer["usage"]["completion_tokens"]
    if route == "responses":
        text = "".join(p["text"] for item in answer["output"] if item["type"] == "message" for p in item["content"])
        return text, answer["usage"]["output_tokens"]
    return "".join(b["text"] for b in answer["content"] if b["type"] == "text"), answer["usage"]["output_tokens"]


def text_delta(route: str, event: dict) -> str:
    if route == "chat":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices") or [])
    if route == "responses":
        return event["delta"] if event.get("type") == "response.output_text.delta" else ""
    delta = event.get("delta") or {}
    return delta.get("text", "") if event.get("type") == "content_block_delta" else ""


def run_once(client: httpx.Client, url: str, route: str, req: dict) -> dict:
    """One request: its end-to-end latency, and streamed, the time to its first text delta, events and bytes."""
    t0 = time.perf_counter()
    if not req["stream"]:
        r = client.post(url + PATHS[route], json=req)
        e2e = time.perf_counter() - t0
        r.raise_for_status()
        text, tokens = whole_text(route, r.json())
        return {"e2e": e2e, "text": text, "tokens": tokens}
    ttft, parts, events, size = None, [], 0, 0
    with client.stream("POST", url + PATHS[route], json=req) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            size += len(line) + 1
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            piece = text_delta(route, json.loads(line[6:]))
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(piece)
    return {"e2e": time.perf_counter() - t0, "ttft": ttft, "text": "".join(parts), "events": events, "bytes": size}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def pick_prompt(client: httpx.Client, url: str, model: str, max_tokens: int) -> str:
    """The first prompt whose greedy chat answer fills max_tokens (else the one with the longest answer)."""
    best, longest = PROMPTS[0], -1
    for prompt in PROMPTS:
        got = run_once(client, url, "chat", body("chat", model, prompt, max_tokens, False))
        if got["tokens"] >= max_tokens:
            return prompt
        if got["tokens"] > longest:
            best, longest = prompt, got["tokens"]
    return best


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return sorted(value.split())
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled (the default model) or a Hugging Face folder")
    p.add_argument("--repeats", type=int, default=100, help="rounds of the three routes, whole and streamed")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args()
    folder = BUNDLED if args.model == "bundled" else Path(args.model)
    log = Path(args.work_dir) / "api_routes" / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(cpu_summary())
    load_start = os.getloadavg()

    samples = {mode: {route: [] for route in ROUTES} for mode in ("whole", "streamed")}
    with fulcrum_server(folder, log_path=log) as url, httpx.Client(timeout=120) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        prompt = pick_prompt(client, url, model, args.max_tokens)
        print(f"model {model}, prompt {prompt!r}, max tokens {args.max_tokens}, {args.repeats} rounds")
        for i in range(args.warmup + args.repeats):
            order = ROUTES[i % 3 :] + ROUTES[: i % 3]
            for mode, stream in (("whole", False), ("streamed", True)):
                for route in order:
                    got = run_once(client, url, route, body(route, model, prompt, args.max_tokens, stream))
                    if i >= args.warmup:
                        samples[mode][route].append(got)

    texts = {s["text"] for mode in samples.values() for route in mode.values() for s in route}
    tokens = sorted({s["tokens"] for s in samples["whole"]["chat"]})
    results: dict = {}
    rows = []
    for mode, routes in samples.items():
        results[mode] = {}
        chat = {k: [s[k] for s in routes["chat"]] for k in ("e2e", "ttft") if k in routes["chat"][0]}
        for route, got in routes.items():
            fig: dict = {}
            for key in ("e2e", "ttft"):
                if key not in got[0]:
                    continue
                values = [s[key] for s in got]
                for q in (50, 90):
                    fig[f"{key}_p{q}_ms"] = round(pct(values, q) * 1e3, 2)
                    fig[f"{key}_p{q}_vs_chat"] = round(pct(values, q) / pct(chat[key], q), 3)
            if mode == "streamed":
                fig["events"] = statistics.median(s["events"] for s in got)
                fig["bytes"] = statistics.median(s["bytes"] for s in got)
            results[mode][route] = fig
            rows.append((mode, route, fig["e2e_p50_ms"], fig["e2e_p90_ms"], fig["e2e_p50_vs_chat"],
                         fig.get("ttft_p50_ms", "-"), fig.get("ttft_p90_ms", "-"), fig.get("ttft_p50_vs_chat", "-"),
                         fig.get("events", "-"), fig.get("bytes", "-")))  # fmt: skip
    print_table(
        "per-route latency, ms (ratios: p50 against chat's, same request)",
        rows,
        ("mode", "route", "e2e p50", "e2e p90", "e2e/chat", "ttft p50", "ttft p90", "ttft/chat", "events", "bytes"),
    )
    same = len(texts) == 1
    print(f"\ngreedy texts equal across routes and modes: {same}; output tokens per answer: {tokens}")
    save_json(args.out, {
        "cpu": cpu_summary(), "cpu_flags": cpu_flags(), "load_average_start": load_start,
        "load_average_end": os.getloadavg(), "model": str(folder), "prompt": prompt, "max_tokens": args.max_tokens,
        "output_tokens": tokens, "repeats": args.repeats, "warmup": args.warmup, "same_text": same,
        "routes": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
