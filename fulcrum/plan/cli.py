"""Arguments of `fulcrum plan`, and the command: a model's memory, GPU count, roofline speed and cost per token
on a hardware entry, or `--validate` against a measured run on this machine.

plan imports neither torch nor the engine: the top-level CLI sets the bundled model as --model's default and
passes in the probes (`args.measure_machine`, `args.measure_engine`, `args.local_step_costs`, from `fulcrum.probe`)
that measure. On this machine (`--hardware local`, `--validate`) decode and prefill times are the calibrated step
costs of their steps (`fulcrum sim calibrate`'s file, calibrated first when there is none, or `--step-costs FILE`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from fulcrum.errors import FulcrumError
from fulcrum.plan.advice import what_to_do
from fulcrum.plan.catalog import get_hardware, load_catalog
from fulcrum.plan.local import LOCAL_EFFICIENCY, local_hardware
from fulcrum.plan.memory import MemoryAssumptions, plan_memory
from fulcrum.plan.model_spec import DTYPE_BYTES, EXPERT_FORMAT_BYTES, ModelSpec, load_model_spec, load_presets
from fulcrum.plan.report import Plan, plot, render, to_json
from fulcrum.plan.roofline import (
    INT4_GROUP_SIZES,
    QUANT_METHODS,
    DecodePoint,
    Efficiency,
    Prefill,
    batch_sizes,
    decode_step,
    prefill,
)
from fulcrum.plan.step_costs import StepCosts, decode_seconds, prefill_seconds
from fulcrum.plan.validate import KV_CACHE_DTYPES, describe_costs
from fulcrum.utils.arg_types import non_negative_float, positive_int
from fulcrum.utils.console import wide_console
from fulcrum.utils.cost import cost_per_million_tokens

WEIGHT_DTYPES = ["bf16", "fp16", "fp8", "int8", "int4", "fp4", "fp32"]
KV_DTYPES = ["bf16", "fp16", "fp8", "int8", "fp32"]
DEFAULT_CONTEXT = 32768  # tokens per sequence when --context is not given and the model allows as many


def add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="memory, GPU count, roofline speed and cost per token for a model on hardware",
        description="Plan from config.json alone (weights are never read). Presets: " + ", ".join(load_presets()),
    )
    p.add_argument("--model", default=None, help="HF folder, config.json, or a preset (default: the bundled model)")
    p.add_argument("--hardware", default="H100-SXM", help="a catalog name, or 'local' (this machine, measured)")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default=None, help="default: the checkpoint's")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help="default: bf16 (--validate: the model's)")
    p.add_argument(
        "--quantization",
        choices=QUANT_METHODS,
        default=None,
        help="the engine's online weight quantization: int8 or fp8 per channel, int4 per group (--validate "
        "predicts and measures it; a plan takes it as --weight-dtype)",
    )
    p.add_argument(
        "--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=128, help="int4's group size"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", *KV_CACHE_DTYPES),
        default="auto",
        help="the engine's KV cache: auto (the model's dtype), or fp8 / int8 with an fp16 scale per token and head "
        "(a plan takes it as --kv-dtype)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help=f"tokens per sequence for the memory plan (default: {DEFAULT_CONTEXT}, or the model's "
        "max_position_embeddings when smaller)",
    )
    p.add_argument("--concurrency", type=positive_int, default=64, help="concurrent sequences of --context tokens")
    p.add_argument(
        "--input-len", type=positive_int, default=None, help="prompt tokens for prefill (1024; 512 to validate)"
    )
    p.add_argument("--output-len", type=positive_int, default=None, help="output tokens (256; 64 to validate)")
    p.add_argument(
        "--tp", type=positive_int, default=None, help="tensor parallel size (default: the fewest GPUs that fit)"
    )
    p.add_argument("--pp", type=positive_int, default=None, help="pipeline parallel size")
    p.add_argument(
        "--price-per-hour", type=non_negative_float, default=None, help="dollars per GPU-hour, for cost per 1M tokens"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="save TPOT and throughput against batch size")
    p.add_argument("--validate", action="store_true", help="predict on this machine, then measure fulcrum's engine")
    p.add_argument(
        "--step-costs",
        default=None,
        metavar="FILE",
        help="--hardware local / --validate: predict from this step-cost file (`fulcrum sim calibrate --out`); "
        "default: the one calibrated for the engine's settings here, calibrated first when missing",
    )
    p.set_defaults(func=run_plan)
    return p


def plan_context(spec: ModelSpec, asked: int | None) -> tuple[int, str]:
    """The context of the memory plan, and a line for the output that says where it came from."""
    limit = spec.max_position_embeddings
    if asked:
        over = f", beyond the model's max_position_embeddings ({limit:,})" if limit and asked > limit else ""
        return asked, f"context {asked:,} tokens per sequence (--context){over}"
    if limit and limit < DEFAULT_CONTEXT:
        context, source = limit, "the model's max_position_embeddings"
    else:
        context, source = DEFAULT_CONTEXT, "the default"
    return context, f"context {context:,} tokens per sequence: {source} (--context to change)"


def _one_of(a: tuple[str, str | None], b: tuple[str, str | None]) -> str | None:
    """The value of two flags that name the same thing (plan's and the engine's spelling); both given must agree."""
    if a[1] and b[1] and a[1] != b[1]:
        raise ValueError(f"{a[0]} {a[1]} and {b[0]} {b[1]} disagree: give one of them")
    return a[1] or b[1]


def engine_formats(args: argparse.Namespace, spec: ModelSpec) -> tuple[str | None, str]:
    """--validate's online quantization and KV-cache dtype, in the engine's names, from either spelling: plan's
    --weight-dtype / --kv-dtype may name the model's own dtype or a format the engine has, and the engine's own
    flags (--quantization, --quantization-group-size, --kv-cache-dtype) are taken as the engine spells them."""
    weight = None if args.weight_dtype == spec.dtype else args.weight_dtype
    if weight and weight not in QUANT_METHODS:
        raise ValueError(
            f"--validate runs the checkpoint's own dtype ({spec.dtype}) or the engine's online quantization "
            f"({', '.join(QUANT_METHODS)}); --weight-dtype {weight} is neither"
        )
    kv = None if args.kv_dtype == spec.dtype else args.kv_dtype
    if kv and kv not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--validate's KV cache is the model's dtype ({spec.dtype}) or one the engine quantizes to "
            f"({', '.join(sorted(set(KV_CACHE_DTYPES.values())))}); --kv-dtype {kv} is neither"
        )
    engine_kv = KV_CACHE_DTYPES.get(args.kv_cache_dtype)
    kv = _one_of(("--kv-dtype", kv), ("--kv-cache-dtype", engine_kv)) or "auto"
    return _one_of(("--weight-dtype", weight), ("--quantization", args.quantization)), kv


def local_costs(
    args: argparse.Namespace,
    say: Callable[[str], None],
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    group_size: int = 128,
    dtype: str = "auto",
    own_process: bool = True,
) -> Callable[[], tuple[StepCosts, str]]:
    """This machine's step costs, when asked for: `--step-costs FILE`, else the probe's file for the engine's
    settings (calibrated now when missing: `own_process`, the thread plan of `fulcrum serve`; without it, of an
    in-process LLM, as `--validate` measures)."""

    def get() -> tuple[StepCosts, str]:
        if args.step_costs:
            return StepCosts.load(args.step_costs), args.step_costs
        if getattr(args, "local_step_costs", None) is None:
            raise ValueError("no step costs for this machine: give --step-costs FILE (`fulcrum sim calibrate`)")
        costs, path = args.local_step_costs(
            args.model, dtype, kv_cache_dtype, quantization, group_size, own_process=own_process,
            served=own_process, say=say,
        )  # fmt: skip
        return costs, str(path)

    return get


def engine_dtype(spec: ModelSpec, asked: str | None) -> tuple[str, str | None] | None:
    """The engine's (--dtype, --quantization) that runs plan's weight format here, or None when it has none."""
    if asked is None or asked == spec.dtype:
        return "auto", None
    if asked in QUANT_METHODS:
        return "auto", asked
    return {"bf16": ("bfloat16", None), "fp16": ("float16", None), "fp32": ("float32", None)}.get(asked)


def with_step_costs(
    plan_decode: list[DecodePoint], pf: Prefill, costs: StepCosts, price: float | None
) -> tuple[list[DecodePoint], Prefill]:
    """The roofline's decode points and prefill with their times replaced by the step costs' (one engine here)."""
    decode = []
    for d in plan_decode:
        tpot = decode_seconds(costs, d.batch, d.context)
        cost = cost_per_million_tokens(price, d.batch / tpot) if price else None
        decode.append(dataclasses.replace(d, tpot_s=tpot, tokens_per_s=d.batch / tpot, cost_per_million=cost))
    chunk = costs.step_budget or pf.tokens
    seconds = prefill_seconds(costs, pf.tokens, chunk)
    return decode, dataclasses.replace(pf, seconds=seconds, tokens_per_s=pf.tokens / seconds)


def build_plan(args: argparse.Namespace) -> Plan:
    spec = load_model_spec(args.model)
    seq_len, context_note = plan_context(spec, args.context)
    asked = _one_of(("--weight-dtype", args.weight_dtype), ("--quantization", args.quantization))
    wdtype = asked or spec.weight_format or spec.dtype
    engine_kv = KV_CACHE_DTYPES.get(args.kv_cache_dtype)
    args.kv_dtype = _one_of(("--kv-dtype", args.kv_dtype), ("--kv-cache-dtype", engine_kv)) or "bf16"
    catalog = load_catalog()
    if args.hardware.lower() == "local":
        hw = local_hardware(args.measure_machine(spec, wdtype, matmul_tokens=args.input_len))
        eff = LOCAL_EFFICIENCY
    else:
        hw = get_hardware(args.hardware, catalog)
        eff = Efficiency()
    mem = plan_memory(spec, hw, wdtype, args.kv_dtype, seq_len, args.concurrency)
    tp = args.tp or (mem.suggested_tp if mem.min_gpus else 1)
    pp = args.pp or (mem.suggested_pp if mem.min_gpus and not args.tp else 1)
    if (tp, pp) != (1, 1):
        mem = plan_memory(spec, hw, wdtype, args.kv_dtype, seq_len, args.concurrency, tp, pp)
    context = args.input_len + args.output_len // 2
    limit = max(1, args.concurrency)
    decode = [
        decode_step(spec, hw, wdtype, args.kv_dtype, b, context, tp, pp, eff, args.price_per_hour)
        for b in batch_sizes(limit)
    ]
    pf = prefill(spec, hw, wdtype, args.input_len, tp, pp, eff)
    costs_note, speed_from = [], "roofline"
    if args.hardware.lower() == "local":
        engine = engine_dtype(spec, asked)
        if engine is None or (tp, pp) != (1, 1):
            costs_note = ["decode and prefill: the roofline of the measured figures (no calibrated engine runs this "
                          "format or split here)"]  # fmt: skip
        else:
            kv = args.kv_dtype if args.kv_dtype in ("fp8", "int8") else "auto"
            say = wide_console(stderr=True, width=120).print
            costs, where = local_costs(args, say, kv, engine[1], args.quantization_group_size, engine[0])()
            decode, pf = with_step_costs(decode, pf, costs, args.price_per_hour)
            speed_from = "calibrated step costs"
            costs_note = [f"decode TPOT and prefill: the calibrated step costs of {where} ({describe_costs(costs)})"]
    notes = [
        context_note,
        *costs_note,
        f"weights {wdtype} ({DTYPE_BYTES[wdtype]:g} bytes/parameter"
        + (", the checkpoint's quantization_config" if not asked and spec.weight_format else "")
        + f"), matmuls in {hw.compute_format(wdtype)}"
        + (
            f"; routed experts {spec.expert_format} ({EXPERT_FORMAT_BYTES[spec.expert_format]:g} bytes/parameter)"
            if spec.expert_format
            else ""
        ),
        *MemoryAssumptions().describe(),
        *eff.describe(),
        *hw.notes,
    ]
    return Plan(
        spec=spec,
        hardware=hw,
        memory=mem,
        prefill=pf,
        decode=decode,
        advice=what_to_do(spec, hw, mem, catalog),
        assumptions=notes,
        price_per_hour=args.price_per_hour,
        decode_max_batch=plan_memory(spec, hw, wdtype, args.kv_dtype, context, 1, tp, pp).max_concurrency,
        speed_from=speed_from,
    )


def run_plan(args: argparse.Namespace) -> int:
    # wide enough for the tables when the output goes to a file or a pipe
    console = wide_console(stderr=args.json, width=120)
    try:
        if args.validate:
            from fulcrum.plan.validate import validate

            quantization, kv_cache_dtype = engine_formats(args, load_model_spec(args.model))
            result = validate(
                str(args.model),
                args.measure_machine,
                args.measure_engine,
                input_len=args.input_len or 512,
                output_len=args.output_len or 64,
                batch_sizes=(1, 2),
                quantization=quantization,
                group_size=args.quantization_group_size,
                kv_cache_dtype=kv_cache_dtype,
                console=console,
                step_costs=local_costs(
                    args, console.print, kv_cache_dtype, quantization, args.quantization_group_size, own_process=False
                ),
            )
            if args.json:
                import json

                print(json.dumps(result, indent=1, default=str))
            return 0
        args.input_len, args.output_len = args.input_len or 1024, args.output_len or 256
        plan = build_plan(args)
    except (FulcrumError, ValueError) as e:
        print(f"fulcrum plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(to_json(plan))
    else:
        render(plan, console)
    if args.plot:
        plot(plan, args.plot)
        console.print(f"plot saved to {args.plot}")
    return 0
