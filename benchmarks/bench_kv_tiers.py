"""The KV offload tiers (host memory and disk under the KV pool) through `fulcrum serve`, over HTTP:

1. Shared documents, revisited: D documents of L random tokens (seeded); each request is one document and a short
   question of its own (--question-len tokens), greedy, --max-tokens output tokens (ignore_eos). Every document is
   asked about --visits times, in a seeded random order, and the KV pool (--kv-cache-memory, sized from the
   model's bytes per token) holds a fraction of the documents (--working-set-ratio, default 4: the documents'
   tokens are 4x the pool's), so most documents come back after the pool has turned over. The requests go at a
   fixed concurrency (streamed: TTFT is measured by the client) to one fresh server per configuration:
   - off:  plain prefix caching (the pool only);
   - on:   --kv-offloading-size (room for the whole working set) and --kv-offload-dir (a fresh directory);
   - disk: --kv-offload-dir alone (a fresh directory).
   Reported per configuration: TTFT p50/p90, output tok/s and requests/s, the prefix hit rate overall and per tier
   (pool/ram/disk, from /metrics before and after: fulcrum:prefix_cache_{queries,hits}_total and
   fulcrum:kv_offload_hit_tokens_total{tier}; pool = hits - ram - disk), and whether each request's greedy output
   is the same text as in the first configuration.
2. Warm restart: a server with --kv-offload-dir (a fresh directory) answers one long prompt (cold), stops; a new
   server on the same directory answers it again (warm: its prefix is read from disk), and once more (hot: a pool
   hit). Reported: TTFT cold/warm/hot, the warm answer's usage.prompt_tokens_details.cached_tokens, and whether the
   outputs match; --repeats pairs (each its own directory and prompt), min/median/max. Before the restart the block
   files are dropped from the OS page cache (posix_fadvise DONTNEED after fsync), so the warm reads come from the
   device (--keep-page-cache: from memory). Part 1's disk reads are of files just written: page-cache reads.

    python benchmarks/bench_kv_tiers.py [--model qwen05|bundled|PATH] [--configs off,on,disk] [--concurrency 2,4]
        [--num-docs 24 --doc-len 1024 --visits 4 --working-set-ratio 4] [--restart-len 4096 --repeats 3]
        [--out benchmarks/results/kv_tiers/bench-kv-tiers.json]

A quick smoke run on the bundled model:

    python benchmarks/bench_kv_tiers.py --model bundled --dtype float32 --num-docs 12 --doc-len 256 --visits 3 \\
        --concurrency 2 --restart-len 900 --repeats 1

Every server's log is kept under --work-dir/kv_tiers/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, cpu_summary, fulcrum_server, model_folder, print_table, save_json  # noqa: E402
from fulcrum.router.scrape import sample_totals  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kv_tiers" / "bench-kv-tiers.json"
CONFIGS = {  # name -> what it adds to the server's flags (filled in main: sizes and directories)
    "off": "plain prefix caching",
    "on": "--kv-offloading-size + --kv-offload-dir",
    "disk": "--kv-offload-dir only",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- the model's KV size ----------------------------------------------------------------------------------------------


def kv_bytes_per_token(folder: Path, dtype: str) -> tuple[int, int]:
    """The KV pool's bytes per token (k and v, every layer and KV head) in `dtype`, and the model's context."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    size = DTYPE_BYTES.get(dtype, DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), 2))
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size, cfg.get("max_position_embeddings", 4096)


def gib_for_blocks(blocks: int, per_block: int) -> str:
    """--kv-cache-memory in GiB that the engine turns into exactly `blocks` blocks (int(GiB * 2**30) // per_block)."""
    return repr((blocks * per_block + per_block // 2) / 2**30)


# -- HTTP -------------------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sample_totals(r.read().decode(), split_by="tier")


def tier_counts(before: dict[str, float], after: dict[str, float]) -> dict:
    """Prompt tokens looked up and found over a run, and where they were found."""

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    q, h = d("fulcrum:prefix_cache_queries_total"), d("fulcrum:prefix_cache_hits_total")
    ram = d("fulcrum:kv_offload_hit_tokens_total{ram}")
    disk = d("fulcrum:kv_offload_hit_tokens_total{disk}")
    out = {"queries": q, "hits": h, "pool": h - ram - disk, "ram": ram, "disk": disk}
    out.update({f"{k}_rate": (out[k] / q if q else 0.0) for k in ("hits", "pool", "ram", "disk")})
    # every other offload counter that moved (stores, errors, dropped or corrupt blocks, bytes)
    # (counters as the run's difference; gauges, such as the bytes a tier holds, as they stand after it)
    out["offload"] = {
        k: d(k) if "_total" in k else after[k]
        for k in sorted(after)
        if k.startswith("fulcrum:kv_offload") and "seconds" not in k
    }
    return out


async def stream_one(http, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy streamed completion: TTFT (first chunk with a choice), end-to-end time, text and usage."""
    import aiohttp

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    out = {"ttft": None, "text": "", "usage": None, "error": None}
    async with http.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1800)) as resp:
        if resp.status != 200:
            out["error"] = f"http {resp.status}: {(await resp.text())[:300]}"
            return out
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                out["error"] = str(chunk["error"])[:300]
                return out
            if chunk.get("choices"):
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                out["text"] += "".join(c.get("text") or "" for c in chunk["choices"])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
    out["e2e"] = time.perf_counter() - t0
    return out


async def run_load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """The prompts in order, `concurrency` in flight; every result and the wall time."""
    import aiohttp

    results: list[dict | None] = [None] * len(prompts)
    nxt = iter(range(len(prompts)))

    async def worker(http):
        for i in nxt:
            results[i] = await stream_one(http, url, prompts[i], max_tokens)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def one(url: str, prompt: list[int], max_tokens: int) -> dict:
    res, _ = asyncio.run(run_load(url, [prompt], 1, max_tokens))
    if res[0]["error"]:
        raise RuntimeError(f"request failed: {res[0]['error']}")
    return res[0]


# -- figures ----------------------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def ms3(s: dict) -> str:
    return f"{s['median'] * 1000:.0f} ({s['min'] * 1000:.0f}-{s['max'] * 1000:.0f})"


def reuse(order: list[int], pool_docs: float) -> dict:
    """Revisits of a document, and how many come after at least `pool_docs` other documents were asked about
    since its last visit (the pool has turned over: an LRU pool of that many documents no longer holds it)."""
    last: dict[int, int] = {}
    revisits = turned = 0
    for i, doc in enumerate(order):
        if doc in last:
            revisits += 1
            if len(set(order[last[doc] + 1 : i]) - {doc}) >= pool_docs:
                turned += 1
        last[doc] = i
    return {"revisits": revisits, "after_turnover": turned}


# -- part 1: shared documents -----------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def run_config(name, folder, flags, prompts, args, concurrency, warmup, log_dir) -> dict:
    log_path = log_dir / f"docs-{name}-c{concurrency}.log"
    with fulcrum_server(folder, *flags, log_path=log_path) as url:
        one(url, warmup, 4)  # the first steps build kernels and buffers: not measured
        before = scrape(url)
        results, wall = asyncio.run(run_load(url, prompts, concurrency, args.max_tokens))
        time.sleep(0.5)  # the engine's stats reach /metrics with its outputs; let the last land
        after = scrape(url)
    failed = [r["error"] for r in results if r["error"]]
    ok = [r for r in results if not r["error"]]
    if not ok:
        raise RuntimeError(f"{name}: every request failed ({failed[0]}); see {log_path}")
    ttft = [r["ttft"] for r in ok]
    cached = [((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok]
    # requests whose document came from a cache (any tier) against those that computed it: the p90 of a run is
    # mostly its misses' queueing, the p50 its hits'
    half = args.doc_len // 2
    hit_ttft = [t for t, c in zip(ttft, cached) if c >= half]
    miss_ttft = [t for t, c in zip(ttft, cached) if c < half]
    out_tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    return {
        "config": name,
        "concurrency": concurrency,
        "flags": flags,
        "log": str(log_path),
        "requests": len(results),
        "failed": len(failed),
        "errors": failed[:5],
        "wall_s": wall,
        "ttft_p50_s": pct(ttft, 50) if ttft else None,
        "ttft_p90_s": pct(ttft, 90) if ttft else None,
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "hits": len(hit_ttft),
        "ttft_p50_hits_s": pct(hit_ttft, 50) if hit_ttft else None,
        "ttft_p50_misses_s": pct(miss_ttft, 50) if miss_ttft else None,
        "ttft_p90_misses_s": pct(miss_ttft, 90) if miss_ttft else None,
        "ttft_each_s": ttft,
        "cached_each": cached,
        "output_tok_s": out_tokens / wall,
        "requests_s": len(ok) / wall,
        "cached_tokens": sum(
            ((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok
        ),
        "prefix": tier_counts(before, after),
        "texts": [r["text"] if not r["error"] else None for r in results],
    }


def shared_docs(args, folder, base_flags, per_token, vocab, log_dir) -> dict:
    rng = random.Random(args.seed)
    bs = args.block_size
    docs = [[rng.randrange(10, vocab) for _ in range(args.doc_len)] for _ in range(args.num_docs)]
    order = [d for d in range(args.num_docs) for _ in range(args.visits)]
    rng.shuffle(order)
    prompts = [docs[d] + [rng.randrange(10, vocab) for _ in range(args.question_len)] for d in order]
    warmup = [rng.randrange(10, vocab) for _ in range(args.doc_len // 2)]
    req_len = args.doc_len + args.question_len + args.max_tokens
    max_model_len = -(-req_len // bs) * bs
    per_block = per_token * bs
    # the pool: the documents' tokens / ratio, but at least room for every request in flight (no preemption)
    doc_blocks = args.num_docs * args.doc_len // bs
    want = int(doc_blocks // args.working_set_ratio)
    floor = max(args.concurrency) * (-(-req_len // bs) + 1)
    pool_blocks = max(want, floor)
    if pool_blocks > want:
        print(f"note: the pool needs {floor} blocks for {max(args.concurrency)} requests in flight, more than "
              f"1/{args.working_set_ratio:g} of the documents' {doc_blocks}; raise --num-docs for a larger ratio")  # fmt: skip
    ratio = doc_blocks / pool_blocks
    working_set = args.num_docs * args.doc_len * per_token
    ram_gib = max(2 * working_set / 2**30, 0.01)  # every document, its questions and outputs, with room to spare
    dir_gib = max(4 * working_set / 2**30, 0.1)
    pool_docs = pool_blocks * bs / (args.doc_len + args.question_len)
    turnover = reuse(order, pool_docs)
    # the most a perfect cache could find: every revisit's document, whole blocks of it
    ideal = turnover["revisits"] * (args.doc_len // bs * bs) / sum(len(p) for p in prompts)
    flags = [*base_flags, "--max-model-len", str(max_model_len), "--kv-cache-memory", gib_for_blocks(pool_blocks,
             per_block)]  # fmt: skip
    setup = {
        "num_docs": args.num_docs,
        "doc_len": args.doc_len,
        "question_len": args.question_len,
        "visits": args.visits,
        "requests": len(prompts),
        "max_tokens": args.max_tokens,
        "kv_bytes_per_token": per_token,
        "pool_blocks": pool_blocks,
        "pool_tokens": pool_blocks * bs,
        "pool_docs": pool_docs,
        "working_set_tokens": args.num_docs * args.doc_len,
        "working_set_bytes": working_set,
        "working_set_over_pool": ratio,
        "revisits": turnover["revisits"],
        "revisits_after_turnover": turnover["after_turnover"],
        "ideal_hit_rate": ideal,
        "ram_tier_gib": ram_gib,
        "disk_tier_cap_gib": dir_gib,
    }
    print(
        f"\nshared documents: {args.num_docs} x {args.doc_len} tokens, {args.visits} visits each, {len(prompts)} "
        f"requests (+{args.question_len} question tokens, {args.max_tokens} output); pool {pool_blocks} blocks = "
        f"{pool_blocks * bs} tokens = {pool_docs:.1f} requests' prompts ({pool_blocks * per_block / 2**20:.1f} MiB, "
        f"{per_token} B/token); working set / pool = {ratio:.1f}x; {turnover['after_turnover']}/"
        f"{turnover['revisits']} revisits come after the pool turned over; ideal hit rate {ideal:.0%}",
        flush=True,
    )
    runs = []
    for conc in args.concurrency:
        for name in args.configs:
            extra: list[str] = []
            tier_dir = log_dir / f"tier-{name}-c{conc}"
            shutil.rmtree(tier_dir, ignore_errors=True)
            if name == "on":
                extra += ["--kv-offloading-size", repr(ram_gib)]
            if name in ("on", "disk"):
                extra += ["--kv-offload-dir", str(tier_dir), "--kv-offload-dir-size", repr(dir_gib)]
            r = run_config(name, folder, [*flags, *extra], prompts, args, conc, warmup, log_dir)
            shutil.rmtree(tier_dir, ignore_errors=True)
            p = r["prefix"]
            print(
                f"  {name} c={conc}: TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, {r['requests_s']:.2f} req/s, hits "
                f"{p['hits_rate']:.0%} (pool {p['pool_rate']:.0%}, ram {p['ram_rate']:.0%}, disk {p['disk_rate']:.0%})"
                f", {r['failed']} failed, {r['wall_s']:.1f} s",
                flush=True,
            )
            runs.append(r)
    # greedy outputs against the first configuration at the same concurrency
    for conc in args.concurrency:
        same_c = [r for r in runs if r["concurrency"] == conc]
        ref = same_c[0]
        for r in same_c:
            diff = [i for i, (a, b) in enumerate(zip(ref["texts"], r["texts"])) if a is None or a != b]
            r["compared_with"] = ref["config"]
            r["mismatches"] = len(diff)
            r["mismatch_requests"] = diff[:20]
    rows = []
    for r in runs:
        p = r["prefix"]
        rows.append((
            r["config"], r["concurrency"], f"{r['ttft_p50_s'] * 1000:.0f}", f"{r['ttft_p90_s'] * 1000:.0f}",
            f"{r['hits']}: {ms(r['ttft_p50_hits_s'])}", f"{r['requests'] - r['hits']}: {ms(r['ttft_p50_misses_s'])}",
            f"{r['output_tok_s']:.1f}", f"{r['requests_s']:.2f}", f"{p['hits_rate']:.1%}", f"{p['pool_rate']:.1%}",
            f"{p['ram_rate']:.1%}", f"{p['disk_rate']:.1%}",
            f"{r['mismatches']}/{r['requests']}" + (f" vs {r['compared_with']}" if r["compared_with"] != r["config"]
                                                   else ""),
            r["failed"],
        ))  # fmt: skip
    print_table(
        f"shared documents, {folder.name} {args.dtype} (working set {ratio:.1f}x the pool; ideal hit rate {ideal:.0%})",
        rows,
        ("config", "conc", "TTFT p50 ms", "TTFT p90 ms", "hits: p50 ms", "misses: p50 ms", "out tok/s", "req/s", "hit", "pool", "ram", "disk",
         "output mismatches", "failed"),
    )  # fmt: skip
    ratios = {}
    for conc in args.concurrency:
        by = {r["config"]: r for r in runs if r["concurrency"] == conc}
        if "off" in by:
            for name, r in by.items():
                if name != "off" and r["ttft_p50_s"]:
                    ratios[f"ttft_p50_off_over_{name}_c{conc}"] = by["off"]["ttft_p50_s"] / r["ttft_p50_s"]
                    ratios[f"throughput_{name}_over_off_c{conc}"] = r["requests_s"] / by["off"]["requests_s"]
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    if any(r["mismatches"] for r in runs) and args.dtype != "float32":
        print("  (in 16-bit, KV computed in other batch shapes rounds differently and a random-weight model's "
              "near-tied logits flip greedy picks; --dtype float32 checks identity)")  # fmt: skip
    for r in runs:
        r.pop("texts")
    return {"setup": setup, "server_flags": flags, "runs": runs, "ratios": ratios}


# -- part 2: warm restart ---------------------------------------------------------------------------------------------


def dir_bytes(d: Path) -> tuple[int, int]:
    files = [f for f in d.rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def drop_page_cache(d: Path) -> int:
    """Write the directory's files back and drop them from the OS page cache (posix_fadvise DONTNEED, which needs
    no privileges), so that the next reads come from the device; returns how many files."""
    import os

    n = 0
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def warm_restart(args, folder, base_flags, per_token, context, vocab, log_dir) -> dict:
    plen = min(args.restart_len, context - args.max_tokens)
    flags = [*base_flags, "--max-model-len", str(plen + args.max_tokens), "--kv-cache-memory", str(args.kv_cache_gb)]
    print(f"\nwarm restart: a {plen}-token prompt, {args.max_tokens} output tokens, {args.repeats} pair(s)", flush=True)
    pairs = []
    for rep in range(args.repeats):
        rng = random.Random(args.seed + 1000 + rep)
        prompt = [rng.randrange(10, vocab) for _ in range(plen)]
        tier_dir = log_dir / f"restart-{rep}"
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = ["--kv-offload-dir", str(tier_dir)]
        with fulcrum_server(folder, *flags, *tier, log_path=log_dir / f"restart-{rep}-cold.log") as url:
            one(url, [rng.randrange(10, vocab) for _ in range(256)], 4)
            t0 = time.perf_counter()
            cold = one(url, prompt, args.max_tokens)
            cold_metrics = scrape(url)
        stop_s = time.perf_counter() - t0 - cold["e2e"]  # the answer's end to the server's exit (its last writes)
        files, nbytes = dir_bytes(tier_dir)
        if not args.keep_page_cache:
            drop_page_cache(tier_dir)
        with fulcrum_server(folder, *flags, *tier, log_path=log_dir / f"restart-{rep}-warm.log") as url:
            one(url, [rng.randrange(10, vocab) for _ in range(256)], 4)
            before = scrape(url)
            warm = one(url, prompt, args.max_tokens)
            mid = scrape(url)
            hot = one(url, prompt, args.max_tokens)
            time.sleep(0.5)
            after = scrape(url)
        shutil.rmtree(tier_dir, ignore_errors=True)
        details = lambda r: (r["usage"] or {}).get("prompt_tokens_details") or {}  # noqa: E731
        pair = {
            "prompt_tokens": (warm["usage"] or {}).get("prompt_tokens"),
            "ttft_cold_s": cold["ttft"],
            "ttft_warm_s": warm["ttft"],
            "ttft_hot_s": hot["ttft"],
            "cold_over_warm": cold["ttft"] / warm["ttft"],
            "cached_tokens_cold": details(cold).get("cached_tokens"),
            "cached_tokens_warm": details(warm).get("cached_tokens"),
            "cached_tokens_hot": details(hot).get("cached_tokens"),
            "disk_hit_tokens_warm": tier_counts(before, mid)["disk"],
            "disk_stored_blocks_cold": cold_metrics.get("fulcrum:kv_offload_stored_blocks_total{disk}", 0.0),
            "block_files": files,
            "block_bytes": nbytes,
            "stop_s": stop_s,
            "outputs_match": cold["text"] == warm["text"] == hot["text"],
            "warm_server_offload": tier_counts(before, after)["offload"],
        }
        pairs.append(pair)
        print(
            f"  pair {rep}: TTFT cold {cold['ttft'] * 1000:.0f} ms, warm {warm['ttft'] * 1000:.0f} ms, hot "
            f"{hot['ttft'] * 1000:.0f} ms; cached tokens warm {pair['cached_tokens_warm']}/{pair['prompt_tokens']}; "
            f"{files} files ({nbytes / 2**20:.1f} MiB); outputs match: {pair['outputs_match']}",
            flush=True,
        )
    summary = {k: spread([p[k] for p in pairs]) for k in ("ttft_cold_s", "ttft_warm_s", "ttft_hot_s", "cold_over_warm")}
    rows = [
        ("TTFT cold (new server, empty dir) ms", ms3(summary["ttft_cold_s"])),
        ("TTFT warm (restarted, from disk) ms", ms3(summary["ttft_warm_s"])),
        ("TTFT hot (same server again, pool) ms", ms3(summary["ttft_hot_s"])),
        ("cold / warm", "{median:.2f}x ({min:.2f}-{max:.2f})".format(**summary["cold_over_warm"])),
        ("cached tokens warm", ", ".join(f"{p['cached_tokens_warm']}/{p['prompt_tokens']}" for p in pairs)),
        ("outputs match", ", ".join(str(p["outputs_match"]) for p in pairs)),
    ]
    print_table(f"warm restart, {folder.name} {args.dtype}, {plen}-token prompt (median (min-max) of "
                f"{args.repeats})", rows, ("", "median (min-max)"))  # fmt: skip
    return {"prompt_len": plen, "server_flags": flags, "pairs": pairs, "summary": summary}


# -- main -------------------------------------------------------------------------------------------------------------


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(out=str(DEFAULT_OUT))
    p.add_argument("--configs", default="off,on", help="comma list of off, on (ram + disk), disk (default off,on)")
    p.add_argument("--concurrency", type=int_list, default=[4], help="comma list, one run per value (default 4)")
    p.add_argument("--num-docs", type=int, default=24)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--visits", type=int, default=4, help="requests per document")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--working-set-ratio", type=float, default=4.0, help="documents' tokens / pool tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--restart-len", type=int, default=4096, help="warm restart prompt (capped by the context)")
    p.add_argument("--repeats", type=int, default=3, help="warm restart pairs")
    p.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="warm restart: leave the block files in the OS page cache (default: dropped, read from disk)",
    )
    p.add_argument("--skip", choices=("docs", "restart"), default=None, help="leave out one part")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    if bad := [c for c in args.configs if c not in CONFIGS]:
        p.error(f"unknown --configs {bad}; choose from {list(CONFIGS)}")
    folder = model_folder(args)
    per_token, context = kv_bytes_per_token(folder, args.dtype)
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size", 32000)
    log_dir = Path(args.work_dir) / "kv_tiers"
    log_dir.mkdir(parents=True, exist_ok=True)
    base = ["--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
            "--seed", str(args.seed)]  # fmt: skip
    print(cpu_summary())
    print(f"model {folder} ({args.dtype}, {args.device}); server logs and tier directories under {log_dir}")
    data = {
        "cpu": cpu_summary(),
        "argv": sys.argv[1:],
        "args": {k: v for k, v in vars(args).items()},
        "model": str(folder),
        "configs": {c: CONFIGS[c] for c in args.configs},
    }
    if args.skip != "docs":
        data["shared_docs"] = shared_docs(args, folder, base, per_token, vocab, log_dir)
    if args.skip != "restart":
        data["warm_restart"] = warm_restart(args, folder, base, per_token, context, vocab, log_dir)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_json(args.out, data)
        print(f"\nfigures in {args.out}")


if __name__ == "__main__":
    main()
