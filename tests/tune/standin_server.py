"""A stand-in for another engine's server, for `fulcrum tune --serve-cmd`: OpenAI-style streaming completions whose
speed depends on its flags. It serves --max-num-seqs requests at once (default 2) and queues the rest, so a larger
batch is faster under load; every start appends its command line to $STANDIN_LOG."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="standin")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--token-ms", type=float, default=4.0)
    args = p.parse_args()
    if os.environ.get("STANDIN_LOG"):
        with open(os.environ["STANDIN_LOG"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    slots = asyncio.Semaphore(args.max_num_seqs)

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    async def completions(request: web.Request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with slots:
            for _ in range(n):
                await asyncio.sleep(args.token_ms / 1e3)
                chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models),
                    web.post("/v1/completions", completions)])  # fmt: skip
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
