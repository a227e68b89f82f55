"""Shared pieces of the benchmarks: the workload, the random-weight 0.5B-shape model, bandwidth."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import fulcrum  # noqa: F401  (early: under FULCRUM_CPU_ISA it caps torch's kernels before any op runs)

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "fulcrum" / "bundled" / "tiny-shakespeare-target"

# Qwen2.5-0.5B's shape, random weights
QWEN05_SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def qwen05_model(folder: Path, dtype=torch.bfloat16) -> Path:
    """Save (once) a random-weight model with Qwen2.5-0.5B's shape, in HF format."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN05_SHAPE)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    from fulcrum.utils.tokenizer import copy_tokenizer

    copy_tokenizer(BUNDLED, folder)
    return folder


def workload(n: int, vocab: int, prompt=(64, 512), output=(32, 256), seed: int = 0):
    """n requests: (prompt token ids, output length), lengths uniform in the given ranges."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        o = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
        reqs.append((torch.randint(10, vocab, (p,), generator=g).tolist(), o))
    return reqs


def memory_bandwidth_gbs(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: the best of several sums over a buffer far larger than any cache."""
    x = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def print_table(title: str, rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n== {title}")
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def save_json(path: Path | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1))


def add_model_args(p: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    p.add_argument(
        "--model", default="qwen05", help="qwen05 (random weights, Qwen2.5-0.5B shape), bundled, or a folder"
    )
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=None, help="write the figures as JSON")


def model_folder(args: argparse.Namespace) -> Path:
    if args.model == "qwen05":
        return qwen05_model(Path(args.work_dir) / "qwen2.5-0.5b-shape")
    if args.model == "bundled":
        return BUNDLED
    return Path(args.model)


@contextlib.contextmanager
def fulcrum_server(folder: Path, *flags: str, log_path: Path | None = None):
    """`fulcrum serve` on a free loopback port, healthy before it is yielded (its base URL), stopped after."""
    from fulcrum.utils.serve_process import start

    with start(folder, "--log-level", "warning", *flags, log_path=log_path) as server:
        yield server.url


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def in_turn(fns: dict, rounds: int, passes: int) -> dict[str, list[float]]:
    """Each of `fns` (name -> a call) timed in turn, `rounds` times: a call to warm it, then the best of `passes`
    calls, in ms. Alternating the candidates within each round keeps the VM's drift out of their comparison."""
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            best = float("inf")
            for _ in range(passes):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            runs[name].append(best * 1e3)
    return runs


def add_attention_kernel_args(p: argparse.ArgumentParser, kernel: str) -> None:
    """The flags both attention kernel benches take: the bundled model's head shape and dtype by default, rounds,
    `--against` another source of `kernel` (its file in csrc/), `--out`."""
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--against", help=f"another {kernel}, timed in turn with today's")
    p.add_argument("--out", type=Path)


def kernel_build(source: str, kernel: str, defines: dict | None = None):
    """Another source of one of fulcrum's CPU attention kernels (`kernel`: its file in csrc/, for the bindings), built
    at the level cpu_attention builds today's; exits with one line where it is missing, binds differently or does not
    build (the benches' `--against`)."""
    from fulcrum.errors import KernelBindingError
    from fulcrum.kernels import cpu_attention, cpu_ext

    if not Path(source).is_file():
        raise SystemExit(f"--against: no such file: {source}")
    try:
        lib = cpu_ext.load(source, cpu_attention.level(), cpu_attention.BINDINGS[kernel], defines=defines)
    except KernelBindingError as e:
        raise SystemExit(f"--against: {e}") from None
    if lib is None:
        raise SystemExit(f"--against: {source} did not build (the compiler's error is in the log above)")
    return lib


def cpu_summary() -> str:
    """One line for the top of a benchmark's output: the CPU, its cores and the ISA flags the kernels look at."""
    name, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    have = " ".join(f for f in ISA_FLAGS if f in flags) or "none of avx2/avx512/amx"
    from fulcrum.kernels import cpu_ext

    forced = f" (FULCRUM_CPU_ISA={os.environ['FULCRUM_CPU_ISA']})" if os.environ.get("FULCRUM_CPU_ISA") else ""
    return (
        f"{name}, {len(os.sched_getaffinity(0))} cores, flags: {have}, torch {torch.__version__}; "
        f"fulcrum kernels at {cpu_ext.isa()}{forced}, torch ops at {torch.backends.cpu.get_cpu_capability()}"
    )


def matmul_floor(model, reqs, dtype: str) -> dict:
    """The workload's weight-matmul FLOPs and the time they take at the GEMM rate this machine gives now.

    Every prompt token and every fed-back output token (all but the last of each request) goes through each
    layer's linear weights once; the LM head runs once per generated token. Attention's FLOPs are not counted,
    so the floor is a lower bound. The rate is the engine's dense linear's best (F.linear, or oneDNN's prepacked
    weight on AMX) over a prefill-sized and a batched-decode-sized
    [m, hidden] @ [hidden, intermediate], measured now, in the run it is compared with."""
    from fulcrum.probe.machine import measure_matmul_flops

    layer_weights = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    hidden, vocab = model.lm_head.weight.shape[1], model.lm_head.weight.shape[0]
    tokens = sum(len(p) for p, _ in reqs) + sum(o - 1 for _, o in reqs)
    flops = 2 * layer_weights * tokens + 2 * hidden * vocab * sum(o for _, o in reqs)
    inter = max(p.shape[0] for p in model.model.layers[0].parameters() if p.dim() == 2)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    rates = {m: measure_matmul_flops(short, m, hidden, inter) for m in (64, 512)}
    rate = max(rates.values())
    return {"matmul_flops": flops, "gemm_flops_per_s": rate, "gemm_rates": rates, "floor_s": flops / rate}


STEP_FLOOR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)


def step_matmul_floor(model, steps: list[tuple[int, int]], dtype: str) -> dict:
    """The same weight matmuls as `matmul_floor`, each engine step's at the rate the engine's linear gives for that
    step's row count: `steps` holds (rows through the layers, rows through the LM head) per step. A decode step of a
    few sequences cannot run at a 512-row GEMM's rate: it reads every weight once for a few rows (bandwidth-bound),
    which the FLOP floor does not see. The rates are measured now on [m, hidden] @ [hidden, intermediate] at
    STEP_FLOOR_ROWS (the GEMV at few rows, the dense or packed matmul past them, as the engine picks) and
    interpolated between; the LM head's rows take the rate of their own count. Attention is not counted: still a
    lower bound."""
    from fulcrum.probe.machine import measure_matmul_flops

    layer_weights = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    hidden, vocab = model.lm_head.weight.shape[1], model.lm_head.weight.shape[0]
    inter = max(p.shape[0] for p in model.model.layers[0].parameters() if p.dim() == 2)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    grid = [m for m in STEP_FLOOR_ROWS if m <= max(r for r, _ in steps)] or [1]
    grid = sorted({*grid, min((m for m in STEP_FLOOR_ROWS if m >= max(r for r, _ in steps)), default=grid[-1])})
    rates = {m: measure_matmul_flops(short, m, hidden, inter, repeats=3) for m in grid}

    def rate(rows: int) -> float:
        if rows <= grid[0]:
            return rates[grid[0]]
        for lo, hi in zip(grid, grid[1:]):
            if rows <= hi:
                return rates[lo] + (rates[hi] - rates[lo]) * (rows - lo) / (hi - lo)
        return rates[grid[-1]]

    seconds = sum(
        2 * layer_weights * r / rate(r) + (2 * hidden * vocab * lm / rate(lm) if lm else 0) for r, lm in steps if r
    )
    return {"steps": len(steps), "gemm_rates_by_rows": rates, "floor_s": seconds}
