"""`fulcrum sim`: a serving fleet simulated on fulcrum's own scheduler, router policies and autoscaler, with step costs
calibrated on this machine (`fulcrum sim calibrate`) or predicted by plan's roofline for catalog hardware. Its report
is `fulcrum bench serve`'s (same tables, same JSON), so `fulcrum bench compare` sets a simulated run beside a live
one. Bad flags are one line and exit 2."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from fulcrum.bench.cli import add_workload_args, workload_spec
from fulcrum.defaults import DEFAULT_MODEL
from fulcrum.router.policies import POLICIES
from fulcrum.utils.arg_types import checked, one_line_errors, positive_float, positive_int, seconds_with_unit

DEFAULT_NUM_PROMPTS = 1000


def _list(kind):
    def parse(text: str):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
        return values

    return parse


def parse_autoscale(text: str):
    """`MIN,MAX[,ttft=500ms][,itl=100ms][,target=4]`: the replica range, the SLO that adds a replica, and the
    concurrency per replica the pool is sized for."""
    from fulcrum.router.autoscaler import SLO, ScalerConfig, parse_slo

    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        lo, hi = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--autoscale takes MIN,MAX[,ttft=...][,itl=...][,target=N], not {text!r}"
        ) from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"--autoscale: need 1 <= MIN <= MAX, got {lo},{hi}")
    cfg = ScalerConfig(min_replicas=lo, max_replicas=hi, slo=SLO())
    rest = []
    for p in parts[2:]:
        if p.startswith("target="):
            try:
                cfg.target_concurrency = float(p.partition("=")[2])
            except ValueError:
                raise argparse.ArgumentTypeError(f"--autoscale: bad target {p!r}") from None
            if cfg.target_concurrency <= 0:
                raise argparse.ArgumentTypeError("--autoscale: target must be > 0")
        else:
            rest.append(p)
    try:
        cfg.slo = parse_slo(",".join(rest)) if rest else SLO()
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--autoscale: {e}") from None
    return cfg


def add_sim_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sim",
        help="simulate a serving fleet (replicas, routing, autoscaling, P/D) on fulcrum's own scheduler with "
        "calibrated step costs; reports as `fulcrum bench serve` does",
        description="Runs fulcrum's Scheduler and KV-cache manager per simulated replica, the router's policies "
        "and the autoscaler on a simulated clock; only the model forward is replaced by a step-cost model: one "
        "calibrated on this machine (`fulcrum sim calibrate`), or plan's roofline for --hardware NAME.",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder or plan preset (default: bundled)")
    p.add_argument("--hardware", default="local", help="local (calibrated step costs) or a catalog name (predicted)")
    p.add_argument("--costs", default=None, help="a step-cost file from `fulcrum sim calibrate` (default: this "
                   "machine's calibration of --model)")  # fmt: skip
    p.add_argument(
        "--dtype", default=None, help="the weights' dtype (default: the model's; finds that calibration here)"
    )
    p.add_argument("--kv-cache-dtype", default=None, help="the KV cache's dtype (finds that calibration here)")
    p.add_argument("--quantization", default=None, help="the engine's online quantization (finds that calibration)")
    p.add_argument("--quantization-group-size", type=positive_int, default=128)
    p.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=positive_int, default=1,
                   help="--hardware NAME: GPUs per replica")  # fmt: skip
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=positive_int, default=1)
    g.add_argument("--policy", choices=sorted(POLICIES), default="round-robin", help="the router's policy")
    g.add_argument("--balance-margin", type=positive_float, default=4.0, help="prefix policies' load guard")
    g.add_argument("--prefill-replicas", type=positive_int, default=None, help="P/D: prefill engines")
    g.add_argument("--decode-replicas", type=positive_int, default=None, help="P/D: decode engines")
    g.add_argument("--pd-min-prompt-tokens", type=int, default=32, help="P/D: shorter prompts skip the prefill pool")
    g.add_argument("--autoscale", type=checked(parse_autoscale), default=None,
                   help="MIN,MAX[,ttft=500ms][,itl=100ms][,target=N]: the router's autoscaler")  # fmt: skip
    g.add_argument("--replica-startup", type=checked(seconds_with_unit), default=10.0,
                   help="seconds a scaled-up replica takes to serve (default 10s)")  # fmt: skip
    g.add_argument("--router-latency", type=checked(seconds_with_unit), default=0.0,
                   help="the router's own hop per request (default 0)")  # fmt: skip
    g.add_argument(
        "--frontend-latency",
        type=checked(seconds_with_unit),
        default=None,
        help="a request's time outside the engine before its first step (default: the calibration's)",
    )
    g.add_argument(
        "--kv-transfer-per-block",
        type=checked(seconds_with_unit),
        default=None,
        help="P/D: seconds to move one KV block (default: the calibration's)",
    )
    g = p.add_argument_group("engine (default: as calibrated)")
    g.add_argument("--num-blocks", type=positive_int, default=None, help="KV blocks per replica")
    g.add_argument("--max-num-seqs", type=positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--block-size", type=positive_int, default=None)
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    g.add_argument("--no-enable-chunked-prefill", dest="chunked_prefill", action="store_false")
    g = p.add_argument_group("load (a list is a sweep)")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=_list(float), default=None, help="open loop: requests/s, e.g. 2,4,8")
    load.add_argument("--concurrency", type=_list(int), default=None, help="closed loop: users")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=positive_int, default=None, help="open loop: cap on requests in flight")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help=f"sessions per run (default {DEFAULT_NUM_PROMPTS} unless --duration)")  # fmt: skip
    g.add_argument("--duration", type=checked(seconds_with_unit), default=None,
                   help="simulated seconds of arrivals per run")  # fmt: skip
    g.add_argument("--seed", type=int, default=0)
    add_workload_args(p)
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=5s")
    g.add_argument("--price-per-hour", type=positive_float, default=None, help="dollars per replica-hour")
    g.add_argument("--out", default=None, help="JSON result, as `fulcrum bench serve --out` writes it")
    g.add_argument("--csv", default=None, help="CSV, one row per run")
    g.add_argument("--no-requests", action="store_true", help="leave each request's timings out of --out")
    p.set_defaults(func=run_sim, sim_verb=None)
    p.error = one_line_errors("sim")
    verbs = p.add_subparsers(dest="sim_verb")
    from fulcrum.sim.calibrate import add_calibrate_args, run_calibrate

    c = verbs.add_parser("calibrate", help="measure the engine's steps on this machine and fit the step-cost model")
    add_calibrate_args(c)
    c.set_defaults(func=run_calibrate)
    c.error = one_line_errors("sim calibrate")
    return p


def _error(message: str) -> int:
    print(f"fulcrum sim: {message}", file=sys.stderr)
    return 2


# -- building the simulation -----------------------------------------------------------------------------


def load_costs(args):
    """(costs, spec): the step-cost model the flags name, and the model's shape."""
    from fulcrum.plan.catalog import get_hardware
    from fulcrum.plan.model_spec import load_model_spec
    from fulcrum.plan.step_costs import RooflineCosts, StepCosts

    spec = load_model_spec(args.model)
    if args.costs:
        return StepCosts.load(args.costs), spec
    if args.hardware.lower() == "local":
        from fulcrum.probe.step_costs import default_costs_path

        path = default_costs_path(args.model, args.dtype or "auto", args.kv_cache_dtype or "auto", None,
                                  args.quantization, args.quantization_group_size)  # fmt: skip
        if not Path(path).is_file():
            raise ValueError(f"no step-cost calibration of {args.model} on this machine ({path}): run "
                             f"`fulcrum sim calibrate {args.model}` first, or give --costs FILE or --hardware NAME")  # fmt: skip
        return StepCosts.load(path), spec
    hw = get_hardware(args.hardware)
    dtype = args.dtype or spec.dtype
    return RooflineCosts(spec, hw, dtype, args.kv_cache_dtype or dtype, tp=args.tp), spec


def engine_shape(args, costs, spec):
    """The engine settings of each replica: the flags, else the calibration's (its step budget: the served one, what
    `fulcrum serve` took with those settings), else the engine's defaults (and for predicted hardware, the KV blocks
    its memory holds after the weights)."""
    from fulcrum.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
    from fulcrum.sim.replica import EngineShape

    eng = getattr(costs, "engine", {}) or {}
    block_size = args.block_size or int(eng.get("block_size", 16))
    max_model_len = args.max_model_len or int(eng.get("max_model_len") or spec.max_position_embeddings or 4096)
    num_blocks = args.num_blocks or eng.get("num_blocks")
    if num_blocks is None:
        num_blocks = predicted_blocks(costs, spec, block_size)
    return EngineShape(
        num_blocks=int(num_blocks),
        block_size=block_size,
        max_num_seqs=args.max_num_seqs or int(eng.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
        max_num_batched_tokens=args.max_num_batched_tokens
        or getattr(costs, "step_budget", None)
        or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_model_len=max_model_len,
        enable_prefix_caching=args.prefix_caching,
        enable_chunked_prefill=args.chunked_prefill,
    )


def predicted_blocks(costs, spec, block_size: int) -> int:
    """KV blocks a catalog GPU holds: 90% of its memory (times the TP degree) after the weights."""
    from fulcrum.plan.model_spec import DTYPE_BYTES, kv_bytes_per_token, parameter_counts

    hw = getattr(costs, "hw", None)
    if hw is None:
        raise ValueError("the step-cost file does not say how many KV blocks a replica holds: give --num-blocks")
    tp = getattr(costs, "tp", 1)
    weights = parameter_counts(spec).total * DTYPE_BYTES[costs.dtype]
    free = 0.9 * hw.memory_bytes * tp - weights
    per_block = kv_bytes_per_token(spec, costs.engine["kv_cache_dtype"]) * block_size
    if free <= per_block:
        raise ValueError(f"{spec.name} in {costs.dtype} does not fit {tp} x {hw.name} with room for a KV cache")
    return int(free // per_block)


def _requests(tracks):
    """The simulated requests as bench's RequestResult records (times relative to the run's start)."""
    from fulcrum.bench.client import RequestResult

    out = []
    for t in tracks:
        ok = t.error is None and bool(t.token_times)
        r = RequestResult(session=t.session.id, turn=t.turn, tag=t.tag, input_len=t.input_len, start=t.start)
        r.ok, r.error = ok, t.error
        if ok:
            r.ttft = t.token_times[0] - t.start
            r.e2e = t.token_times[-1] - t.start
            r.chunk_times = [x - t.start for x in t.token_times]
            r.prompt_tokens = len(t.prompt_ids)
            r.output_tokens = len(t.token_times)
            r.token_source = "usage"
        out.append(r)
    return out


def run_sim(args: argparse.Namespace) -> int:
    from fulcrum.bench import report
    from fulcrum.bench.metrics import parse_slo, summarize, summarize_by_tag
    from fulcrum.errors import ModelLoadError, UnknownHardwareError
    from fulcrum.router.pd import PDConfig
    from fulcrum.sim.fleet import Fleet, FleetConfig, Load
    from fulcrum.sim.workload import token_sessions

    try:
        slo = parse_slo(args.slo)
        spec_w = workload_spec(args)
        costs, mspec = load_costs(args)
        shape = engine_shape(args, costs, mspec)
        pd = args.prefill_replicas is not None or args.decode_replicas is not None
        fleet_cfg = FleetConfig(
            replicas=args.replicas,
            policy=args.policy,
            prefill_replicas=args.prefill_replicas or 0,
            decode_replicas=args.decode_replicas or 0,
            autoscale=args.autoscale,
            replica_startup_s=args.replica_startup,
            router_s=args.router_latency,
            balance_margin=args.balance_margin,
            pd=PDConfig(min_prompt_tokens=args.pd_min_prompt_tokens),
        )
        if pd and args.replicas != 1:
            raise ValueError("--replicas is the size of one pool; with P/D give --prefill-replicas and "
                             "--decode-replicas")  # fmt: skip
        fleet_cfg.check()
        encode = _encoder(args, mspec.vocab)
        timed = False
        if spec_w.name == "jsonl":  # a trace with its own arrival times needs no rate
            first = next(token_sessions(spec_w, mspec.vocab, encode))
            timed = first.arrival is not None
        if args.request_rate is None and args.concurrency is None and not timed:
            raise ValueError("give --request-rate (open loop) or --concurrency (closed loop)")
        loads = [("rate", r) for r in args.request_rate or []] + [("concurrency", c) for c in args.concurrency or []]
        if timed:
            if loads:
                raise ValueError("the trace has its own arrival times: drop --request-rate/--concurrency")
            loads = [("rate", math.inf)]
        num_prompts = args.num_prompts
        if num_prompts is None and args.duration is None:
            num_prompts = None if timed else DEFAULT_NUM_PROMPTS
    except (ValueError, ModelLoadError, UnknownHardwareError) as e:
        return _error(str(e))

    console = report.console()
    label = "predicted (roofline, " + args.hardware + ")" if costs.source == "predicted" else "calibrated"
    fit = getattr(costs, "fit", {}) or {}
    held = fit.get("held_out")
    err = held.get("p90_abs_rel_error") if isinstance(held, dict) else None
    console.print(
        f"step costs: {label}" + (f" (held-out steps: p90 error {err:.0%})" if isinstance(err, float) else "")
        + f"; frontend {costs.frontend_s * 1e3 if args.frontend_latency is None else args.frontend_latency * 1e3:.1f} ms;"
        f" replica: {shape.num_blocks} KV blocks of {shape.block_size}, max {shape.max_num_seqs} seqs, "
        f"{shape.max_num_batched_tokens} tokens a step"
    )  # fmt: skip
    doc = {
        "tool": "fulcrum sim",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "simulated": True,
        "step_costs": {"source": costs.source, "file": args.costs, "hardware": args.hardware,
                       "fit": fit, "engine": getattr(costs, "engine", {}), "machine": getattr(costs, "machine", {})},
        "fleet": {f.name: _plain(getattr(fleet_cfg, f.name)) for f in fields(fleet_cfg)},
        "engine": shape.__dict__,
        "model": mspec.name,
        "workload": {f.name: _plain(getattr(spec_w, f.name)) for f in fields(spec_w)},
        "prompt_lengths": "exact (token ids)",
        "runs": [],
    }  # fmt: skip
    for i, (kind, value) in enumerate(loads):
        load = Load(
            rate=value if kind == "rate" else None,
            concurrency=value if kind == "concurrency" else None,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            num_prompts=num_prompts,
            duration=args.duration,
            seed=args.seed + i,
        )
        fleet = Fleet(replace(fleet_cfg), shape, costs, args.frontend_latency, args.kv_transfer_per_block)
        sessions = token_sessions(replace(spec_w, seed=spec_w.seed + i), mspec.vocab, encode)
        t0 = time.perf_counter()
        res = fleet.run(sessions, load)
        wall = time.perf_counter() - t0
        results = _requests(res.tracks)
        replicas = res.replica_seconds / res.duration if res.duration > 0 else 1.0
        kw = dict(slo=slo, price_per_hour=args.price_per_hour, replicas=replicas)
        label_ = "concurrency " + str(value) if kind == "concurrency" else (
            "trace" if timed else f"rate {value:g}/s" + (f" (burstiness {args.burstiness:g})"
                                                         if args.burstiness != 1 else ""))  # fmt: skip
        summary = summarize(results, res.duration, **kw)
        if args.price_per_hour is not None:
            summary["replica_seconds"] = res.replica_seconds
        hits = sum(r["prefix_cache_hits"] for r in res.replicas.values())
        queries = sum(r["prefix_cache_queries"] for r in res.replicas.values())
        entry = {
            "label": label_,
            "load": {"concurrency": load.concurrency, "request_rate": "inf" if timed else load.rate,
                     "burstiness": load.burstiness, "max_concurrency": load.max_concurrency,
                     "num_prompts": load.num_prompts, "duration": load.duration},
            "duration_s": res.duration,
            "peak_concurrency": res.peak_concurrency,
            "interrupted": False,
            "summary": summary,
            "by_tag": summarize_by_tag(results, res.duration, **kw),
            "sim": {
                "wall_s": wall,
                "events": res.sim_events,
                "replica_seconds": res.replica_seconds,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "preemptions": sum(r["preemptions"] for r in res.replicas.values()),
                "routes": res.routes,
                "scale_events": res.scale_events,
                "replicas": res.replicas,
            },
            "requests": [] if args.no_requests else report.request_records(results),
        }  # fmt: skip
        doc["runs"].append(entry)
        report.print_run(console, entry)
        sim = entry["sim"]
        console.print(
            f"  fleet: {len(res.replicas)} replica(s), {res.replica_seconds:,.1f} replica-seconds, prefix-cache hit "
            f"rate {sim['prefix_cache_hit_rate']:.1%}, {sim['preemptions']} preemptions; routed: "
            + (", ".join(f"{k} {v}" for k, v in sorted(res.routes.items())) or "-")
        )
        for ev in res.scale_events:
            console.print(f"  autoscaler at {ev['at_s']:.1f} s: {ev['kind']} to {ev['replicas']} ({ev['reason']})")
        console.print(
            f"  simulated {res.duration:,.1f} s ({len(results):,} requests, {res.sim_events:,} events) in {wall:.1f} s"
        )
        if args.out:
            report.write_json(args.out, doc)
    if len(doc["runs"]) > 1:
        console.print(report.sweep_table(doc["runs"]))
    if args.csv:
        report.write_csv(args.csv, doc["runs"])
    return 0


def _encoder(args, vocab: int):
    """A jsonl trace's text to ids: --tokenizer, else the model folder's tokenizer, else word ids."""
    if args.workload != "jsonl":
        return None
    folder = args.tokenizer or (args.model if Path(args.model, "tokenizer_config.json").is_file() else None)
    if folder is None:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return lambda text: tok.encode(text, add_special_tokens=False)


def _plain(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "__dataclass_fields__"):
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v)}
    return str(v)
