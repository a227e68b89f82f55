"""What a tune leaves under `--out`: report.json (every trial with its load points), report.md (a table per stage),
serve-config.yaml (the winner, for `fulcrum serve --config`), goodput.png; and the same tables on the terminal."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fulcrum.tune.search import STAGES, Trial
from fulcrum.utils.cost import cost_per_million_tokens

COLUMNS = ("change", "goodput req/s", "TTFT p90 ms", "TPOT p90 ms", "out tok/s", "$/1M out tok", "quality", "verdict")


def _fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def row(t: Trial, price_per_hour: float | None) -> list[str]:
    m = t.measurement
    quality = "-"
    if t.quality and t.quality.get("kl_mean") is not None and t.quality.get("top1_agreement") is not None:
        quality = f"KL {t.quality['kl_mean']:.2g}, top-1 {t.quality['top1_agreement']:.1%}"
    if m is None or m.error:
        return [t.change, "-", "-", "-", "-", "-", quality, t.verdict]
    out_tps = m.figure("output_throughput")
    # the price is a machine's: a P/D pair shares one
    cost = cost_per_million_tokens(price_per_hour, out_tps or 0.0) if price_per_hour else None
    return [t.change, _fmt(m.goodput, 3), _fmt(m.figure("ttft_p90")), _fmt(m.figure("tpot_p90")), _fmt(out_tps),
            _fmt(cost, 3), quality, t.verdict]  # fmt: skip


def stage_tables(trials: list[Trial], price_per_hour: float | None) -> list[tuple[str, list[list[str]]]]:
    out = []
    for stage in STAGES[1:]:
        rows = [row(t, price_per_hour) for t in trials if t.stage == stage]
        if rows:
            out.append((stage, rows))
    return out


def print_tables(console: Console, tables) -> None:
    for stage, rows in tables:
        t = Table(title=f"stage {STAGES.index(stage) + 1}: {stage}", title_justify="left", show_lines=False)
        for c in COLUMNS:
            t.add_column(c, justify="left" if c in ("change", "verdict", "quality") else "right", overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t)


def markdown(doc: dict, tables) -> str:
    lines = [f"# fulcrum tune: {doc['model']}", ""]
    lines += [f"- {line}" for line in doc["target"]["lines"]]
    lines += ["", f"Machine: {doc['machine']}. Budget {doc['budget_s']:.0f} s, took {doc['elapsed_s']:.0f} s.", ""]
    for stage, rows in tables:
        lines += [
            f"## Stage {STAGES.index(stage) + 1}: {stage}",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
        ]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        lines.append("")
    lines += ["## Result", ""] + [f"- {line}" for line in doc["result"]["lines"]]
    lines += ["", "```", *doc["result"]["commands"], "```", ""]
    return "\n".join(lines)


def trial_dict(t: Trial) -> dict:
    return {
        "stage": t.stage,
        "change": t.change,
        "config": t.config.changes,
        "pd": t.config.pd,
        "verdict": t.verdict,
        "kept": t.kept,
        "predicted": t.predicted,
        "quality": t.quality,
        "notes": t.notes,
        "measurement": t.measurement.as_dict() if t.measurement else None,
    }


def plot(path: Path, trials: list[Trial]) -> Path | None:
    """Goodput of every measured trial, by stage, with the best so far as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    measured = [(i, t) for i, t in enumerate(trials) if t.measurement is not None and not t.measurement.error]
    if not measured:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    best, xs, ys = 0.0, [], []
    for i, t in measured:
        ax.scatter(i, t.measurement.goodput, color="tab:green" if t.kept else "tab:gray", zorder=3)
        best = max(best, t.measurement.goodput) if t.kept else best
        xs.append(i)
        ys.append(best)
    ax.step(xs, ys, where="post", color="tab:green", label="kept (best so far)")
    ax.set_xticks([i for i, _ in measured], [t.change[:24] for _, t in measured], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("goodput under the SLO (req/s)")
    ax.set_title("fulcrum tune: goodput per trial")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path, doc: dict, trials: list[Trial], tables, config_files: dict[str, dict]) -> list[Path]:
    """Everything under `out`; `config_files` maps a file name to the flags it holds (`fulcrum serve --config`)."""
    from fulcrum.utils.config_file import write_config

    out.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "trials": [trial_dict(t) for t in trials]}
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(doc, indent=1, default=str))
    paths[1].write_text(markdown(doc, tables))
    for name, flags in config_files.items():
        paths.append(write_config(out / name, flags))
    png = plot(out / "goodput.png", trials)
    return paths + ([png] if png else [])
