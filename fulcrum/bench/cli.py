"""`fulcrum bench serve` (load a server, report) and `fulcrum bench compare` (results side by side)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import math
import os
import signal
import sys
from dataclasses import fields, replace
from pathlib import Path

from fulcrum.bench.workloads import WORKLOADS, LengthDist


def _list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def add_bench_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="measure an OpenAI-compatible server: latency, throughput, goodput, cost")
    verbs = b.add_subparsers(dest="bench_verb", required=True)

    s = verbs.add_parser("serve", help="load a running server and report TTFT, TPOT, ITL, throughput, goodput")
    g = s.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    g.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    g.add_argument(
        "--request-timeout", "--timeout", dest="request_timeout", type=_seconds, default=600.0,
        help="seconds a request may take in all before it counts as failed (timeout)",
    )  # fmt: skip
    g.add_argument(
        "--read-timeout", type=_seconds, default=300.0,
        help="seconds a stream may stay silent (before its first token too) before the request counts as failed",
    )  # fmt: skip
    g = s.add_argument_group("load (a list is a sweep)")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_list(int), help="closed loop: users, e.g. 1,4,16,64")
    load.add_argument("--request-rate", type=_list(float), help="open loop: requests/s, e.g. 2,4,8 or inf")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    g.add_argument("--num-prompts", type=int, default=None, help="requests (conversations) per run; default 100")
    g.add_argument("--duration", type=float, default=None, help="seconds per run (no new requests after it)")
    g.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    g.add_argument("--seed", type=int, default=0)
    add_workload_args(s)
    g = s.add_argument_group("requests")
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM's extension)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-stream-usage", action="store_true", help="don't ask for usage (servers that refuse it)")
    g = s.add_argument_group("report")
    g.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=200ms,tpot=50ms,e2e=5s")
    g.add_argument("--price-per-hour", type=float, default=None, help="dollars per replica-hour, for cost per token")
    g.add_argument("--replicas", type=int, default=1)
    g.add_argument("--out", default=None, help="JSON result with every request's timings")
    g.add_argument("--csv", default=None, help="CSV, one row per run")
    g.add_argument("--plot", default=None, help="folder for PNG plots")
    g.add_argument("--quiet", action="store_true", help="no live progress display")
    g.add_argument(
        "--watchdog", type=_seconds_or_never, default=30.0, metavar="SECONDS",
        help="after this long without a completed request, say on stderr what the run waits for (0: never)",
    )  # fmt: skip
    s.set_defaults(func=run_serve)

    c = verbs.add_parser("compare", help="compare `bench serve --out` results side by side, with ratios")
    c.add_argument("results", nargs="+", help="JSON files; ratios are against the first")
    c.set_defaults(func=run_compare)

    v = verbs.add_parser("view", help="open `bench serve --out` results as charts in a browser (an offline page)")
    v.add_argument("results", nargs="+", help="JSON files (several: compared, runs matched by load label)")
    v.add_argument("--out", default=None, help="where to write the page (default: a new file in the temp folder)")
    v.add_argument("--no-open", dest="open", action="store_false", help="write the page, do not open a browser")
    v.set_defaults(func=run_view)
    return b


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared by `fulcrum bench serve` and `fulcrum tune`."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument(
        "--input-len", type=LengthDist.parse, default=LengthDist.parse(256), help="N, uniform:A:B, normal:M:S"
    )
    g.add_argument("--output-len", type=LengthDist.parse, default=LengthDist.parse(128), help="as --input-len")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups sharing a system prompt")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the shared prompt")
    g.add_argument("--long-fraction", type=float, default=0.1, help="long-prefill: share of long prompts")
    g.add_argument("--long-input-len", type=LengthDist.parse, default=LengthDist.parse(4096))
    g.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    g.add_argument("--dataset", default=None, help="jsonl: a file of prompts or ShareGPT-style conversations")
    g.add_argument(
        "--tokenizer", default=None, help="HF folder for exact prompt lengths and token counts (bench serve without "
        "it: the model's in the local Hugging Face cache, else the server's /tokenize)",
    )  # fmt: skip


def workload_spec(args: argparse.Namespace):
    """The workload the flags of `add_workload_args` describe (checked: bad settings raise ValueError)."""
    from fulcrum.bench.workloads import WorkloadSpec

    return WorkloadSpec(
        name=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        num_groups=args.num_groups,
        prefix_len=args.prefix_len,
        long_fraction=args.long_fraction,
        long_input_len=args.long_input_len,
        turns=args.turns,
        dataset=args.dataset,
        seed=args.seed,
    )


def run_compare(args: argparse.Namespace) -> int:
    from fulcrum.bench.compare import compare_tables
    from fulcrum.bench.report import console

    try:
        tables = compare_tables(args.results)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in tables:
        console().print(t)
    return 0


def run_view(args: argparse.Namespace) -> int:
    """One self-contained HTML file (the page of fulcrum serve's /, its bench viewer, the results inside): it needs no
    server and no network, so it can be mailed or attached to an issue as it is."""
    import tempfile
    import webbrowser

    from fulcrum.bench.compare import load
    from fulcrum.utils.web_page import offline_page

    try:
        docs = [(Path(p).stem, load(p)) for p in args.results]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    else:
        fd, name = tempfile.mkstemp(prefix="fulcrum-bench-", suffix=".html")
        os.close(fd)
        out = Path(name)
    out.write_text(offline_page(docs))
    print(out)
    if args.open and not webbrowser.open(out.resolve().as_uri()):
        print(f"no browser to open here: open {out} in one", file=sys.stderr)
    return 0


def _seconds(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def _seconds_or_never(text: str) -> float:
    return 0.0 if float(text) == 0 else _seconds(text)


def load_specs(args: argparse.Namespace) -> list:
    from fulcrum.bench.loadgen import LoadSpec

    num = args.num_prompts if args.num_prompts is not None else (None if args.duration else 100)
    common = dict(num_prompts=num, duration=args.duration, warmup=args.warmup)
    if args.concurrency:
        return [LoadSpec(concurrency=c, **common) for c in args.concurrency]
    rates = args.request_rate or [math.inf]
    return [
        LoadSpec(request_rate=r, burstiness=args.burstiness, max_concurrency=args.max_concurrency, **common)
        for r in rates
    ]


def run_serve(args: argparse.Namespace) -> int:
    from fulcrum.bench.metrics import parse_slo
    from fulcrum.bench.workloads import TextMaker, sessions
    from fulcrum.errors import FulcrumError

    try:
        loads = load_specs(args)
        slo = parse_slo(args.slo)
        text = TextMaker(_tokenizer(args))
        spec = workload_spec(args)
        next(sessions(spec, text))  # bad workload settings fail here, before any load
    except (ValueError, OSError, FulcrumError) as e:  # a bad setting, file or tokenizer: the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args, loads, spec, slo, text))
    except KeyboardInterrupt:  # a second Ctrl-C: `_serve` has written what it measured to --out
        return 130


def _plain(v):
    return str(v) if isinstance(v, LengthDist) else v


def _tokenizer(args: argparse.Namespace):
    path = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if path is None:
        return None
    from fulcrum.utils.tokenizer import load_tokenizer

    return load_tokenizer(path)


# what stops a run and keeps what it measured: Ctrl-C, and SIGTERM (what `timeout` and job runners send)
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


async def _serve(args, loads, spec, slo, text) -> int:
    import aiohttp

    from fulcrum.bench import report
    from fulcrum.bench.client import Target, discover_model, server_histograms, server_means
    from fulcrum.bench.loadgen import LoadGenerator, until_stop
    from fulcrum.bench.metrics import summarize, summarize_by_tag
    from fulcrum.bench.workloads import sessions

    console = report.console(stderr=True)
    stop = asyncio.Event()
    signals: list[int] = []  # the signal that stopped the run
    loop = asyncio.get_running_loop()

    def on_signal(sig):  # the first stops the run and keeps what it measured; a second one is the default
        signals.append(sig)
        stop.set()
        for s in STOP_SIGNALS:
            loop.remove_signal_handler(s)

    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
            loop.add_signal_handler(sig, on_signal, sig)
    extra = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    if args.no_stream_usage:
        extra["stream_options"] = None  # output tokens then come from --tokenizer, else from the chunks
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    doc = {
        "tool": "fulcrum bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "workload": {f.name: _plain(getattr(spec, f.name)) for f in fields(spec)},
        "prompt_lengths": "exact (tokenizer)" if text.exact else "approximate (words, no tokenizer)",
        "request_timeout_s": args.request_timeout,
        "read_timeout_s": args.read_timeout,
        "partial": True,  # until every point of the sweep has run to its end
        "stopped_by": None,
        "runs": [],
    }

    def record(run, server=None) -> dict:
        kw = dict(slo=slo, price_per_hour=args.price_per_hour, replicas=args.replicas)
        entry = {
            "label": run.load.label,
            "load": run.load.as_dict(),
            "duration_s": run.duration,
            "peak_concurrency": run.peak_concurrency,
            "interrupted": run.interrupted,
            "summary": summarize(run.results, run.duration, **kw),
            "by_tag": summarize_by_tag(run.results, run.duration, **kw),
            "requests": report.request_records(run.results),
        }
        if server is not None:  # the server's own histograms over the point's measured requests
            entry["server"] = server
        doc["runs"].append(entry)
        return entry

    async def scrape(into: list) -> None:
        into.append(await server_histograms(http, args.base_url, headers))

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        try:
            model = args.model
            if model is None:
                discovery = asyncio.ensure_future(discover_model(http, args.base_url, headers))
                if await until_stop(discovery, stop):
                    return 128 + signals[0]
                model = discovery.result()
        except (aiohttp.ClientError, RuntimeError, OSError, asyncio.TimeoutError) as e:
            console.print(f"[red]error:[/] cannot reach {args.base_url}: {e}")
            return 2
        doc["model"] = model
        if not text.exact:  # no --tokenizer: the model's in the Hugging Face cache, or the server's
            from fulcrum.bench.tokens import find_tokenizer
            from fulcrum.bench.workloads import TextMaker

            found = await asyncio.to_thread(find_tokenizer, args.base_url, model, headers)
            doc["prompt_lengths"] = found.source
            if found.tokenizer is not None:
                text = TextMaker(found.tokenizer)
            else:
                tried = "; ".join(found.why_not)
                line = (f"warning: prompt lengths are approximate (words, about one token each): no tokenizer for "
                        f"{model} ({tried}); pass --tokenizer for exact lengths")  # fmt: skip
                console.print(line, markup=False, soft_wrap=True)
        target = Target(args.base_url, model, args.endpoint, args.api_key)
        count = text.count if text.exact else None
        gen = None  # the point being measured, whose requests so far are kept if the run is cut short
        try:
            for i, load in enumerate(loads):
                per_session = spec.turns if spec.name == "multi-turn" else 1
                point = f"{load.label} (point {i + 1} of {len(loads)})" if len(loads) > 1 else load.label
                with _progress(console, load, per_session, args.quiet) as on_result:
                    gen = LoadGenerator(
                        http, target, extra=extra, count_tokens=count, timeout=args.request_timeout,
                        read_timeout=args.read_timeout, on_result=on_result, seed=args.seed + i,
                    )  # fmt: skip
                    scrapes: list = []  # the server's histograms after the warm-up and after the point
                    with _watchdog(console, gen.pulse, point, args.watchdog):
                        # each point of a sweep draws fresh prompts, so a prefix cache cannot serve one from another
                        run = await gen.run(load, sessions(replace(spec, seed=spec.seed + i), text), stop,
                                            functools.partial(scrape, scrapes))  # fmt: skip
                    await scrape(scrapes)
                gen = None
                entry = record(run, server_means(*scrapes) if len(scrapes) == 2 else None)
                report.print_run(report.console(), entry)
                doc["partial"] = run.interrupted or i + 1 < len(loads)
                doc["stopped_by"] = STOP_SIGNALS[signals[0]] if run.interrupted else None
                if args.out:  # after every point, so an interrupted sweep keeps what it measured
                    report.write_json(args.out, doc)
                if run.interrupted:
                    break
        except BaseException as e:  # a second Ctrl-C, a cancelled task, a bug: still keep what was measured
            doc["partial"] = True
            doc["stopped_by"] = _stopped_by(e, signals)
            if gen is not None:
                record(gen.partial())
            if args.out:
                report.write_json(args.out, doc)
                console.print(f"stopped ({doc['stopped_by']}): partial result in {args.out}", markup=False)
            raise
    if len(doc["runs"]) > 1:
        report.console().print(report.sweep_table(doc["runs"]))
    if args.csv:
        report.write_csv(args.csv, doc["runs"])
    if args.plot:
        for p in report.write_plots(args.plot, doc["runs"]):
            console.print(f"plot: {p}")
    return 128 + signals[0] if doc["runs"] and doc["runs"][-1]["interrupted"] else 0


def _stopped_by(e: BaseException, signals: list[int]) -> str:
    if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
        return f"{STOP_SIGNALS[signals[0]]} twice" if signals else "cancelled"
    return f"error: {type(e).__name__}: {e}"


@contextlib.contextmanager
def _watchdog(console, pulse, label: str, interval: float):
    """A line on stderr whenever `interval` seconds pass without a completed request; none when 0."""
    if interval <= 0:
        yield
        return
    from fulcrum.bench.watchdog import Watchdog

    def emit(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    with Watchdog(pulse, label, interval, emit):
        yield


@contextlib.contextmanager
def _progress(console, load, per_session: int, quiet: bool):
    """A live progress line (requests done, in flight, failed); a no-op when quiet."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        total = load.num_prompts * per_session if load.num_prompts else None
        task = progress.add_task(load.label, total=total)
        failed = 0

        def on_result(r, inflight: int) -> None:
            nonlocal failed
            failed += not r.ok
            desc = f"{load.label}: {inflight} in flight, {failed} failed"
            progress.update(task, advance=1, description=desc)

        yield on_result
