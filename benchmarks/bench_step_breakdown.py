"""Where a batched decode step's time goes, against its floor: one model, one dtype, R rows decoding together.

    .venv/bin/python benchmarks/bench_step_breakdown.py --model qwen05 --dtype bfloat16 --rows 8
    FULCRUM_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_step_breakdown.py --model bundled --dtype float32 --rows 64

R requests (prompts of --prompt-len random ids) decode --steps tokens each, greedy, in-process (`LLM`). The step
time is (t(steps + 1 tokens) - t(1 token)) / steps, so the prefill cancels out. A second, equal run times each
kernel entry point the model calls (the linears, decode attention, the activation, the norms, RoPE with the cache
write, the greedy argmax, the fused decode stack where a step takes it) by wrapping it in a timer; what is left of
the wrapped step is Python, the scheduler, the sampler and the output path ("rest"). The fused decode stack's time is
split further by its own clocks (csrc/decode_stack.cpp, on only in this run): each linear with its LoRA, attention,
the norms, RoPE with the cache write, the activation, and the residual adds. The wrapped step is a little slower
than the plain one; both are printed.

The floor of a step, measured in the same run: the bytes it must read (every weight once, and the KV cache of
every row) at this machine's read bandwidth, or its linears' FLOPs at the rate a large matmul of the model's dtype
reaches here, whichever is larger. Nothing else in the process while it runs (2 cores: time nothing beside it).

    .venv/bin/python benchmarks/bench_step_breakdown.py --model bundled --dtype float32 --workload 64

--workload N splits a whole offline run instead: bench_vs_vllm's throughput workload (N requests, prompts of 64-512
tokens, 32-256 out, greedy, eos ignored; the same lengths, fresh token ids each run) in one `generate`, its time
divided into prefill steps (a step with any prompt tokens in it), decode-only steps, and the time between steps
(scheduling, outputs, detokenizing), each step kind by kernel entry point as above. --repeats runs, each printed.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import cpu_summary, in_turn, memory_bandwidth_gbs, model_folder, save_json  # noqa: E402

# (module, function, category): the kernel entry points the model's layers call
ENTRY_POINTS = (
    ("cpu_prepack", "linear", "linears"),
    ("cpu_gemv", "linear", "linears"),
    ("cpu_attention", "decode", "decode attention"),
    ("cpu_attention", "prefill", "prefill attention"),
    ("cpu_attention", "prefill_varlen", "prefill attention"),
    ("cpu_act", "silu_and_mul", "activation"),
    ("cpu_norm", "rms_norm", "norms"),
    ("cpu_rope", "rope_and_cache", "rope+cache"),
    ("cpu_argmax", "argmax", "argmax"),
)


class Timers:
    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.undo = []
        self.depth = 0  # inside a timed call: an entry point it calls is its time, not counted twice
        self.stack = collections.Counter()  # inside the fused decode stack, by kind of call (its own clocks)

    def wrap(self, module, name: str, category: str) -> None:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.seconds[category] += time.perf_counter() - t
                self.calls[category] += 1

        setattr(module, name, timed)
        self.undo.append((module, name, fn))

    def install(self) -> None:
        import importlib

        for mod, name, category in ENTRY_POINTS:
            self.wrap(importlib.import_module(f"fulcrum.kernels.{mod}"), name, category)
        from fulcrum.kernels.cpu_decode_stack import DecodeStack
        from fulcrum.quant.base import UnquantizedLinearMethod

        self.wrap(DecodeStack, "run", "decode stack")
        # every path of an unquantized linear: fulcrum's kernels, oneDNN's packed weight, torch's F.linear (MKL)
        self.wrap(UnquantizedLinearMethod, "apply", "linears")
        from fulcrum.kernels import cpu_decode_stack

        cpu_decode_stack.phase_times(True)  # the stack's clocks on, from zero

    def read_stack(self, on: bool = True) -> None:
        """Add the fused stack's clocks since the last read to self.stack."""
        from fulcrum.kernels import cpu_decode_stack

        self.stack.update(cpu_decode_stack.phase_times(on))

    def remove(self) -> None:
        self.read_stack(on=False)
        for module, name, fn in reversed(self.undo):
            setattr(module, name, fn)
        self.undo.clear()


def print_stack(parts: dict, total: float, unit: str, indent: str) -> None:
    """The fused stack's time by kind of call (from its own clocks), under its line."""
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        if v >= 0.005:
            print(f"{indent}{k:12s} {v:8.2f} {unit}  {100 * v / total:5.1f}% of the stack")


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the weights a decode step reads, parameters of its linears): each linear weight and norm once, the
    output head once (an embedding table is read a row per token, so it is not counted unless it is the head)."""
    total, linear_params = 0, 0
    seen = set()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or w.data_ptr() in seen:
            continue
        if type(mod).__name__ in ("VocabParallelEmbedding", "Embedding"):  # a tied head is counted as the head
            continue
        seen.add(w.data_ptr())
        total += w.numel() * w.element_size()
        if w.dim() == 2:
            linear_params += w.numel()
    return total, linear_params


def gemm_rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of a large square matmul in `dtype` here (the best of 5): torch's, or fulcrum's blocked kernel's where
    it holds the weight and is faster (MKL's sgemm runs no AVX-512 code on AMD CPUs: the floor is the machine's).
    bf16 without native bf16 matmuls (below AVX-512 BF16) is the fp32 rate where that is faster: bf16 values widen
    to fp32 exactly, and torch's own bf16 matmul there emulates it (1 GFLOP/s on a 2-core AMD EPYC Zen 3, AVX2)."""
    from fulcrum.kernels import cpu_gemv, cpu_prepack

    wide = dtype == torch.bfloat16 and not cpu_gemv.native_bf16_matmul()  # fulcrum computes bf16 in fp32 here
    fns = {}
    for dt in dict.fromkeys((dtype, torch.float32 if wide else dtype)):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        fns[f"torch {dt}"] = lambda a=a, b=b: a @ b
        if cpu_prepack.supported() and cpu_prepack.blocks(b):
            blocked = cpu_prepack.block(b)
            fns[f"blocked {dt}"] = lambda a=a, blocked=blocked: cpu_prepack.linear(a, blocked, None)
    best_ms = min(min(ms) for ms in in_turn(fns, rounds=1, passes=5).values())
    return 2 * n**3 / (best_ms / 1e3)


def whole_run(llm, vocab: int, n: int, repeats: int) -> list[dict]:
    """--workload: each run's time by step kind, and each kind's by kernel entry point (seconds)."""
    from benchmarks.common import workload
    from fulcrum import SamplingParams

    lengths = [(len(ids), out) for ids, out in workload(n, vocab)]
    g = torch.Generator().manual_seed(1)
    runner = llm.core.runner
    execute = runner.execute
    timers = Timers()
    kinds: dict = {}

    def timed_execute(sched):
        prefill = any(s.request.num_computed_tokens < s.request.num_prompt_tokens for s in sched.scheduled)
        kind = kinds.setdefault("prefill" if prefill else "decode",
                                {"steps": 0, "rows": 0, "s": 0.0, "parts": {}, "stack": {}})  # fmt: skip
        before, stack_before = dict(timers.seconds), dict(timers.stack)
        t = time.perf_counter()
        try:
            return execute(sched)
        finally:
            kind["s"] += time.perf_counter() - t
            kind["steps"] += 1
            kind["rows"] += len(sched.scheduled)
            timers.read_stack()
            for into, now, then in (
                (kind["parts"], timers.seconds, before),
                (kind["stack"], timers.stack, stack_before),
            ):
                for k, v in now.items():
                    into[k] = into.get(k, 0.0) + v - then.get(k, 0.0)

    def run() -> float:
        prompts = [{"prompt_token_ids": torch.randint(10, vocab, (p,), generator=g).tolist()} for p, _ in lengths]
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run()  # warm: the first run's allocations and caches are not the workload's
    results = []
    for i in range(repeats):
        kinds.clear()
        timers.seconds.clear()
        timers.stack.clear()
        timers.install()
        runner.execute = timed_execute
        try:
            total = run()
        finally:
            del runner.execute
            timers.remove()
        between = total - sum(k["s"] for k in kinds.values())
        results.append({"total_s": total, "between_steps_s": between, **kinds})
        print(f"run {i + 1}: {total:.2f} s; between steps {between:.2f} s")
        for name, k in kinds.items():
            rest = k["s"] - sum(k["parts"].values())
            print(f"  {name} steps: {k['steps']}, {k['rows'] / max(1, k['steps']):.1f} rows on average, {k['s']:.2f} s"
                  f" ({1e3 * k['s'] / max(1, k['steps']):.1f} ms a step)")  # fmt: skip
            for part, v in sorted(k["parts"].items(), key=lambda kv: -kv[1]):
                if v >= 0.005:
                    print(f"    {part:18s} {v:7.2f} s  {100 * v / k['s']:5.1f}%")
                if part == "decode stack":
                    print_stack(k["stack"], v, "s", " " * 6)
            print(f"    {'rest':18s} {rest:7.2f} s  {100 * rest / k['s']:5.1f}%  (Python, sampler, inputs)")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen05", help="bundled, qwen05 (random weights, Qwen2.5-0.5B shape), a folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="unwrapped timings; the median is reported")
    p.add_argument(
        "--workload",
        type=int,
        default=None,
        metavar="N",
        help="split a whole offline run of N requests (bench_vs_vllm's workload) by step kind instead",
    )
    p.add_argument("--work-dir", default="/tmp/fulcrum-bench")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from fulcrum import LLM, SamplingParams
    from fulcrum.utils import cpu_isa

    folder = model_folder(argparse.Namespace(model=args.model, work_dir=args.work_dir))
    if not (folder / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json in {folder}")
    llm = LLM(model=str(folder), dtype=args.dtype, device="cpu", kv_cache_memory=4 << 30)
    core = llm.core
    model = core.runner.model
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    if args.workload:
        print(f"{cpu_summary()}; ISA {cpu_isa.isa()}, {torch.get_num_threads()} threads")
        print(f"{args.model} {args.dtype}, workload of {args.workload} requests")
        runs = whole_run(llm, vocab, args.workload, args.repeats)
        save_json(args.out, {"machine": cpu_summary(), "isa": cpu_isa.isa(), "model": args.model,
                             "dtype": args.dtype, "workload": args.workload, "runs": runs})  # fmt: skip
        llm.close()
        return
    rounds = iter(range(1 << 30))

    def run(tokens: int) -> float:
        r = next(rounds)  # fresh prompts every run: nothing is prefix-cached
        prompts = [
            {"prompt_token_ids": torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist()}
            for _ in range(args.rows)
        ]
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, seed=r)
        t = time.perf_counter()
        llm.generate(prompts, [sp] * args.rows, use_tqdm=False)
        return time.perf_counter() - t

    def step_ms() -> float:
        return (run(args.steps + 1) - run(1)) / args.steps * 1e3

    wbytes, lparams = weight_bytes(model)
    ctx = args.prompt_len + args.steps // 2  # the mean context over the timed steps
    cfg = core.model_config.hf_config
    text = getattr(cfg, "text_config", cfg)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_bytes = args.rows * ctx * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim
    kv_bytes *= torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    flops = 2 * args.rows * lparams

    def floor_now() -> dict:
        """The step's floor as this machine runs now: this VM's bandwidth and matmul rate move by up to 2x within
        minutes, so each timed run is paired with a floor measured just before it."""
        bw, rate = memory_bandwidth_gbs() * 1e9, gemm_rate(getattr(torch, args.dtype))
        f = {"bandwidth_gbs": bw / 1e9, "gemm_gflops": rate / 1e9, "bytes_ms": (wbytes + kv_bytes) / bw * 1e3,
             "flops_ms": flops / rate * 1e3, "weights_ms": wbytes / bw * 1e3}  # fmt: skip
        f["ms"] = max(f["bytes_ms"], f["flops_ms"])
        return f

    run(4)
    pairs = []  # (step ms, its floor)
    for _ in range(args.repeats):
        f = floor_now()
        pairs.append((step_ms(), f))
    steps = sorted(p[0] for p in pairs)
    step = steps[len(steps) // 2]
    ratios = sorted(s / f["ms"] for s, f in pairs)

    # the same two runs with the entry points timed: each category's time in the long run less the short run's
    # (its prefill and first token), per step; "rest" is the wrapped step's time the entry points do not account for
    timers = Timers()
    floor = floor_now()  # the wrapped run's
    timers.install()
    try:
        t_short = run(1)
        short = dict(timers.seconds)
        timers.seconds.clear()
        timers.read_stack()
        short_stack = dict(timers.stack)
        timers.stack.clear()
        t_long = run(args.steps + 1)
        long = dict(timers.seconds)
    finally:
        timers.remove()
    wrapped_step = (t_long - t_short) / args.steps * 1e3

    def per_step(long: dict, short: dict) -> dict:  # ms a step: the long run's seconds less the short run's
        return {k: max(0.0, v - short.get(k, 0.0)) / args.steps * 1e3 for k, v in long.items()}

    stack = per_step(timers.stack, short_stack)
    parts = {k: v for k, v in per_step(long, short).items() if v >= 0.005}
    rest = max(0.0, wrapped_step - sum(parts.values()))

    # the wrapped step, and its linears alone (the stack's, by its clocks, and those outside it), against their
    # floors measured just before it: the linears' every weight read once at the bandwidth, or their FLOPs at the
    # large matmul's rate, whichever is larger
    linears_ms = sum(stack.get(k, 0.0) for k in ("qkv", "o", "gate_up", "down")) + parts.get("linears", 0.0)
    linears_floor_ms = max(floor["weights_ms"], floor["flops_ms"])
    result = {
        "machine": cpu_summary(),
        "isa": cpu_isa.isa(),
        "torch_threads": torch.get_num_threads(),
        "model": args.model,
        "dtype": args.dtype,
        "rows": args.rows,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "step_ms": step,
        "step_ms_runs": [s for s, _ in pairs],
        "floor_ms_runs": [f["ms"] for _, f in pairs],
        "step_over_floor_runs": [s / f["ms"] for s, f in pairs],
        "parts_ms": {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "stack_ms": {k: round(v, 3) for k, v in sorted(stack.items(), key=lambda kv: -kv[1])},
        "rest_ms": rest,
        "wrapped_step_ms": wrapped_step,
        "weight_bytes": wbytes,
        "kv_bytes": kv_bytes,
        "linear_flops": flops,
        "floor": floor,
        "step_over_floor": ratios[len(ratios) // 2],
        "wrapped_over_floor": wrapped_step / floor["ms"],
        "linears_ms": linears_ms,
        "linears_floor_ms": linears_floor_ms,
        "linears_over_floor": linears_ms / linears_floor_ms,
    }
    print(f"{result['machine']}; ISA {result['isa']}, {result['torch_threads']} threads")
    each = ", ".join(f"{s:.2f} / {f['ms']:.2f}" for s, f in pairs)
    print(f"{args.model} {args.dtype}, {args.rows} rows, context ~{ctx}: step {step:.2f} ms; each run against the "
          f"floor measured just before it: {each} ms; step / floor {result['step_over_floor']:.2f} (median; runs "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    print(f"with the entry points timed: step {wrapped_step:.2f} ms")
    for k, v in result["parts_ms"].items():
        print(f"  {k:14s} {v:8.2f} ms  {100 * v / wrapped_step:5.1f}%")
        if k == "decode stack":
            print_stack(stack, v, "ms", " " * 4)
    print(f"  {'rest':14s} {rest:8.2f} ms  {100 * rest / wrapped_step:5.1f}%  (Python, scheduler, sampler, outputs)")
    print(f"its floor {floor['ms']:.2f} ms: {(wbytes + kv_bytes) / 1e6:.0f} MB at {floor['bandwidth_gbs']:.1f} GB/s = "
          f"{floor['bytes_ms']:.2f} ms; {flops / 1e9:.2f} GFLOP at {floor['gemm_gflops']:.0f} GFLOP/s = "
          f"{floor['flops_ms']:.2f} ms; wrapped step / floor {result['wrapped_over_floor']:.2f}")  # fmt: skip
    print(f"linears {linears_ms:.2f} ms (wrapped run) against their floor {linears_floor_ms:.2f} ms: "
          f"{result['linears_over_floor']:.2f}")  # fmt: skip
    if args.out:
        save_json(args.out, result)
    llm.close()


if __name__ == "__main__":
    main()
