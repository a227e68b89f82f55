"""`fulcrum sim calibrate`: measure the engine's steps on this machine and save the fitted step-cost model that the
simulator (and `fulcrum plan --hardware local` / `--validate`) predict from. The measuring is fulcrum.probe's."""

from __future__ import annotations

import argparse
import sys

from rich.table import Table

from fulcrum.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, KV_CACHE_DTYPES, QUANTIZATIONS
from fulcrum.plan.step_costs import StepCosts
from fulcrum.utils.arg_types import positive_int
from fulcrum.utils.console import wide_console


def add_calibrate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", nargs="?", default=None, help="model folder, Hub ID or .gguf (default: the bundled model)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (as fulcrum serve takes it)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the engine's KV-cache dtype")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="the engine's weight quantization")
    p.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="the replica's step budget (default: fulcrum serve's for the device, 256 on CPU; the sweep measures "
        f"prefill chunks up to {DEFAULT_MAX_NUM_BATCHED_TOKENS} tokens either way, or up to this budget when given)",
    )
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-model-len", type=positive_int, default=None, help="default: the model's")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (about 10 s on the bundled model)")
    p.add_argument(
        "--no-served",
        dest="served",
        action="store_false",
        help="skip the served requests that measure the frontend's share of TTFT (frontend_s is then 0)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where to save the cost file (default: $FULCRUM_CACHE/step-costs/<model, dtypes, threads, ISA>.json, "
        "the file plan and sim look for)",
    )
    return p


def summary(costs: StepCosts) -> str:
    """The calibration in one line: the error on the step shapes held out of the fit."""
    f, held = costs.fit, costs.fit.get("held_out", {})
    if not held.get("steps"):
        return "held-out error: none measured (too few step shapes to hold any out)"
    return (
        f"held-out error: mean {held['mean_abs_rel_error']:.1%}, p90 {held['p90_abs_rel_error']:.1%}, "
        f"max {held['max']:.1%} over {held['steps']} step shapes not fitted ({f['shapes_fitted']} fitted, "
        f"{f['steps_measured']} steps measured in {f['seconds']:.0f} s)"
    )


def coefficients_table(costs: StepCosts) -> Table:
    t = Table(title="step cost = knot term (by the step's tokens) + linear terms")
    t.add_column("term", justify="left")
    t.add_column("value", justify="right")
    for k, s in zip(costs.knots, costs.knot_seconds):
        t.add_row(f"a step of {k} tokens", f"{s * 1e3:,.3f} ms")
    units = {"samples": "per sampled row", "decode_kv": "per KV position a decode row reads",
             "prefill_rows": "per prefill row", "prefill_attn": "per causal attention pair of a prefill"}  # fmt: skip
    for name, v in costs.coef.items():
        t.add_row(f"{name} ({units.get(name, '')})", f"{v * 1e6:,.4f} us")
    t.add_row("frontend_s (served TTFT beyond the steps)", f"{costs.frontend_s * 1e3:,.3f} ms")
    t.add_row("kv_transfer_s_per_block", f"{costs.kv_transfer_s_per_block * 1e6:,.2f} us")
    return t


def run_calibrate(args: argparse.Namespace) -> int:
    from fulcrum.probe.step_costs import calibrate, default_costs_path, engine_threads

    console = wide_console(width=120)
    try:
        out = args.out or default_costs_path(
            args.model, args.dtype, args.kv_cache_dtype, engine_threads(True), args.quantization
        )
        console.print(f"calibrating step costs on this machine -> {out}")
        costs = calibrate(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            quantization=args.quantization,
            quick=args.quick,
            served=args.served,
            say=console.print,
        )
        path = costs.save(out)
    except (ValueError, OSError) as e:
        print(f"fulcrum sim calibrate: {e}", file=sys.stderr)
        return 2
    e = costs.engine
    console.print(
        f"{e['model']}: {e['dtype']}, KV {e['kv_cache_dtype']}, {e['threads']} thread(s), "
        f"{costs.machine.get('cpu') or 'CPU'} ({', '.join(costs.machine.get('flags', [])) or 'no AVX2'})"
    )
    console.print(summary(costs))
    console.print(coefficients_table(costs))
    console.print(f"saved to {path}")
    return 0
