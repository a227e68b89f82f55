"""`fulcrum bench compare A.json B.json ...`: runs side by side, each against the first as a ratio."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

ROWS = (
    ("request_throughput", None, "req/s"),
    ("output_throughput", None, "output tok/s"),
    ("total_token_throughput", None, "total tok/s"),
    ("goodput", None, "goodput req/s"),
    ("ttft_ms", "mean", "TTFT mean ms"),
    ("ttft_ms", "p50", "TTFT p50 ms"),
    ("ttft_ms", "p99", "TTFT p99 ms"),
    ("tpot_ms", "mean", "TPOT mean ms"),
    ("tpot_ms", "p50", "TPOT p50 ms"),
    ("tpot_ms", "p99", "TPOT p99 ms"),
    ("itl_ms", "p50", "ITL p50 ms"),
    ("itl_ms", "p99", "ITL p99 ms"),
    ("e2e_ms", "p50", "E2E p50 ms"),
    ("e2e_ms", "p99", "E2E p99 ms"),
    ("cost_per_1m_output_tokens", None, "$ per 1M output tok"),
    ("failed", None, "failed"),
)


def load(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a `fulcrum bench serve --out` result ({e})") from None
    if not isinstance(doc, dict) or "runs" not in doc:
        raise ValueError(f"{path}: not a `fulcrum bench serve --out` result (no runs)")
    return doc


def value(summary: dict, key: str, stat: str | None):
    v = summary.get(key)
    return v.get(stat) if stat and isinstance(v, dict) else v


def pairs(docs: list[dict]) -> list[tuple[str, list[dict | None]]]:
    """Runs matched by load label; files of one run each are matched whatever their labels."""
    if all(len(d["runs"]) == 1 for d in docs):
        return [(docs[0]["runs"][0]["label"], [d["runs"][0] for d in docs])]
    labels = list(dict.fromkeys(r["label"] for d in docs for r in d["runs"]))
    return [(lab, [next((r for r in d["runs"] if r["label"] == lab), None) for d in docs]) for lab in labels]


def compare_tables(paths: list[str]) -> list[Table]:
    docs = [load(p) for p in paths]
    names = [Path(p).stem for p in paths]
    tables = []
    for label, runs in pairs(docs):
        t = Table(title=label, title_justify="left")
        t.add_column("metric")
        for i, n in enumerate(names):
            t.add_column(n, justify="right")
            if i:
                t.add_column(f"{n} / {names[0]}", justify="right")
        for key, stat, title in ROWS:
            vals = [value(r["summary"], key, stat) if r else None for r in runs]
            if all(v is None for v in vals):
                continue
            row = [title]
            for i, v in enumerate(vals):
                row.append("-" if v is None else f"{v:,.2f}")
                if i:
                    base = vals[0]
                    row.append(f"{v / base:.2f}x" if v is not None and base not in (None, 0) else "-")
            t.add_row(*row)
        tables.append(t)
    return tables
