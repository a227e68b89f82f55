"""`fulcrum tune MODEL --slo ...`: the arguments, the facts gathered before any server starts, the walk with a
progress line, and the report. Bad flags are one line and exit 2; every server started is stopped on exit."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import shlex
import signal
import sys
import time
from pathlib import Path

from fulcrum.bench.cli import add_workload_args, workload_spec
from fulcrum.defaults import DEFAULT_MODEL, ONLINE_QUANTIZATIONS
from fulcrum.tune.target import parse_quality, parse_slo

DEFAULT_SLO = "ttft_p90=500ms,tpot_p90=50ms"
DEFAULT_QUALITY = "kl=0.01"
BUNDLED_DRAFT = DEFAULT_MODEL.parent / "tiny-shakespeare-draft"


def duration(text: str) -> float:
    """`90s`, `20m`, `1.5h` or plain seconds."""
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(t[-1:])
    try:
        value = float(t[:-1] if scale else t) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 20m or 1h, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"the budget must be above 0, got {text!r}")
    return value


def _checked(parse):
    def run(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return run


def _positive(kind):
    def run(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return v

    return run


def add_tune_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune",
        help="walk the order of operations on your workload (baseline, memory, quantize, parallelize, scale out, "
        "disaggregate), keeping each change only when measured goodput under the SLO rose",
        description="Starts servers of MODEL on loopback ports, loads each with `fulcrum bench` at rising "
        "concurrency until the SLO breaks, and keeps a change only when its goodput (requests/s meeting the SLO) "
        "beat the best so far. Writes report.json, report.md, serve-config.yaml (for `fulcrum serve --config`) "
        "and goodput.png under --out.",
    )
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL), help="model folder (default: the bundled model)")
    p.add_argument("--slo", type=_checked(parse_slo), default=parse_slo(DEFAULT_SLO),
                   help=f"latency SLOs as METRIC_STAT=VALUE (ttft, tpot, itl, e2e; mean, p50, p90, p95, p99), "
                   f"default {DEFAULT_SLO}")  # fmt: skip
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive(float), default=None,
                      help="requests/s the fleet must hold: scale-out sizes replicas for it, and a load point that "
                      "reaches it needs no higher load")  # fmt: skip
    load.add_argument("--concurrency", type=_positive(int), default=None,
                      help="the most users at once the service sees: the load rises up to it (default 64)")  # fmt: skip
    p.add_argument("--max-quality-loss", type=_checked(parse_quality), default=parse_quality(DEFAULT_QUALITY),
                   help="bounds on `fulcrum eval` against the unquantized model a quantized candidate must meet "
                   f"before it is measured: kl, kl_p99, top1, ppl_ratio (default {DEFAULT_QUALITY})")  # fmt: skip
    p.add_argument("--budget", type=duration, default=duration("20m"), help="wall time for the whole tune (20m)")
    p.add_argument("--hardware", default="local",
                   help="local (this machine, measured), or the catalog name of the GPUs here (H100-SXM, ...), "
                   "whose memory sizes what fits")  # fmt: skip
    p.add_argument("--count", type=_positive(int), default=None, help="cores or GPUs to use (default: all)")
    p.add_argument("--price-per-hour", type=_positive(float), default=None,
                   help="dollars per machine-hour (default: $0.05 per core-hour, $3 per GPU-hour, labelled assumed)")  # fmt: skip
    p.add_argument("--out", default=None, help="report folder (default: tune-YYYYmmdd-HHMMSS)")
    p.add_argument("--serve-cmd", default=None, metavar="TEMPLATE",
                   help="tune another engine's server: a shell command with {port} and {model}, and for each knob it "
                   "exposes {knob} (its value) or {knob:PREFIX} (PREFIX and the value, nothing when unset), e.g. "
                   "'python -m vllm.entrypoints.openai.api_server --model {model} --port {port} "
                   "{max_num_seqs:--max-num-seqs } {quantization:--quantization }'; knobs: max_num_seqs, "
                   "max_num_batched_tokens, kv_cache_memory, no_prefix_caching, cpu_threads, quantization, "
                   "kv_cache_dtype, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, "
                   "speculative_config")  # fmt: skip
    p.add_argument(
        "--serve-args", default="", help="flags every `fulcrum serve` of the tune gets, e.g. '--dtype bfloat16'"
    )
    p.add_argument("--draft", default=None, help="a draft model folder to try speculative decoding with "
                   "(default: the bundled draft when tuning the bundled model)")  # fmt: skip
    p.add_argument("--try-quantization", type=lambda s: tuple(x for x in s.split(",") if x), default=None,
                   help=f"weight formats to try (default {','.join(ONLINE_QUANTIZATIONS)}; empty: none)")  # fmt: skip
    p.add_argument("--min-gain", type=float, default=0.05, help="a change is kept when goodput rose by more (0.05)")
    p.add_argument("--warmup", type=int, default=None,
                   help="requests each server answers unmeasured before its first load point (default: 2 on CPU, "
                   "8 on GPUs, whose kernels compile on first use)")  # fmt: skip
    p.add_argument("--point-seconds", type=_positive(float), default=20.0, help="the longest one load point runs")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_workload_args(p)
    p.set_defaults(func=run_tune)
    p.error = _usage_error  # one line, not argparse's usage block
    return p


def _usage_error(message: str):
    print(f"fulcrum tune: {message} (fulcrum tune --help for the flags)", file=sys.stderr)
    raise SystemExit(2)


def _error(message: str) -> int:
    print(f"fulcrum tune: {message}", file=sys.stderr)
    return 2


def run_tune(args: argparse.Namespace) -> int:
    from fulcrum.bench.workloads import TextMaker
    from fulcrum.errors import FulcrumError
    from fulcrum.model_folder.source import resolve_model
    from fulcrum.plan.catalog import get_hardware
    from fulcrum.plan.model_spec import load_model_spec
    from fulcrum.tune import facts as F
    from fulcrum.tune.space import template_knobs

    if args.dataset and args.workload == "random":
        args.workload = "jsonl"
    bad = [q for q in args.try_quantization or () if q not in ONLINE_QUANTIZATIONS]
    if bad:
        return _error(f"--try-quantization: {', '.join(bad)} not among {', '.join(ONLINE_QUANTIZATIONS)}")
    try:
        # fulcrum serves a folder, a GGUF file or a model in the Hub cache: its folder has the config and tokenizer
        args.folder = None if args.serve_cmd and not Path(args.model).is_dir() else str(resolve_model(args.model))
        exposed = template_knobs(args.serve_cmd) if args.serve_cmd else None
        base_args = tuple(shlex.split(args.serve_args))
        spec = workload_spec(args)
        text = TextMaker(_tokenizer(args))
        mean_in, max_in, mean_out, max_out = F.workload_lengths(spec, text)
        model_spec = load_model_spec(args.folder) if args.folder else None
        if args.hardware.lower() == "local":
            machine = F.this_machine(args.count)
        else:  # tune measures, so the hardware must be here; the catalog entry sizes what fits
            hw = get_hardware(args.hardware)
            local = F.this_machine(args.count)
            if local.device != "cuda":
                return _error(f"--hardware {hw.name}: this machine has no GPU, and tune measures rather than "
                              f"predicts (fulcrum plan --hardware {hw.name} predicts)")  # fmt: skip
            machine = F.Machine("cuda", local.units, hw.memory_bytes, hw.name)
    except (ValueError, OSError, FulcrumError) as e:
        return _error(str(e))
    return _walk(args, exposed, base_args, spec, text, (mean_in, max_in, mean_out, max_out), model_spec, machine)


def _tokenizer(args):
    path = args.tokenizer or args.folder
    if path is None:
        return None
    from fulcrum.utils.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _walk(args, exposed, base_args, spec, text, lengths, model_spec, machine) -> int:
    from fulcrum.tune import facts as F
    from fulcrum.tune import report
    from fulcrum.tune.launch import Launcher, stop_all
    from fulcrum.tune.measure import LiveMeasurer, LoadPlan
    from fulcrum.tune.quality import EvalGate
    from fulcrum.tune.search import Facts, Walk
    from fulcrum.utils.console import wide_console

    console = wide_console(stderr=True, width=150)
    mean_in, max_in, mean_out, max_out = lengths
    cap = args.concurrency or 64
    out = Path(args.out or f"tune-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    price = args.price_per_hour
    price_note = "given"
    if price is None:
        price, price_note = F.ASSUMED_PRICE[machine.device] * machine.units, "assumed"
    shares = args.workload in ("shared-prefix", "multi-turn") or (args.workload == "jsonl" and mean_in > max_in / 2)
    draft = args.draft or (str(BUNDLED_DRAFT) if Path(args.model).resolve() == DEFAULT_MODEL.resolve() else None)
    check = F.MemoryCheck(model_spec, machine, int(max_in + max_out), cap) if model_spec else None
    facts = Facts(
        device=machine.device,
        units=machine.units,
        num_heads=model_spec.num_heads if model_spec else 0,
        num_kv_heads=model_spec.num_kv_heads if model_spec else 0,
        num_layers=model_spec.num_layers if model_spec else 0,
        shares_prefixes=shares,
        mean_input_len=mean_in,
        mean_output_len=mean_out,
        kv_cache_need_gib=check.kv_gib(model_spec.dtype) if check and machine.device == "cpu" else None,
        kv_cache_default_gib=F.CPU_DEFAULT_KV_GIB if machine.device == "cpu" else None,
        fits=check or (lambda c: None),
        draft=draft,
        quantizations=args.try_quantization if args.try_quantization is not None else ONLINE_QUANTIZATIONS,
        exposes=(lambda k: k in exposed) if exposed is not None else (lambda k: True),
        pd_possible=(
            "the server command is another engine's: P/D needs fulcrum's router and connectors"
            if args.serve_cmd
            else None
            if machine.units >= 2
            else "one core or GPU: no room for two engines"
        ),  # fmt: skip
        target_rate=args.rate,
        price_per_hour=price,
        router_policy="prefix" if shares else "least-load",
    )
    slo_text = ", ".join(str(b) for b in args.slo)
    target_lines = [
        f"SLO: {slo_text}; goodput = requests/s of the best load point meeting every bound",
        f"workload: {args.workload}, prompts mean {mean_in:.0f} / max {max_in:.0f} tokens, outputs mean "
        f"{mean_out:.0f} / max {max_out:.0f} tokens ({'exact, tokenizer' if text.exact else 'approximate, words'})",
        f"load: closed loop, concurrency doubling up to {cap}"
        + (f"; the fleet must hold {args.rate:g} req/s" if args.rate else ""),
        "quality bound for quantized candidates: " + ", ".join(f"{k}={v:g}" for k, v in args.max_quality_loss.items()),
        f"price: ${price:.2f}/h per engine machine ({price_note})",
    ]
    console.print("[bold]stage 1: target[/]")
    for line in target_lines:
        console.print(f"  {line}", markup=False)

    launcher = Launcher(args.model, out / "logs", serve_cmd=args.serve_cmd, base_args=base_args, cores=machine.units)
    warmup = args.warmup if args.warmup is not None else 8 if machine.device == "cuda" else 2
    plan = LoadPlan(max_concurrency=cap, point_seconds=args.point_seconds, target_rate=args.rate, warmup=warmup)

    def on_point(p) -> None:
        if args.quiet:
            return
        s = p.summary
        mark = "meets the SLO" if p.passed else f"breaks it: {p.cut_short or '; '.join(p.misses) or 'failures'}"
        console.print(f"    concurrency {p.concurrency}: {s['request_throughput']:.2f} req/s, TTFT p90 "
                      f"{_ms(s['ttft_ms']['p90'])}, TPOT p90 {_ms(s['tpot_ms']['p90'])}: {mark}", markup=False)  # fmt: skip

    def progress(stage: str, change: str, left: float) -> None:
        if not args.quiet:
            console.print(f"[bold]{stage}[/]: {change}  [dim]({max(left, 0) / 60:.1f} min of budget left)[/]")

    measurer = LiveMeasurer(launcher, spec, text, args.slo, plan, endpoint=args.endpoint, on_point=on_point)
    gate = EvalGate(args.folder)
    walk = Walk(measurer.measure, gate, facts, args.max_quality_loss, args.budget, args.min_gain, progress)
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    interrupted = False
    try:
        walk.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - t0
    doc = {
        "tool": "fulcrum tune",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "machine": machine.describe(),
        "budget_s": args.budget,
        "elapsed_s": elapsed,
        "interrupted": interrupted,
        "eval_seconds": gate.seconds,
        "target": {"slo": slo_text, "lines": target_lines, "workload": args.workload, "rate": args.rate},
    }
    best = walk.best
    doc["result"] = _result(args, walk, best, launcher, model_spec, mean_in, max_in + max_out, elapsed)
    tables = report.stage_tables(walk.trials, price)
    flags = {"model": args.model, **_base_flags(base_args), **(best.config.file_flags() if best else {})}
    paths = report.write(out, doc, walk.trials, tables, flags)  # first: kept even when the terminal is gone
    with contextlib.suppress(OSError):  # stdout or stderr closed (a pipe whose reader left)
        if interrupted:
            console.print("interrupted: the servers are stopped; the report has what was measured", markup=False)
        report.print_tables(wide_console(width=150), tables)
        for line in doc["result"]["lines"]:
            print(line)
        print(doc["result"]["command"])
        print(f"report: {', '.join(str(p) for p in paths)}")
    return 130 if interrupted else 1 if doc["result"].get("failed") else 0


def _base_flags(base_args: tuple[str, ...]) -> dict:
    """--serve-args as a config file's mapping (`--flag value` and bare `--switch`)."""
    out, args = {}, list(base_args)
    while args:
        flag = args.pop(0).lstrip("-")
        out[flag] = args.pop(0) if args and not args[0].startswith("--") else True
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}ms"


def _result(args, walk, best, launcher, model_spec, mean_in, seq_len, elapsed) -> dict:
    from fulcrum.tune.facts import hardware_that_meets

    if best is None or best.measurement is None:
        return {"lines": ["the baseline was not measured"], "command": "", "config": {}, "failed": True}
    if walk.baseline.measurement.error:
        why = walk.baseline.measurement.error
        return {"lines": [f"the default configuration did not serve, so nothing was tuned: {why} (its log is in "
                          f"{launcher.logs})"], "command": launcher.command(best.config), "config": {},
                "failed": True, "goodput_rps": 0.0, "baseline_goodput_rps": 0.0, "pd": False}  # fmt: skip
    base_g, g = walk.baseline.measurement.goodput, best.measurement.goodput
    lines = [f"best: {best.config.describe()} (stage {best.stage})"]
    if g > 0:
        gain = (
            f" (x{g / base_g:.2f} the default's {base_g:.3g})"
            if base_g > 0
            else " (the default met the SLO at no load)"
        )
        lines.append(f"goodput under the SLO: {g:.3g} req/s{gain}")
    else:
        limit = walk.baseline.measurement.breaks()
        lines.append(f"unreachable here: no configuration met the SLO; the best run broke {limit}")
        first = best.measurement.points[0].misses if best.measurement.points else []
        what = ("prefill compute (TTFT at the lowest load)" if any(m.startswith(("ttft", "e2e")) for m in first)
                else "decode speed (TPOT at the lowest load)" if first else "failed requests")  # fmt: skip
        lines.append(f"limited by {what}")
        if model_spec is not None:
            meets = hardware_that_meets(model_spec, args.slo, int(mean_in), int(seq_len))
            lines.append("plan's roofline says one of these would meet it: " + ", ".join(meets) if meets
                         else "plan's roofline finds no single catalog GPU that meets it")  # fmt: skip
    final = [t for t in walk.trials if t.stage == "final check" and t.measurement is not None]
    if len(final) == 2:
        d, b = (t.measurement.goodput for t in final)
        ratio = f" (x{b / d:.2f})" if d > 0 else ""
        lines.append(f"final check, back to back: the default {d:.3g} req/s, the best {b:.3g} req/s{ratio}")
    kept = [t for t in walk.trials if t.kept and t.stage not in ("baseline", "final check")]
    lines.append(f"kept changes: {', '.join(t.change for t in kept) or 'none'}; tune took {elapsed / 60:.1f} min")
    return {"lines": lines, "command": launcher.command(best.config), "config": best.config.changes,
            "pd": best.config.pd, "goodput_rps": g, "baseline_goodput_rps": base_g}  # fmt: skip
