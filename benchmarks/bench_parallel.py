"""Parallelism on this CPU, each figure against one process in the same run:

1. memory per rank: weight bytes and KV bytes per block of every rank under TP=2, PP=2 and TP=2 x PP=2, against
   TP=1 (each rank's part of the model built here as that rank would build it; no processes needed);
2. communication per step over gloo between two processes on this machine: the all-reduce TP does twice per layer,
   the send of hidden states between pipeline stages, and the broadcast of a step's inputs;
3. throughput and batch-1 decode of TP=2, PP=2 and DP=2 against TP=1 at equal total cores (each rank or engine one
   thread, TP=1 two), on the Qwen2.5-0.5B shape in fp32; rounds alternate the configurations.

    python benchmarks/bench_parallel.py [--rounds 2] [--requests 8] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from benchmarks.common import print_table, qwen05_model, workload
from fulcrum.config import ModelConfig
from fulcrum.distributed import parallel_state
from fulcrum.distributed.parallel_state import ParallelState, stage_and_tp_rank
from fulcrum.engine.llm import LLM
from fulcrum.engine.step_inputs import StepInputs
from fulcrum.layers.attention import Attention
from fulcrum.models.loader import load_model
from fulcrum.sampling_params import SamplingParams

MODEL = Path(tempfile.gettempdir()) / "fulcrum-bench" / "qwen2.5-0.5b-shape"


def machine() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{os.cpu_count()} CPUs, flags {' '.join(isa)}, load average {os.getloadavg()[0]:.1f}"


# -- 1. memory per rank ---------------------------------------------------------------------------


def rank_memory(model_config: ModelConfig, tp: int, pp: int) -> list[tuple[int, int, int]]:
    """(rank, weight bytes, KV bytes per 16-token block) of every rank, each rank's model built as it would be."""
    out = []
    for rank in range(tp * pp):
        stage, tp_rank = stage_and_tp_rank(rank, tp, pp)
        parallel_state._STATE = ParallelState(rank, tp * pp, tp_rank, tp, stage, pp)
        try:
            model = load_model(model_config)
        finally:
            parallel_state.set_single_process()
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        per_block = 16 * sum(
            m.kv_bytes_per_token(model_config.dtype, None) for m in model.modules() if isinstance(m, Attention)
        )
        out.append((rank, weights, per_block))
        del model
    return out


# -- 2. communication -----------------------------------------------------------------------------


def _comm_rank(rank: int, port: int, hidden: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = {}

    def timed(fn, n=200):
        for _ in range(10):
            fn()
        dist.barrier()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    for tokens in (1, 16, 256, 2048):
        x = torch.randn(tokens, hidden)
        rows[f"all-reduce [{tokens}, {hidden}] fp32"] = timed(lambda x=x: dist.all_reduce(x))
        y = torch.empty_like(x)
        rows[f"send+recv [{tokens}, {hidden}] fp32"] = timed(
            lambda x=x, y=y: dist.send(x, 1) if rank == 0 else dist.recv(y, 0)
        )
    step = StepInputs(ids=list(range(16)), positions=list(range(100, 116)), slots=list(range(16)), query_lens=[1] * 16)
    step.decode_idx, step.decode_ctx = list(range(16)), [101] * 16
    step.decode_tables, step.logits_rows = [list(range(8))] * 16, list(range(16))
    rows["broadcast of a 16-decode step's inputs"] = timed(lambda: dist.broadcast_object_list([("step", [step])], 0))
    if rank == 0:
        results.update(rows)
    dist.destroy_process_group()


def communication(hidden: int) -> dict[str, float]:
    from fulcrum.utils.serve_process import free_port

    with tmp.Manager() as m:
        results = m.dict()
        tmp.spawn(_comm_rank, args=(free_port(), hidden, results), nprocs=2, join=True)
        return dict(results)


# -- 3. throughput --------------------------------------------------------------------------------


CONFIGS = {
    "TP=1 (2 threads)": dict(cpu_threads=2),
    "TP=1 (1 thread)": dict(cpu_threads=1),
    "TP=2 (1 thread per rank)": dict(tensor_parallel_size=2, cpu_threads=1),
    "PP=2 (1 thread per rank)": dict(pipeline_parallel_size=2, cpu_threads=1),
    "DP=2 (1 thread per engine)": dict(data_parallel_size=2, cpu_threads=1),
}


MOE_CONFIGS = {
    "TP=1 (2 threads)": dict(cpu_threads=2),
    "TP=1 (1 thread)": dict(cpu_threads=1),
    "TP=2, experts sliced": dict(tensor_parallel_size=2, cpu_threads=1),
    "TP=2, EP (whole experts)": dict(tensor_parallel_size=2, enable_expert_parallel=True, cpu_threads=1),
}


def measure(model: Path, kwargs: dict, reqs) -> tuple[float, float]:
    """(throughput tok/s over the batch, batch-1 decode tok/s) of one configuration."""
    llm = LLM(str(model), dtype="float32", kv_cache_memory=512 << 20, max_model_len=2048, **kwargs)
    try:
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        throughput = sum(o for _, o in reqs) / (time.perf_counter() - t0)
        one = [{"prompt_token_ids": list(range(100, 164))}]
        t0 = time.perf_counter()
        llm.generate(one, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(one, SamplingParams(max_tokens=33, ignore_eos=True), use_tqdm=False)
        decode = 32 / max(time.perf_counter() - t0 - first, 1e-9)
    finally:
        llm.shutdown()
    return throughput, decode


def compare(model: Path, configs: dict, reqs, rounds: int, title: str) -> None:
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    for r in range(rounds):
        for name, kwargs in configs.items():
            results[name].append(measure(model, kwargs, reqs))
            print(f"  round {r} {name}: {results[name][-1][0]:.1f} tok/s, batch-1 {results[name][-1][1]:.1f} tok/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    first = next(iter(results))
    ref_t, ref_d = max(t for t, _ in results[first]), max(d for _, d in results[first])
    table = []
    for name, runs in results.items():
        t, d = max(x for x, _ in runs), max(y for _, y in runs)
        spread_t = f"{min(x for x, _ in runs):.1f}-{t:.1f}"
        spread_d = f"{min(y for _, y in runs):.1f}-{d:.1f}"
        table.append((name, spread_t, f"{t / ref_t:.2f}x", spread_d, f"{d / ref_d:.2f}x"))
    print_table(
        f"{title} (prompts 64-128, 32 tokens out) and batch-1 decode (32 tokens after 64), 2 cores in all, "
        f"best of {rounds} rounds (range)",
        table, ("config", "throughput tok/s", f"x {first}", "batch-1 tok/s", f"x {first}"),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    args = ap.parse_args()
    print(f"machine: {machine()}, torch {torch.__version__}")
    qwen05_model(MODEL)
    mc = ModelConfig.from_path(MODEL, "float32")
    rows = []
    base = None
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        ranks = rank_memory(mc, tp, pp)
        base = base or ranks[0]
        for rank, w, kv in ranks:
            rows.append(
                (f"TP={tp} PP={pp}", rank, f"{w / 2**20:.0f}", f"{w / base[1]:.2f}", f"{kv / 1024:.0f}",
                 f"{kv / base[2]:.2f}")
            )  # fmt: skip
    print_table(
        "memory per rank, Qwen2.5-0.5B shape fp32 (KV: one 16-token block)",
        rows, ("config", "rank", "weights MiB", "x TP=1", "KV KiB/block", "x TP=1"),
    )  # fmt: skip
    comm = communication(mc.hf_config.hidden_size)
    print_table(
        "gloo between two processes on this machine, median of 200 (microseconds)",
        [(k, f"{v:.0f}") for k, v in comm.items()], ("operation", "us"),
    )  # fmt: skip
    layers = mc.hf_config.num_hidden_layers
    ar1 = comm[f"all-reduce [1, {mc.hf_config.hidden_size}] fp32"]
    print(
        f"  -> TP=2 batch-1 decode pays 2 all-reduces x {layers} layers + the head's gather: ~{2 * layers * ar1 / 1e3:.1f} ms a step"
    )
    if args.skip_throughput:
        return
    reqs = workload(args.requests, mc.hf_config.vocab_size, prompt=(64, 128), output=(32, 32))
    compare(MODEL, CONFIGS, reqs, args.rounds, f"Qwen2.5-0.5B shape fp32, {args.requests} requests")
    if not args.skip_moe:
        from benchmarks.bench_moe import mixtral_200m

        moe = mixtral_200m(MODEL.parent / "mixtral-200m", torch.bfloat16)
        reqs = workload(args.requests, 2048, prompt=(64, 128), output=(32, 32))
        compare(
            moe,
            MOE_CONFIGS,
            reqs,
            args.rounds,
            f"Mixtral shape of 208M (8 experts, top-2) fp32, {args.requests} requests",
        )
    print(f"machine after: {machine()}")


if __name__ == "__main__":
    main()
