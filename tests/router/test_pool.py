"""The pool's health checks against a replica that answers late: one late answer keeps it in the pool (a busy
host), two in a row take it out, a refused connection at once, and it returns when it answers again."""

from __future__ import annotations

import asyncio

from aiohttp import web

from fulcrum.router.pool import Pool
from fulcrum.utils.serve_process import free_port


async def _replica(delays: list[float]):
    """/health and /metrics that wait delays[i] seconds on the i-th /health (the last delay after that)."""
    calls = {"n": 0}

    async def health(request):
        d = delays[min(calls["n"], len(delays) - 1)]
        calls["n"] += 1
        await asyncio.sleep(d)
        return web.Response(text="ok")

    async def metrics(request):
        return web.Response(text="fulcrum:num_requests_waiting 0\n")

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/metrics", metrics)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_one_late_check_is_forgiven_two_are_not():
    async def run():
        runner, url = await _replica([0, 0.5, 0, 0.5, 0.5, 0])
        pool = Pool([url], interval=3600, timeout=0.2)  # checks driven by hand
        await pool.start()  # check 1: on time
        r = pool.replicas[url]
        try:
            assert r.healthy
            await pool.check(r)  # late once
            assert r.healthy and pool.available() == [r]
            await pool.check(r)  # on time: forgiven
            await pool.check(r)  # late
            assert r.healthy
            await pool.check(r)  # late again: out
            assert not r.healthy and pool.available() == []
            await pool.check(r)  # answers: back
            assert r.healthy
            await runner.cleanup()
            await pool.check(r)  # refused: out at once
            assert not r.healthy
        finally:
            await pool.stop()
            await runner.cleanup()

    asyncio.run(run())
