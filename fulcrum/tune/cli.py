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
from fulcrum.utils.arg_types import (
    checked,
    non_negative_float,
    non_negative_int,
    one_line_errors,
    positive_float,
    positive_int,
)

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
    p.add_argument("--slo", type=checked(parse_slo), default=parse_slo(DEFAULT_SLO),
                   help=f"latency SLOs as METRIC_STAT=VALUE (ttft, tpot, itl, e2e; mean, p50, p90, p95, p99), "
                   f"default {DEFAULT_SLO}")  # fmt: skip
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=positive_float, default=None,
                      help="requests/s the fleet must hold: scale-out sizes replicas for it, and a load point that "
                      "reaches it needs no higher load")  # fmt: skip
    load.add_argument("--concurrency", type=positive_int, default=None,
                      help="the most users at once the service sees: the load rises up to it (default 64)")  # fmt: skip
    p.add_argument("--max-quality-loss", type=checked(parse_quality), default=parse_quality(DEFAULT_QUALITY),
                   help="bounds on `fulcrum eval` against the unquantized model a quantized candidate must meet "
                   f"before it is measured: kl, kl_p99, top1, ppl_ratio (default {DEFAULT_QUALITY})")  # fmt: skip
    p.add_argument("--budget", type=duration, default=duration("20m"), help="wall time for the whole tune (20m)")
    p.add_argument("--hardware", default="local",
                   help="local (this machine, measured), or the catalog name of the GPUs here (H100-SXM, ...), "
                   "whose memory sizes what fits")  # fmt: skip
    p.add_argument("--count", type=positive_int, default=None, help="cores or GPUs to use (default: all)")
    p.add_argument("--price-per-hour", type=positive_float, default=None,
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
    p.add_argument("--min-gain", type=non_negative_float, default=0.05,
                   help="a change is kept when goodput rose by more (0.05)")  # fmt: skip
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="requests each server answers unmeasured before its first load point (default: 2 on CPU, "
                   "8 on GPUs, whose kernels compile on first use)")  # fmt: skip
    p.add_argument("--point-seconds", type=positive_float, default=20.0, help="the longest one load point runs")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_workload_args(p)
    p.set_defaults(func=run_tune)
    p.error = one_line_errors("tune")  # one line, not argparse's usage block
    return p


def _error(message: str) -> int:
    print(f"fulcrum tune: {message}", file=sys.stderr)
    return 2


def run_tune(args: argparse.Namespace) -> int:
    from fulcrum.bench.workloads import TextMaker
    from fulcrum.errors import FulcrumError
    from fulcrum.model_folder.source import resolve_model
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
        base_flags = _base_flags(base_args)
        spec = workload_spec(args)
        text = TextMaker(_tokenizer(args))
        workload = F.workload_facts(spec, text)
        model_spec = load_model_spec(args.folder) if args.folder else None
        machine = _machine(args)
    except (ValueError, OSError, FulcrumError) as e:
        return _error(str(e))
    tune = Tune(args, exposed, base_args, base_flags, spec, text, workload, model_spec, machine)
    return tune.run()


def _machine(args):
    """Where the candidates run: this machine, its GPUs sized by a catalog entry when --hardware names one."""
    from fulcrum.plan.catalog import get_hardware
    from fulcrum.tune import facts as F

    local = F.this_machine(args.count)
    if args.hardware.lower() == "local":
        return local
    hw = get_hardware(args.hardware)
    if local.device != "cuda":  # tune measures, so the hardware must be here
        raise ValueError(f"--hardware {hw.name}: this machine has no GPU, and tune measures rather than predicts "
                         f"(fulcrum plan --hardware {hw.name} predicts)")  # fmt: skip
    return F.Machine("cuda", local.units, hw.memory_bytes, hw.name)


def _tokenizer(args):
    path = args.tokenizer or args.folder
    if path is None:
        return None
    from fulcrum.utils.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _base_flags(base_args: tuple[str, ...]) -> dict:
    """--serve-args as a config file's mapping (`--flag value`, `--flag=value`, a bare `--switch`)."""
    out, args = {}, list(base_args)
    while args:
        token = args.pop(0)
        if not token.startswith("--"):
            raise ValueError(f"--serve-args: write long flags (--data-parallel-size 2, not -dp 2): got {token!r}")
        flag, eq, value = token[2:].partition("=")
        out[flag] = value if eq else args.pop(0) if args and not args[0].startswith("-") else True
    return out


def _stop(signum, frame):
    """Ctrl-C, or SIGTERM (what `timeout` and job runners send): the walk stops, servers stopped, report kept.
    Raised here, not left to Python's default: inside a measurement asyncio.run would turn SIGINT into a
    cancellation of its task, which a load run that is itself stopping its requests can absorb, so the tune
    walked on; and a tune started with SIGINT ignored (a background job of a script) would not stop at all."""
    raise KeyboardInterrupt


class Tune:
    """One `fulcrum tune` run: the facts, the walk with its progress lines, and the report."""

    def __init__(self, args, exposed, base_args, base_flags, spec, text, workload, model_spec, machine):
        from fulcrum.tune import facts as F
        from fulcrum.utils.console import wide_console

        self.args, self.spec, self.text, self.workload = args, spec, text, workload
        self.model_spec, self.machine, self.base_flags = model_spec, machine, base_flags
        self.console = wide_console(stderr=True, width=150)
        self.cap = args.concurrency or 64
        self.out = Path(args.out or f"tune-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        self.price, self.price_note = args.price_per_hour, "given"
        if self.price is None:
            self.price, self.price_note = F.ASSUMED_PRICE[machine.device] * machine.units, "assumed"
        self.exposed, self.base_args = exposed, base_args

    def facts(self):
        from fulcrum.tune import facts as F

        args, w, spec, machine = self.args, self.workload, self.model_spec, self.machine
        bundled = Path(args.model).resolve() == DEFAULT_MODEL.resolve()
        check = F.MemoryCheck(spec, machine, int(w.max_input_len + w.max_output_len), self.cap) if spec else None
        if args.serve_cmd:
            pd_possible = "the server command is another engine's: P/D needs fulcrum's router and connectors"
        elif machine.units < 2:
            pd_possible = f"one {'GPU' if machine.device == 'cuda' else 'core'}: no room for two engines"
        else:
            pd_possible = None
        return F.Facts(
            device=machine.device,
            units=machine.units,
            num_heads=spec.num_heads if spec else 0,
            num_kv_heads=spec.num_kv_heads if spec else 0,
            num_layers=spec.num_layers if spec else 0,
            shares_prefixes=w.shares_prefixes,
            mean_input_len=w.mean_input_len,
            mean_output_len=w.mean_output_len,
            kv_cache_need_gib=check.kv_gib(spec.dtype) if check and machine.device == "cpu" else None,
            kv_cache_default_gib=F.DEFAULT_CPU_KV_BYTES / 2**30 if machine.device == "cpu" else None,
            fits=check or (lambda c: None),
            draft=args.draft or (str(BUNDLED_DRAFT) if bundled else None),
            quantizations=args.try_quantization if args.try_quantization is not None else ONLINE_QUANTIZATIONS,
            exposes=(lambda k: k in self.exposed) if self.exposed is not None else (lambda k: True),
            pd_possible=pd_possible,
            fulcrum_server=not args.serve_cmd,
            target_rate=args.rate,
            price_per_hour=self.price,
            router_policy="prefix" if w.shares_prefixes else "least-load",
        )

    def target_lines(self) -> list[str]:
        args, w = self.args, self.workload
        turns = f", {w.turns} turns a conversation" if w.turns > 1 else ""
        return [
            f"SLO: {', '.join(str(b) for b in args.slo)}; goodput = requests/s of the best load point meeting every "
            "bound",
            f"workload: {args.workload}{turns}, prompts mean {w.mean_input_len:.0f} / max {w.max_input_len:.0f} "
            f"tokens, outputs mean {w.mean_output_len:.0f} / max {w.max_output_len:.0f} tokens "
            f"({'exact, tokenizer' if self.text.exact else 'approximate, words'}); prefixes "
            + ("shared" if w.shares_prefixes else "not shared"),
            f"load: closed loop, concurrency doubling up to {self.cap}"
            + (f"; the fleet must hold {args.rate:g} req/s" if args.rate else ""),
            "quality bound for quantized candidates: "
            + ", ".join(f"{k}={v:g}" for k, v in args.max_quality_loss.items()),
            f"price: ${self.price:.2f}/h for this machine ({self.price_note})",
        ]

    def on_point(self, p) -> None:
        if self.args.quiet:
            return
        s = p.summary
        mark = "meets the SLO" if p.passed else f"breaks it: {p.cut_short or '; '.join(p.misses) or 'failures'}"
        self.console.print(f"    concurrency {p.concurrency}: {s['request_throughput']:.2f} req/s, TTFT p90 "
                           f"{_ms(s['ttft_ms']['p90'])}, TPOT p90 {_ms(s['tpot_ms']['p90'])}: {mark}",
                           markup=False)  # fmt: skip

    def progress(self, stage: str, change: str, left: float) -> None:
        if not self.args.quiet:
            self.console.print(f"[bold]{stage}[/]: {change}  [dim]({max(left, 0) / 60:.1f} min of budget left)[/]")

    def run(self) -> int:
        from fulcrum.tune import report
        from fulcrum.tune.launch import Launcher, stop_all
        from fulcrum.tune.measure import LiveMeasurer, LoadPlan
        from fulcrum.tune.quality import EvalGate
        from fulcrum.tune.search import Walk
        from fulcrum.utils.console import wide_console

        args, machine = self.args, self.machine
        target_lines = self.target_lines()
        self.console.print("[bold]stage 1: target[/]")
        for line in target_lines:
            self.console.print(f"  {line}", markup=False)
        launcher = Launcher(args.model, self.out / "logs", serve_cmd=args.serve_cmd, base_args=self.base_args,
                            device=machine.device, units=machine.units)  # fmt: skip
        warmup = args.warmup if args.warmup is not None else 8 if machine.device == "cuda" else 2
        load = LoadPlan(max_concurrency=self.cap, point_seconds=args.point_seconds, target_rate=args.rate,
                        warmup=warmup, turns=self.workload.turns)  # fmt: skip
        measurer = LiveMeasurer(launcher, self.spec, self.text, args.slo, load, endpoint=args.endpoint,
                                on_point=self.on_point)  # fmt: skip
        gate = EvalGate(args.folder)
        walk = Walk(measurer.measure, gate, self.facts(), args.max_quality_loss, args.budget, args.min_gain,
                    self.progress, fleet=self.fleet_sim(),
                    fleet_why="--serve-cmd is another engine: fulcrum sim simulates fulcrum's")  # fmt: skip
        t0, stopped_by = time.monotonic(), None
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            walk.run()
        except KeyboardInterrupt:
            stopped_by = "interrupted"
        except Exception as e:  # a bug, or something the walk did not foresee: keep what was measured
            stopped_by = f"error: {type(e).__name__}: {e}"
        finally:
            stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        elapsed = time.monotonic() - t0
        doc = {
            "tool": "fulcrum tune",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": args.model,
            "machine": machine.describe(),
            "budget_s": args.budget,
            "elapsed_s": elapsed,
            "interrupted": stopped_by == "interrupted",
            "stopped_by": stopped_by,
            "eval_seconds": gate.seconds,
            "target": {
                "slo": ", ".join(str(b) for b in args.slo),
                "lines": target_lines,
                "workload": args.workload,
                "rate": args.rate,
            },  # fmt: skip
        }
        doc["result"] = _result(args, walk, launcher, self.model_spec, self.workload, elapsed)
        tables = report.stage_tables(walk.trials, self.price)
        paths = report.write(self.out, doc, walk.trials, tables, self.config_files(walk.best, launcher))
        with contextlib.suppress(OSError):  # stdout or stderr closed (a pipe whose reader left)
            if stopped_by:
                self.console.print(f"{stopped_by}: the servers are stopped; the report has what was measured",
                                   markup=False)  # fmt: skip
            report.print_tables(wide_console(width=150), tables)
            for line in doc["result"]["lines"] + doc["result"]["commands"]:
                print(line)
            print(f"report: {', '.join(str(p) for p in paths)}")
        if stopped_by == "interrupted":
            return 130
        return 1 if stopped_by or doc["result"].get("failed") else 0

    def fleet_sim(self):
        """`fulcrum sim` on the walk's workload and SLO for scale out and P/D (None for another engine's server)."""
        from fulcrum.tune.fleet import FleetSim

        if self.args.serve_cmd:
            return None
        return FleetSim(self.args.model, self.spec, self.args.slo, self.out / "sim",
                        dtype=str(self.base_flags.get("dtype", "auto")), tokenizer=self.args.tokenizer,
                        device=self.machine.device)  # fmt: skip

    def config_files(self, best, launcher) -> dict[str, dict]:
        """The winner as `fulcrum serve --config` files: one, or P/D's two engines."""
        if best is None:
            return {}
        base = {"model": self.args.model, **self.base_flags}
        if not best.config.pd:
            return {"serve-config.yaml": {**base, **best.config.file_flags()}}
        names = {"producer": "serve-config-prefill.yaml", "consumer": "serve-config-decode.yaml"}
        return {names[role]: {**base, **one.file_flags()} for role, one, _ in launcher.pd_engines(best.config)}


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}ms"


def _result(args, walk, launcher, model_spec, workload, elapsed) -> dict:
    """The answer in words: the best, its gain, the final back-to-back check, or why nothing met the SLO."""
    from fulcrum.tune.facts import hardware_that_meets

    best = walk.best
    if best is None or best.measurement is None:
        return {"lines": ["the baseline was not measured"], "commands": [], "config": {}, "failed": True}
    commands = launcher.commands(best.config)
    if walk.baseline.measurement.error:
        why = walk.baseline.measurement.error
        return {"lines": [f"the default configuration did not serve, so nothing was tuned: {why} (its log is in "
                          f"{launcher.logs})"], "commands": commands, "config": {}, "failed": True,
                "goodput_rps": 0.0, "baseline_goodput_rps": 0.0, "pd": False}  # fmt: skip
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
        lines.append(f"unreachable here: no configuration met the SLO; the best run broke {best.measurement.breaks()}")
        first = best.measurement.points[0].misses if best.measurement.points else []
        what = ("prefill compute (TTFT at the lowest load)" if any(m.startswith(("ttft", "e2e")) for m in first)
                else "decode speed (TPOT at the lowest load)" if first else "failed requests")  # fmt: skip
        lines.append(f"limited by {what}")
        if model_spec is not None:
            seq_len = int(workload.max_input_len + workload.max_output_len)
            meets = hardware_that_meets(model_spec, args.slo, int(workload.mean_input_len), seq_len)
            lines.append("plan's roofline says one of these would meet it: " + ", ".join(meets) if meets
                         else "plan's roofline finds no single catalog GPU that meets it")  # fmt: skip
    final = [t for t in walk.trials if t.stage == "final check" and t.measurement is not None]
    if len(final) == 2:
        d, b = (t.measurement.goodput for t in final)
        ratio = f" (x{b / d:.2f})" if d > 0 else ""
        lines.append(f"final check, back to back: the default {d:.3g} req/s, the best {b:.3g} req/s{ratio}")
    kept = [t for t in walk.trials if t.kept and t.stage not in ("baseline", "final check")]
    lines.append(f"kept changes: {', '.join(t.change for t in kept) or 'none'}; tune took {elapsed / 60:.1f} min")
    return {"lines": lines, "commands": commands, "command": "\n".join(commands), "config": best.config.changes,
            "pd": best.config.pd, "goodput_rps": g, "baseline_goodput_rps": base_g}  # fmt: skip
