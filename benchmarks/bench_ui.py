"""The web page's costs: its weight (bytes of every file it loads), its time to first render in headless Chromium
(navigation timing, median of several loads), and what one open dashboard costs the server: requests/s and CPU
seconds per second of the `fulcrum serve` processes over a quiet minute with no page, then with the dashboard
polling every 2 s (its default) and every 1 s. Writes benchmarks/results/ui/bench_ui.json.

    python benchmarks/bench_ui.py [--seconds 60] [--loads 7]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fulcrum.utils.serve_process import start  # noqa: E402
from fulcrum.utils.web_page import MEDIA, UI_DIR  # noqa: E402
from tests.ui.browser import console_errors, start_browser, stop_browser  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return total


def server_pids(pid: int) -> list[int]:
    """The server process and its children (the engine core, the grammar workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *map(int, out)]


def weight() -> dict:
    files = sorted(p for p in UI_DIR.iterdir() if p.suffix in MEDIA or p.name == "index.html")
    sizes = {p.name: p.stat().st_size for p in files}
    raw = b"".join(p.read_bytes() for p in files)
    return {"files": sizes, "bytes": sum(sizes.values()), "gzip_bytes": len(gzip.compress(raw, 9))}


def first_render(d, url: str, loads: int) -> dict:
    timing = []
    for _ in range(loads):
        d.get("about:blank")
        d.get(url + "/#chat")
        time.sleep(0.5)
        timing.append(d.execute_script("""const n = performance.getEntriesByType('navigation')[0];
            const p = Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]));
            return {first_paint: p['first-paint'], first_contentful_paint: p['first-contentful-paint'],
                    dom_content_loaded: n.domContentLoadedEventEnd, load: n.loadEventEnd,
                    transfer_bytes: performance.getEntriesByType('resource').reduce((a, r) => a + r.transferSize,
                                                                                   n.transferSize)}"""))  # fmt: skip
    keys = timing[0].keys()
    return {"loads": loads, **{f"{k}_ms_median": statistics.median(t[k] for t in timing) for k in keys}}


def polling(d, url: str, pids: list[int], seconds: float, interval_ms: int | None) -> dict:
    if interval_ms is None:
        d.get("about:blank")
    else:
        d.get("about:blank")
        d.get(url + "/#dashboard")
        d.execute_script("const s = document.getElementById('poll-interval'); s.value = arguments[0];"
                         "s.dispatchEvent(new Event('change'))", str(interval_ms))  # fmt: skip
        time.sleep(3)
    polls0 = 0 if interval_ms is None else int(d.execute_script("return document.getElementById('poll-state').dataset.polls"))  # fmt: skip
    cpu0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = cpu_seconds(pids), time.monotonic()
    polls1 = 0 if interval_ms is None else int(d.execute_script("return document.getElementById('poll-state').dataset.polls"))  # fmt: skip
    return {"poll_interval_ms": interval_ms, "seconds": t1 - t0, "requests_per_s": (polls1 - polls0) / (t1 - t0),
            "server_cpu_s_per_s": (cpu1 - cpu0) / (t1 - t0)}  # fmt: skip


def scrape_cost(url: str, pids: list[int], n: int = 200) -> dict:
    """What one /metrics answer costs the server in CPU (sequential requests, no page open). Not its wall time:
    httpx's keep-alive requests stall ~40 ms each on loopback here, /health alike, where curl and Chromium see 2-3 ms."""
    with httpx.Client() as c:
        c.get(url + "/metrics")
        cpu0 = cpu_seconds(pids)
        size = sum(len(c.get(url + "/metrics").content) for _ in range(n))
        cpu = cpu_seconds(pids) - cpu0
    return {"requests": n, "server_cpu_ms_per_request": 1e3 * cpu / n, "bytes_per_request": size / n}


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    line = lambda key: next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith(key)), "")  # noqa: E731
    flags = set(line("flags").split())
    return {"model": line("model name"), "cores": os.cpu_count(),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--loads", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/ui/bench_ui.json"))
    args = p.parse_args()
    log = Path(args.out).with_suffix(".serve.log")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    server = start(None, "--kv-cache-memory", "0.05", log_path=log, timeout=120)
    d = start_browser()
    try:
        pids = server_pids(server.proc.pid)
        result = {"machine": {**cpu_info(), "python": platform.python_version(), "note": "a shared machine"},
                  "chromium": d.capabilities.get("browserVersion"), "weight": weight()}  # fmt: skip
        result["first_render"] = first_render(d, server.url, args.loads)
        result["scrape"] = scrape_cost(server.url, pids)
        runs = [polling(d, server.url, pids, args.seconds, ms) for ms in (None, 2000, 1000)]
        base = runs[0]["server_cpu_s_per_s"]
        for r in runs:
            r["server_cpu_added_percent_of_a_core"] = 100 * (r["server_cpu_s_per_s"] - base)
        result["polling"] = runs
        result["console_errors"] = console_errors(d)
    finally:
        stop_browser(d)
        server.stop()
        log.unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    w, f = result["weight"], result["first_render"]
    print(f"page weight: {w['bytes']} bytes ({w['gzip_bytes']} gzipped) in {len(w['files'])} files")
    print(f"first contentful paint: {f['first_contentful_paint_ms_median']:.0f} ms median of {f['loads']} loads; "
          f"load event {f['load_ms_median']:.0f} ms")  # fmt: skip
    sc = result["scrape"]
    print(f"/metrics: {sc['server_cpu_ms_per_request']:.2f} ms server CPU, "
          f"{sc['bytes_per_request']:.0f} bytes per request")  # fmt: skip
    for r in runs:
        what = "no page" if r["poll_interval_ms"] is None else f"dashboard every {r['poll_interval_ms']} ms"
        print(f"{what}: {r['requests_per_s']:.2f} req/s, server CPU {100 * r['server_cpu_s_per_s']:.2f} % of a core "
              f"({r['server_cpu_added_percent_of_a_core']:+.2f})")  # fmt: skip
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
