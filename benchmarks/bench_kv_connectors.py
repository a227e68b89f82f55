"""KV transfer time against prefill time per request, for each connector, between two engine processes on this
host: a producer (its own process, one compute thread) prefills a fresh random prompt (max_tokens 1) and offers
its blocks; the consumer (this process) pulls them and computes the tail. Reported per connector and prompt length:
the producer's prefill, the consumer's pull (control round trip, the producer's copy out of its cache, the move,
the copy into the consumer's cache), the bytes, and what layer-wise transfer overlapped with the prefill could
save at most: with L layers, layer l's blocks leave while layers l+1.. compute, so the last byte lands at
max(P + T/L, P/L + T) instead of P + T: a saving of min(P, T) * (1 - 1/L). Medians over --reps prompts.

    python benchmarks/bench_kv_connectors.py [--model bundled|qwen05] [--prompt-len 512 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_summary, model_folder  # noqa: E402

CONNECTORS = ("ZmqConnector", "SharedMemoryConnector", "TorchDistributedConnector")


def engine(folder: str, role: str, connector: str, dtype: str, kv_mb: int, max_len: int):
    from fulcrum.config import EngineConfig
    from fulcrum.engine.core import EngineCore

    cfg = {"kv_role": role, "kv_connector": connector, "lease_timeout_s": 60, "pull_timeout_s": 60, "secret": "bench"}
    return EngineCore(EngineConfig(model=folder, dtype=dtype, kv_cache_memory=kv_mb << 20, cpu_threads=1,
                                   cpu_bind="none", max_model_len=max_len, kv_transfer_config=cfg))  # fmt: skip


def run(core, rid: str, ids: list[int], params: dict) -> tuple[float, object]:
    from fulcrum.sampling_params import SamplingParams

    t0 = time.perf_counter()
    core.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), kv_transfer_params=params)
    last = None
    while core.has_unfinished_requests():
        for o in core.step():
            if o.request_id == rid and o.finish_reason:
                last = o
        if core.kv_transfer is not None and core.kv_transfer.busy():
            core.kv_transfer.wait(0.05)  # as the core process idles: no spinning against the pull thread
    return time.perf_counter() - t0, last


def producer(conn, folder: str, connector: str, dtype: str, kv_mb: int, max_len: int) -> None:
    core = engine(folder, "kv_producer", connector, dtype, kv_mb, max_len)
    conn.send("ready")
    while True:
        if not conn.poll(0.01):
            core.housekeeping()  # releases and lease ends, as the core process's idle loop does
            continue
        msg = conn.recv()
        if msg is None:
            break
        rid, ids = msg
        seconds, out = run(core, rid, ids, {"do_remote_decode": True})
        conn.send((seconds, out.kv_transfer_params))
    core.shutdown()


def measure(args, folder: Path, connector: str, vocab: int) -> list[dict]:
    import torch

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    max_len = max(args.prompt_len) + 16
    proc = ctx.Process(target=producer, args=(there, str(folder), connector, args.dtype, args.kv_mb, max_len),
                       daemon=True)  # fmt: skip
    proc.start()
    consumer = engine(str(folder), "kv_consumer", connector, args.dtype, args.kv_mb, max_len)
    here.recv()
    g = torch.Generator().manual_seed(1)
    rows = []
    try:
        for n in args.prompt_len:
            for rep in range(args.reps + 1):  # the first is a warm-up (pairing, first-touch of the cache)
                ids = torch.randint(10, vocab, (n,), generator=g).tolist()
                here.send((f"{connector}-{n}-{rep}", ids))
                prefill_s, params = here.recv()
                s0 = consumer.stats()
                consumer_s, _ = run(consumer, f"c-{n}-{rep}", ids, params)
                s1 = consumer.stats()
                assert s1.kv_transfer_fallbacks == s0.kv_transfer_fallbacks, "a pull failed"
                if rep:
                    rows.append(dict(connector=connector, prompt_len=n, prefill_s=prefill_s,
                                     pull_s=s1.kv_transfer_seconds - s0.kv_transfer_seconds,
                                     bytes=s1.kv_transfer_bytes_received - s0.kv_transfer_bytes_received,
                                     consumer_s=consumer_s))  # fmt: skip
                consumer.housekeeping()
    finally:
        here.send(None)
        proc.join(30)
        consumer.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled, qwen05 (random weights, Qwen2.5-0.5B shape), a folder")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[512, 1000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-mb", type=int, default=128)
    p.add_argument("--connectors", nargs="+", default=list(CONNECTORS))
    p.add_argument("--work-dir", default="/tmp/fulcrum-bench")
    p.add_argument("--log", default=None, help="append the table to this file")
    args = p.parse_args()
    folder = model_folder(args)
    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    lines = [cpu_summary(), f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}",
             f"model {folder.name} ({layers} layers, dtype {args.dtype}); producer and consumer: 1 compute thread "
             f"each, separate processes; medians of {args.reps} fresh prompts"]  # fmt: skip
    header = "connector                   tokens  prefill ms  pull ms  MiB    MB/s   pull/prefill  layer-wise saves"
    lines.append(header)
    for connector in args.connectors:
        rows = measure(args, folder, connector, cfg["vocab_size"])
        for n in args.prompt_len:
            mine = [r for r in rows if r["prompt_len"] == n]
            pre = statistics.median(r["prefill_s"] for r in mine)
            pull = statistics.median(r["pull_s"] for r in mine)
            mib = statistics.median(r["bytes"] for r in mine) / 2**20
            save = min(pre, pull) * (1 - 1 / layers)
            lines.append(f"{connector:<27} {n:>6}  {pre * 1e3:>10.1f}  {pull * 1e3:>7.2f}  {mib:>5.1f}  "
                         f"{mib * 1.048576 / pull:>6.0f}  {pull / pre:>11.3f}  {save * 1e3:>6.2f} ms "
                         f"({save / (pre + pull):.1%})")  # fmt: skip
            print(lines[-1], flush=True)
    lines.append(f"load average at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print("\n".join(lines))
    if args.log:
        with open(args.log, "a") as f:
            f.write(
                f"$ python benchmarks/bench_kv_connectors.py {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n\n"
            )


if __name__ == "__main__":
    main()
