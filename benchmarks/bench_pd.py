"""Prefill/decode disaggregation against colocation, at equal cores, through `fulcrum bench serve` (HTTP only):

- pd:         1 prefill engine (--kv-role producer) + 1 decode engine (--kv-role consumer) behind
              `fulcrum router --prefill --decode` (prompts under --pd-min-prompt-tokens go straight to decode);
- colocated:  2 plain engines behind `fulcrum router --policy least-load`.

Every engine runs one compute thread pinned to its own core (the pd pair on cores 0 and 1, the colocated pair on
the same two), so both setups have the same two cores. The workload is long-prefill: short chats with a share of
long prompts. Rounds alternate the two setups (the order flips each round) and each round has its own seed (no
prefix hit carries over from the last). Reported per setup: the short requests' ITL p50/p99, TTFT p50/p99 and
TPOT p99, goodput under --slo, throughput; for pd, the KV transfer time per pulled request against the prefill
leg's time, from the engines' and the router's /metrics. Medians over rounds, with min-max.

    python benchmarks/bench_pd.py [--rounds 3] [--num-prompts 48] [--long-len 900] [--kv-connector ZmqConnector]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import BUNDLED, cpu_summary, fulcrum_server  # noqa: E402
from fulcrum.router.scrape import sample_totals  # noqa: E402
from fulcrum.utils.serve_process import free_port  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sample_totals(r.read().decode(), split_by="path")


@contextlib.contextmanager
def router(*args: str):
    port = free_port()
    cmd = [sys.executable, "-m", "fulcrum.cli", "router", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    break
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the router did not start: {' '.join(cmd)}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def bench(url: str, out: Path, args, seed: int) -> dict:
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, "--quiet", "--ignore-eos",
           "--workload", "long-prefill", "--long-fraction", str(args.long_fraction),
           "--long-input-len", str(args.long_len), "--input-len", str(args.short_len),
           "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--concurrency", str(args.concurrency), "--tokenizer", str(BUNDLED), "--seed", str(seed),
           "--slo", args.slo, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--long-len", type=int, default=900)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--pd-min-prompt-tokens", type=int, default=128)
    p.add_argument("--slo", default="ttft=2s,tpot=100ms")
    p.add_argument("--kv-connector", default="ZmqConnector",
                   help="the pd pair's connector: ZmqConnector, SharedMemoryConnector, TorchDistributedConnector")  # fmt: skip
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench" / "pd"),
                   help="each run's JSON (every request's timings)")  # fmt: skip
    p.add_argument("--log", default=str(Path(__file__).parent / "results" / "cpu-pd.log"))
    args = p.parse_args()
    res = Path(args.work_dir)
    res.mkdir(parents=True, exist_ok=True)
    flags = ["--kv-cache-memory", "0.25", "--cpu-threads", "1"]
    lines = [cpu_summary(), f"load average at start: {uptime()}"]
    lines.append(
        f"long-prefill: {args.num_prompts} requests, {args.long_fraction:.0%} of {args.long_len} tokens, the rest "
        f"{args.short_len}; {args.output_len} output tokens; concurrency {args.concurrency}; SLO {args.slo}; "
        f"pd threshold {args.pd_min_prompt_tokens} tokens; {args.kv_connector}; every engine 1 thread on its own core "
        "(0 or 1)"
    )
    runs: dict[str, list[dict]] = {"pd": [], "colocated": []}
    transfer: list[tuple[float, float, float]] = []  # per pd round: pull s/request, prefill leg s/request, KB/pull
    with contextlib.ExitStack() as stack:

        def kv(role: str) -> tuple[str, str]:
            cfg = {"kv_connector": args.kv_connector, "kv_role": role, "secret": "bench-pd"}  # the pair's HMAC key
            return "--kv-transfer-config", json.dumps(cfg)

        P = stack.enter_context(fulcrum_server(BUNDLED, *flags, "--cpu-bind", "0", *kv("kv_producer")))
        D = stack.enter_context(fulcrum_server(BUNDLED, *flags, "--cpu-bind", "1", *kv("kv_consumer")))
        C1 = stack.enter_context(fulcrum_server(BUNDLED, *flags, "--cpu-bind", "0"))
        C2 = stack.enter_context(fulcrum_server(BUNDLED, *flags, "--cpu-bind", "1"))
        pd = stack.enter_context(router("--prefill", P, "--decode", D, "--model", str(BUNDLED),
                                        "--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)))  # fmt: skip
        colo = stack.enter_context(router("--replica", C1, "--replica", C2, "--policy", "least-load"))
        for rnd in range(args.rounds):
            order = ["pd", "colocated"] if rnd % 2 == 0 else ["colocated", "pd"]
            for mode in order:
                url = pd if mode == "pd" else colo
                before = (scrape(D), scrape(pd)) if mode == "pd" else None
                run = bench(url, res / f"{mode}-{rnd}.json", args, seed=100 + rnd)
                runs[mode].append(run)
                if before is not None:
                    d, r = scrape(D), scrape(pd)
                    pulls = d["fulcrum:kv_transfer_pulls_total"] - before[0]["fulcrum:kv_transfer_pulls_total"]
                    secs = (
                        d["fulcrum:kv_transfer_time_seconds_total"]
                        - before[0]["fulcrum:kv_transfer_time_seconds_total"]
                    )
                    nbytes = (d["fulcrum:kv_transfer_received_bytes_total"]
                              - before[0]["fulcrum:kv_transfer_received_bytes_total"])  # fmt: skip
                    legs = (
                        r["fulcrum_router:pd_prefill_seconds_count"]
                        - before[1]["fulcrum_router:pd_prefill_seconds_count"]
                    )
                    leg_s = (
                        r["fulcrum_router:pd_prefill_seconds_sum"] - before[1]["fulcrum_router:pd_prefill_seconds_sum"]
                    )
                    transfer.append((secs / max(pulls, 1), leg_s / max(legs, 1), nbytes / max(pulls, 1) / 1024))
                s = run["by_tag"]["short"]
                line = (f"round {rnd} {mode}: short ITL p50 {s['itl_ms']['p50']:.1f} p99 {s['itl_ms']['p99']:.1f} ms, "
                        f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms; load average {uptime()}")  # fmt: skip
                print(line, flush=True)
                lines.append(line)
        fallbacks = scrape(D)["fulcrum:kv_transfer_fallbacks_total"]
        routes = {k: v for k, v in scrape(pd).items() if k.startswith("fulcrum_router:pd_requests_total")}
    lines.append(f"load average at end: {uptime()}")
    rows = [("", "pd", "colocated")]
    for label, tag, metric, q in [
        ("short ITL p50 ms", "short", "itl_ms", "p50"),
        ("short ITL p99 ms", "short", "itl_ms", "p99"),
        ("short TPOT p99 ms", "short", "tpot_ms", "p99"),
        ("short TTFT p50 ms", "short", "ttft_ms", "p50"),
        ("short TTFT p99 ms", "short", "ttft_ms", "p99"),
        ("long TTFT p50 ms", "long", "ttft_ms", "p50"),
    ]:
        rows.append((label, *(med([r["by_tag"][tag][metric][q] for r in runs[m]]) for m in ("pd", "colocated"))))
    for label, key in [("goodput req/s", "goodput"), ("throughput req/s", "request_throughput"),
                       ("output tok/s", "output_throughput")]:  # fmt: skip
        rows.append((label, *(med([r["summary"][key] for r in runs[m]]) for m in ("pd", "colocated"))))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    pull, leg, kb = (statistics.median(x[i] for x in transfer) for i in range(3))
    lines.append(
        f"pd: KV pull {pull * 1000:.1f} ms per pulled request ({kb:.0f} KiB) against a prefill leg of "
        f"{leg * 1000:.0f} ms (median of rounds); fallbacks {fallbacks:.0f}; routes {routes}"
    )
    print("\n".join(lines))
    Path(args.log).write_text(f"$ python benchmarks/bench_pd.py {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
