"""What a run leaves behind: tables on the terminal, JSON (every request's timings), CSV and plots."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fulcrum.bench.client import gaps
from fulcrum.bench.metrics import LATENCIES, PERCENTILES
from fulcrum.utils.console import wide_console


def console(stderr: bool = False) -> Console:
    """Wide enough for the sweep table when the output is a file or a pipe."""
    return wide_console(stderr, width=150)


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _num(v, digits=2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def summary_table(title: str, s: dict) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("latency (ms)")
    for col in ("mean", *(f"p{p}" for p in PERCENTILES)):
        t.add_column(col, justify="right")
    for name in LATENCIES:
        d = s[f"{name}_ms"]
        t.add_row(name.upper(), _ms(d["mean"]), *(_ms(d[f"p{p}"]) for p in PERCENTILES))
    return t


def totals_lines(s: dict, peak: int | None = None) -> list[str]:
    lines = [
        f"completed {s['completed']}, failed {s['failed']}"
        + (f" ({', '.join(f'{k}: {v}' for k, v in s['failures'].items())})" if s["failures"] else "")
        + f", in {s['duration_s']:.2f} s"
        + (f", peak concurrency {peak}" if peak is not None else ""),
        f"throughput: {_num(s['request_throughput'])} req/s, {_num(s['output_throughput'], 1)} output tok/s, "
        f"{_num(s['total_token_throughput'], 1)} total tok/s",
        "output tokens counted by: " + (", ".join(f"{k} ({v})" for k, v in s["token_source"].items()) or "-"),
    ]
    if "goodput" in s:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput: {_num(s['goodput'])} req/s under {slo} ({s['slo_attainment']:.0%} of requests)")
    if "cost_per_1m_output_tokens" in s:
        lines.append(
            f"cost at ${s['price_per_hour']:g}/h x {s['replicas']}: "
            f"${_num(s['cost_per_1m_output_tokens'])} per 1M output tokens, "
            f"${_num(s['cost_per_1m_total_tokens'])} per 1M total tokens"
        )
    return lines


def print_run(console: Console, run: dict) -> None:
    s = run["summary"]
    console.print(summary_table(run["label"], s))
    for line in totals_lines(s, run["peak_concurrency"]):
        console.print("  " + line)
    for tag, ts in run.get("by_tag", {}).items():
        console.print(
            f"  {escape(tag)}: {ts['completed']} req: TTFT p50 {_ms(ts['ttft_ms']['p50'])} p99 {_ms(ts['ttft_ms']['p99'])}"
            f" ms, ITL p50 {_ms(ts['itl_ms']['p50'])} p99 {_ms(ts['itl_ms']['p99'])} ms,"
            f" TPOT p50 {_ms(ts['tpot_ms']['p50'])} ms"
        )
    server = run.get("server")
    if server and server.get("ttft_mean_ms") is not None:
        console.print(
            f"  the server's own histograms ({server['requests']:.0f} req): TTFT mean {_ms(server['ttft_mean_ms'])} ms"
            f" (here {_ms(s['ttft_ms']['mean'])}), E2E mean {_ms(server['e2e_mean_ms'])} ms (here {_ms(s['e2e_ms']['mean'])})"
        )
    if run.get("interrupted"):
        console.print("  [bold yellow]interrupted: partial result[/]")


def sweep_table(runs: list[dict]) -> Table:
    t = Table(title="sweep", title_justify="left")
    cols = ("load", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "E2E p50", "peak", "failed")
    has_goodput = any("goodput" in r["summary"] for r in runs)
    for c in cols + (("goodput",) if has_goodput else ()):
        t.add_column(c, justify="left" if c == "load" else "right")
    for r in runs:
        s = r["summary"]
        row = [
            r["label"],
            _num(s["request_throughput"]),
            _num(s["output_throughput"], 1),
            _ms(s["ttft_ms"]["p50"]),
            _ms(s["ttft_ms"]["p99"]),
            _ms(s["tpot_ms"]["p50"]),
            _ms(s["itl_ms"]["p99"]),
            _ms(s["e2e_ms"]["p50"]),
            str(r["peak_concurrency"]),
            str(s["failed"]),
        ]
        if has_goodput:
            row.append(_num(s.get("goodput")))
        t.add_row(*row)
    return t


def request_records(results) -> list[dict]:
    """Every request's timings, to the microsecond (texts are left out: large, and nothing about speed)."""
    us = lambda v: round(v, 6) if isinstance(v, float) else v  # noqa: E731
    records = []
    for r in results:
        d = {k: us(v) for k, v in asdict(r).items() if k != "text"}
        d["chunk_times"] = [us(t) for t in r.chunk_times]
        records.append(d)
    return records


def write_json(path: str | Path, doc: dict) -> None:
    """The summaries indented for reading, each request on one line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1)
    if any(run.get("requests") for run in doc.get("runs", [])):
        # lay the requests out as placeholders, then put each one's compact JSON in its place
        placeholder = "\x00request\x00"  # no JSON string of a request or setting holds a NUL
        runs = [{**run, "requests": [placeholder] * len(run["requests"])} for run in doc["runs"]]
        parts = json.dumps({**doc, "runs": runs}, indent=1).split(json.dumps(placeholder))
        records = [json.dumps(q, separators=(",", ":")) for run in doc["runs"] for q in run["requests"]]
        text = "".join(p + r for p, r in zip(parts, [*records, ""]))
    Path(path).write_text(text)


def flat_summary(run: dict) -> dict:
    """One CSV row: the load and every scalar of the summary, latencies as name_stat."""
    row = {"label": run["label"], **{f"load_{k}": v for k, v in run["load"].items()}}
    row["peak_concurrency"] = run["peak_concurrency"]
    for k, v in run["summary"].items():
        if k.endswith("_ms") and isinstance(v, dict):
            row.update({f"{k[:-3]}_{stat}_ms": x for stat, x in v.items()})
        elif isinstance(v, dict):
            row[k] = ";".join(f"{a}={b}" for a, b in v.items())
        else:
            row[k] = v
    return row


def write_csv(path: str | Path, runs: list[dict]) -> None:
    rows = [flat_summary(r) for r in runs]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def write_plots(folder: str | Path, runs: list[dict], sweep: bool = True) -> list[Path]:
    """Latency against throughput (for sweeps), and the TTFT and ITL distributions of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if sweep and len(runs) > 1:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        x = [r["summary"]["output_throughput"] for r in runs]
        nan = float("nan")  # a point where no request completed has no latency: a gap in the line
        for ax, (metric, name) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency"))):
            for p, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(
                    x,
                    [r["summary"][metric][p] if r["summary"][metric][p] is not None else nan for r in runs],
                    style,
                    label=p,
                )
            for xi, r in zip(x, runs):
                if r["summary"][metric]["p50"] is not None:
                    ax.annotate(r["label"].split()[-1], (xi, r["summary"][metric]["p50"]), fontsize=8)
            ax.set(xlabel="output tokens/s", ylabel=f"{name} (ms)", title=f"{name} against throughput")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        written.append(folder / "latency_vs_throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    for metric, name in (("ttft", "TTFT"), ("itl", "ITL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            ok = [q for q in r["requests"] if q["ok"]]
            if metric == "ttft":
                vals = sorted(q["ttft"] * 1e3 for q in ok)
            else:
                vals = sorted(g * 1e3 for q in ok for g in gaps(q["chunk_times"]))
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=r["label"])
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of " + ("requests" if metric == "ttft" else "gaps"))
        ax.set_title(f"{name} distribution (CDF)")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(folder / f"{metric}_distribution.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
