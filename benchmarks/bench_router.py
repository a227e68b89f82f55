"""The router's policies and the autoscaler, measured with `fulcrum bench serve` (HTTP only) against real processes.

- policies:  2 replicas of the bundled model, each with a KV cache that holds about half of the workload's system
             prompts, behind `fulcrum router` with each policy in turn (round-robin, the baseline, least-load,
             prefix, kv-events, weighted on the KV events), the same shared-prefix workload (several system prompts
             shared by many requests) each time: TTFT p50/p90/p99, throughput, and each replica's prefix-cache hit
             rate from its /metrics over the run. Rounds alternate the order of the policies; each (round, policy)
             run draws its own system prompts (seed), so no run finds another's prefixes cached. An odd number of
             groups: requests cycle through them, and an even number would let round-robin keep each on one replica.
- autoscale: `fulcrum autoscale --backend local --min 1 --max 2` under a bursty open-loop load (quiet, burst,
             quiet), its pool size sampled from the router's /metrics every 0.5 s; against fixed pools of 1 and 2
             replicas (min = max) under the same load: SLO attainment, replica-seconds, scale events, failures.

- events:    what publishing KV events costs: the same offline batch through the bundled model with events on (a
             subscriber reading them) and off, rounds alternating.

    python benchmarks/bench_router.py [--only policies,autoscale,events] [--rounds 2]

Writes benchmarks/results/router/*.json and a log (summary-*.txt) with the CPU flags and load averages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import BUNDLED  # noqa: E402
from fulcrum.utils.serve_process import free_port, start  # noqa: E402

POLICIES = ["round-robin", "least-load", "prefix", "kv-events", "weighted"]
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, timeout: float = 5) -> str:
    with _opener.open(url, timeout=timeout) as r:
        return r.read().decode()


def cpu_flags() -> str:
    out = subprocess.run("grep -o -w 'avx2\\|avx512f\\|avx512_bf16\\|amx_tile' /proc/cpuinfo | sort -u",
                         shell=True, capture_output=True, text=True).stdout  # fmt: skip
    return " ".join(out.split()) or "none"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prefix_counts(url: str) -> tuple[float, float]:
    text = get(f"{url}/metrics")
    return counter(text, "fulcrum:prefix_cache_queries"), counter(text, "fulcrum:prefix_cache_hits")


def bench(url: str, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, "--quiet", "--ignore-eos",
           "--tokenizer", str(BUNDLED), "--out", str(out), *args]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


@contextlib.contextmanager
def process(cmd: list[str], url: str, log: Path, timeout: float = 120):
    """A router or autoscaler process, yielded once its /health answers 200."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[3]} exited:\n{log.read_text()[-3000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"{cmd[3]} did not become healthy:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                get(f"{url}/health", 1)
                break
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def replica_flags(args) -> list[str]:
    return ["--kv-cache-memory", str(args.kv_blocks * 16 * 8192 / 2**30), "--max-model-len", "512",
            "--cpu-threads", "1", "--cpu-bind", "none", "--served-model-name", "shakespeare", "--log-level", "warning"]  # fmt: skip


# -- policies ------------------------------------------------------------------------------------------------------


def policies(args, res: Path) -> list[str]:
    reps, events = [], []
    for _ in range(2):
        ep = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep}
        reps.append(start(BUNDLED, *replica_flags(args), "--kv-events-config", json.dumps(cfg),
                          log_path=res / f"replica-{len(reps)}.log", timeout=300))  # fmt: skip
        events.append(ep)
    load = ["--workload", "shared-prefix", "--num-groups", str(args.groups), "--prefix-len", str(args.prefix_len),
            "--input-len", "24", "--output-len", "8", "--num-prompts", str(args.prompts),
            "--concurrency", str(args.concurrency)]  # fmt: skip
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    lines = []
    try:
        for rnd in range(args.rounds):
            order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
            for k, policy in enumerate(order):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = [sys.executable, "-m", "fulcrum.cli", "router", "--port", str(port), "--policy", policy,
                       "--model", str(BUNDLED), "--log-level", "warning"]  # fmt: skip
                for s, ep in zip(reps, events):
                    cmd += ["--replica", s.url]
                    if policy in ("kv-events", "weighted"):
                        cmd += ["--kv-events-endpoint", ep]
                with process(cmd, url, res / f"router-{policy}.log"):
                    before = [prefix_counts(s.url) for s in reps]
                    la = load_avg()
                    doc = bench(url, res / f"policy-{policy}-r{rnd}.json", *load, "--seed", str(100 * rnd + k))
                    time.sleep(1.0)  # the replicas' counters follow their engines a few hundred ms behind
                    after = [prefix_counts(s.url) for s in reps]
                s = doc["runs"][0]["summary"]
                hits = [(a[1] - b[1]) / (a[0] - b[0]) if a[0] > b[0] else 0.0 for a, b in zip(after, before)]
                reqs = [a[0] - b[0] for a, b in zip(after, before)]
                total_hit = sum(a[1] - b[1] for a, b in zip(after, before)) / max(sum(reqs), 1)
                results[policy].append(dict(ttft_p50=s["ttft_ms"]["p50"], ttft_p90=s["ttft_ms"]["p90"],
                                            ttft_p99=s["ttft_ms"]["p99"], tput=s["request_throughput"],
                                            out_tput=s["output_throughput"], hit=hits, tokens=reqs,
                                            total_hit=total_hit, failed=s["failed"], load=la))  # fmt: skip
                r = results[policy][-1]
                lines.append(f"  round {rnd} {policy:>11}: TTFT p50 {r['ttft_p50']:7.1f} p90 {r['ttft_p90']:7.1f} "
                             f"p99 {r['ttft_p99']:7.1f} ms, {r['tput']:5.2f} req/s, hit rate {total_hit:.2f} "
                             f"(replicas {hits[0]:.2f}/{hits[1]:.2f}, prompt tokens {reqs[0]:.0f}/{reqs[1]:.0f}), "
                             f"failed {r['failed']}, load {la}")  # fmt: skip
                print(lines[-1], flush=True)
    finally:
        for s in reps:
            s.stop()
    head = [f"policies: 2 replicas (bundled model, fp32, 1 thread each, {args.kv_blocks}-block KV cache each), "
            f"shared-prefix: {args.groups} system prompts of {args.prefix_len} tokens + 24-token questions, "
            f"8 output tokens, {args.prompts} requests at concurrency {args.concurrency}; {args.rounds} rounds, "
            "order alternating; medians over rounds [min-max]"]  # fmt: skip

    def med(p, key):
        xs = [r[key] for r in results[p]]
        return f"{statistics.median(xs):7.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    base = statistics.median(r["ttft_p50"] for r in results["round-robin"])
    for p in POLICIES:
        head.append(f"  {p:>11}: TTFT p50 {med(p, 'ttft_p50')} ms, p90 {med(p, 'ttft_p90')}, p99 {med(p, 'ttft_p99')}"
                    f"; {med(p, 'tput')} req/s; hit rate {med(p, 'total_hit')}; TTFT p50 vs round-robin "
                    f"{statistics.median(r['ttft_p50'] for r in results[p]) / base:.2f}x")  # fmt: skip
    (res / "policies.json").write_text(json.dumps(results, indent=1))
    return head + ["  runs:"] + lines


# -- autoscale -----------------------------------------------------------------------------------------------------


class PoolWatcher(threading.Thread):
    """Samples the router's available replicas every 0.5 s: the pool size over time."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.samples, self.stop_flag = url, [], threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop_flag.is_set():
            with contextlib.suppress(OSError, ValueError):
                n = counter(get(f"{self.url}/metrics", 2), "fulcrum_router:replicas")
                self.samples.append((time.monotonic() - t0, int(n)))
            self.stop_flag.wait(0.5)


def autoscale(args, res: Path) -> list[str]:
    phases = args.phases.split(",")
    enough = int(max(map(float, phases)) * args.phase_s * 1.5) + 10  # sessions are drawn up front: no more than this
    load = ["--request-rate", args.phases, "--duration", str(args.phase_s), "--num-prompts", str(enough),
            "--input-len", "64", "--output-len", "32", "--slo", f"ttft={args.slo_ttft}",
            "--max-concurrency", "64"]  # fmt: skip
    variants = {"autoscale 1-2": (1, 2), "fixed 1": (1, 1), "fixed 2": (2, 2)}
    lines = [f"autoscale: open-loop Poisson load, phases {phases} req/s of {args.phase_s:g} s each, 64-token "
             f"prompts, 32 output tokens, TTFT SLO {args.slo_ttft}; the autoscaler: --target-concurrency "
             f"{args.target_concurrency} --stable-window {args.stable_window} --panic-window {args.panic_window}"]  # fmt: skip
    for name, (lo, hi) in variants.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = " ".join(replica_flags(args))
        cmd = [sys.executable, "-m", "fulcrum.cli", "autoscale", str(BUNDLED), "--port", str(port), "--min", str(lo),
               "--max", str(hi), "--policy", "least-load", "--serve-arg", serve, "--tick", "0.5",
               "--target-concurrency", str(args.target_concurrency), "--stable-window", str(args.stable_window),
               "--panic-window", str(args.panic_window), "--drain-timeout", "30", "--log-level", "warning",
               "--log-dir", str(res / "replica-logs")]  # fmt: skip
        (res / "replica-logs").mkdir(exist_ok=True)
        with process(cmd, url, res / f"autoscale-{lo}-{hi}.log", timeout=300):
            while counter(get(f"{url}/metrics"), "fulcrum_router:replicas") < lo:
                time.sleep(0.5)
            watch = PoolWatcher(url)
            watch.start()
            la0 = load_avg()
            doc = bench(url, res / f"autoscale-{lo}-{hi}.json", *load)
            time.sleep(args.tail_s)  # the quiet after: the scale-down
            watch.stop_flag.set()
            watch.join()
            la1 = load_avg()
        samples = watch.samples
        rep_s = sum((b[0] - a[0]) * a[1] for a, b in zip(samples, samples[1:]))
        events = [(t, n) for (t, n), (_, m) in zip(samples[1:], samples) if n != m]
        ok = sum(r["summary"]["completed"] for r in doc["runs"])
        failed = sum(r["summary"]["failed"] for r in doc["runs"])
        att = [r["summary"].get("slo_attainment", 0.0) for r in doc["runs"]]
        n_req = [r["summary"]["completed"] + r["summary"]["failed"] for r in doc["runs"]]
        overall = sum(a * n for a, n in zip(att, n_req)) / max(sum(n_req), 1)
        ttft = [r["summary"]["ttft_ms"]["p90"] for r in doc["runs"]]
        timeline = " ".join(f"{t:.0f}s:{n}" for t, n in [samples[0], *events]) if samples else "none"
        lines.append(f"  {name:>13}: SLO attainment {overall:.2f} (phases {' / '.join(f'{a:.2f}' for a in att)}), "
                     f"TTFT p90 by phase {' / '.join(f'{x:.0f}' for x in ttft)} ms, {rep_s:.0f} replica-seconds "
                     f"over {samples[-1][0]:.0f} s, {len(events)} pool changes [{timeline}], {ok} requests done, "
                     f"{failed} failed; load {la0} -> {la1}")  # fmt: skip
        print(lines[-1], flush=True)
        (res / f"autoscale-{lo}-{hi}-pool.json").write_text(json.dumps(samples))
    return lines


# -- events: what publishing costs the step loop ----------------------------------------------------------------


def _count_events(endpoint: str, counts, stop) -> None:
    import zmq

    from fulcrum.utils.kv_event_schema import decoder

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dec = decoder()
    while not stop.is_set():
        if sub.poll(100):
            batch = dec.decode(sub.recv_multipart()[2])
            counts[0] += 1
            counts[1] += len(batch.events)
    sub.close(0)
    ctx.term()


def events_cost(args, res: Path) -> list[str]:
    """The same offline batch with KV events published (to a subscriber that reads them all) and without, rounds
    alternating: wall time of generate(), and the step path's own time in the event code, call by call."""
    from fulcrum.engine.llm import LLM
    from fulcrum.sampling_params import SamplingParams

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = dict(kv_cache_memory=args.kv_blocks * 16 * 8192, max_model_len=512, cpu_threads=1, cpu_bind="none")
    on = LLM(**common, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    off = LLM(**common)
    # the subscriber in a process of its own, as a router is: its decoding takes no GIL from the step loop
    mpctx = mp.get_context("spawn")
    counts, stop = mpctx.Array("q", 2), mpctx.Event()
    reader = mpctx.Process(target=_count_events, args=(endpoint, counts, stop), daemon=True)
    reader.start()
    time.sleep(2.0)  # the child imports and subscribes
    # the step path's own share, timed where it runs: recording events in the cache manager and enqueueing them
    spent = {"s": 0.0, "steps": 0}
    calls: list[float] = []  # each call's time: the median is the code's cost, the mean also the OS's preemptions

    def timed(fn, count_step=False):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                spent["s"] += dt
                spent["steps"] += count_step
                calls.append(dt)

        return wrapper

    on.core.kv._record_stored = timed(on.core.kv._record_stored)
    on.core.kv.take_events = timed(on.core.kv.take_events)
    on.core.kv_events.publish = timed(on.core.kv_events.publish, count_step=True)
    text = (BUNDLED.parent.parent / "README.md").read_text()[:4000]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {"events on": [], "events off": []}
    for rnd in range(args.rounds * 2 + 1):
        # distinct prompts each round, longer than the cache holds in all: blocks are stored and evicted
        prompts = [f"{rnd} {i} " + text[(i * 97) % 2000 :][:600] for i in range(48)]
        order = [("events on", on), ("events off", off)] if rnd % 2 == 0 else [("events off", off), ("events on", on)]
        for name, llm in order:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
    time.sleep(0.5)
    stop.set()
    reader.join(10)
    got = {"batches": counts[0], "events": counts[1]}
    m_on, m_off = statistics.median(times["events on"]), statistics.median(times["events off"])
    return [
        f"events: offline generate() of 48 distinct ~150-token prompts x 16 tokens, {args.kv_blocks}-block cache, one "
        f"thread; {len(times['events on'])} rounds each, alternating (load {load_avg()})",
        f"  events on  {m_on:.2f} s median [{min(times['events on']):.2f}-{max(times['events on']):.2f}], "
        f"events off {m_off:.2f} s [{min(times['events off']):.2f}-{max(times['events off']):.2f}]: "
        f"ratio {m_on / m_off:.3f}; the subscriber read {got['batches']} batches, {got['events']} events "
        f"(publisher dropped {on.core.kv_events.dropped})",
        f"  on the step path: {spent['s'] * 1e6 / max(spent['steps'], 1):.1f} us per step recording and enqueueing "
        f"({spent['s'] / sum(times['events on']) * 100:.3f}% of the events-on wall time, {spent['steps']} steps); "
        f"one call's median {statistics.median(calls) * 1e6:.1f} us, p99 {sorted(calls)[int(len(calls) * 0.99)] * 1e6:.0f}"
        f" us, max {max(calls) * 1e3:.1f} ms over {len(calls)} calls (recording, encoding, the non-blocking send);"
        " ZeroMQ's I/O thread does the sending on the same 2 cores",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="policies,autoscale")
    p.add_argument("--results", default=str(Path(__file__).parent / "results" / "router"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=96, help="each replica's KV cache, in 16-token blocks")
    # odd: the workload cycles through the groups, so with an even count round-robin would keep each on one replica
    p.add_argument("--groups", type=int, default=7)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--phases", default="0.5,6,0.5", help="request rates of the autoscale phases")
    p.add_argument("--phase-s", type=float, default=25.0)
    p.add_argument("--tail-s", type=float, default=15.0, help="quiet seconds watched after the load")
    p.add_argument("--slo-ttft", default="500ms")
    p.add_argument("--target-concurrency", type=float, default=2.0)
    p.add_argument("--stable-window", type=float, default=12.0)
    p.add_argument("--panic-window", type=float, default=3.0)
    args = p.parse_args()
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU flags: {cpu_flags()}; "
             f"{os.cpu_count()} cores; load average at start {load_avg()}"]  # fmt: skip
    for name in args.only.split(","):
        lines += {"policies": policies, "autoscale": autoscale, "events": events_cost}[name](args, res)
    lines.append(f"load average at the end {load_avg()}")
    print("\n".join(lines))
    (res / f"summary-{'-'.join(args.only.split(','))}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
