"""How a plan is shown: rich tables in the terminal, one JSON document, a plot of TPOT and throughput by batch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.memory import MemoryPlan
from fulcrum.plan.model_spec import ModelSpec
from fulcrum.plan.roofline import DecodePoint, Prefill


@dataclass
class Plan:
    spec: ModelSpec
    hardware: Hardware
    memory: MemoryPlan
    prefill: Prefill
    decode: list[DecodePoint]
    advice: list[str]
    assumptions: list[str] = field(default_factory=list)
    price_per_hour: float | None = None
    decode_max_batch: int = 0  # sequences of the decode context (not --context) that fit in memory
    speed_from: str = "roofline"  # or "calibrated step costs" (--hardware local)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB ({n / 2**30:,.1f} GiB)"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms"


def to_json(plan: Plan) -> str:
    d = dataclasses.asdict(plan)
    d["spec"]["details"] = plan.spec.details()
    m = plan.memory
    d["memory"].update(num_gpus=m.num_gpus, weights_fit=m.weights_fit, fits=m.fits)
    return json.dumps(d, indent=1, default=str)


def render(plan: Plan, console: Console | None = None) -> None:
    c = console or Console()
    s, hw, m = plan.spec, plan.hardware, plan.memory
    c.print(f"[bold]{s.name}[/bold] on [bold]{m.num_gpus} x {hw.name}[/bold] (TP={m.tp}, PP={m.pp})")
    c.print("  " + "; ".join(s.details()))

    t = Table(title="memory", show_header=False)
    t.add_column(justify="left")
    t.add_column(justify="right")
    p = m.params
    moe = f", {p.active / 1e9:,.2f}B active per token" if p.active != p.total else ""
    t.add_row("parameters", f"{p.total / 1e9:,.2f}B{moe}")
    t.add_row(f"weights at {m.weight_dtype}", _gb(m.weight_bytes))
    if p.active != p.total:
        t.add_row(f"active weights at {m.weight_dtype}", _gb(m.active_weight_bytes))
    t.add_row(f"KV cache per token ({m.kv_dtype})", f"{m.kv_per_token:,.0f} B ({m.kv_per_token / 1024:,.1f} KiB)")
    t.add_row(f"KV cache per {m.context:,}-token sequence", _gb(m.kv_per_sequence))
    t.add_row(f"KV cache for {m.concurrency} sequences", _gb(m.kv_total))
    per_gpu = f"{m.weights_per_gpu / 1e9:,.1f} + {m.kv_per_gpu / 1e9:,.1f} + {m.activations_per_gpu / 1e9:,.1f} GB"
    t.add_row("per GPU: weights + KV + activations", per_gpu)
    t.add_row("per GPU: capacity / usable", f"{m.capacity / 1e9:,.1f} / {m.usable / 1e9:,.1f} GB")
    t.add_row("fits", ("yes" if m.fits else "[red]no[/red]") + ("" if m.weights_fit else " (weights alone do not fit)"))
    t.add_row(f"max concurrent {m.context:,}-token sequences", f"{m.max_concurrency:,}")
    split = f"TP={m.suggested_tp}" + (f" x PP={m.suggested_pp}" if m.suggested_pp > 1 else "")
    t.add_row("fewest GPUs (one sequence)", f"{m.min_gpus} ({split})" if m.min_gpus else "more than 64")
    c.print(t)

    r = Table(
        title=f"{plan.speed_from}: decode over {plan.decode[0].context:,} tokens of context; prefill of {plan.prefill.tokens:,}"
    )
    for col in ("batch", "TPOT", "tokens/s", "bound", "fits in memory"):
        r.add_column(col, justify="right")
    if plan.price_per_hour:
        r.add_column(f"$ / 1M output tokens at ${plan.price_per_hour}/GPU-hour", justify="right")
    for d in plan.decode:
        row = [
            str(d.batch),
            _ms(d.tpot_s),
            f"{d.tokens_per_s:,.1f}",
            d.bound,
            "yes" if d.batch <= plan.decode_max_batch else "no",
        ]
        if plan.price_per_hour:
            row.append(f"{d.cost_per_million:,.3f}" if d.cost_per_million else "-")
        r.add_row(*row)
    c.print(r)
    pf = plan.prefill
    c.print(f"prefill {pf.tokens:,} tokens: {_ms(pf.seconds)} ({pf.tokens_per_s:,.0f} tokens/s, {pf.bound}-bound)")

    c.print("\n[bold]what to do[/bold]")
    for i, line in enumerate(plan.advice):
        c.print(("  - " if i else "  ") + line)
    c.print("\n[bold]assumptions[/bold]")
    for line in plan.assumptions:
        c.print("  - " + line)
    c.print(f"  - hardware figures: {hw.source}")


def plot(plan: Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [d.batch for d in plan.decode]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(b, [d.tpot_s * 1e3 for d in plan.decode], marker="o")
    ax1.set(xscale="log", xlabel="batch (concurrent sequences)", ylabel="TPOT (ms)", title="time per output token")
    ax2.plot(b, [d.tokens_per_s for d in plan.decode], marker="o", color="tab:green")
    ax2.set(
        xscale="log", yscale="log", xlabel="batch (concurrent sequences)", ylabel="output tokens/s", title="throughput"
    )
    for ax in (ax1, ax2):
        ax.set_xticks(b, [str(x) for x in b])
        ax.grid(alpha=0.3)
        crossing = next((d.batch for d in plan.decode if d.bound == "compute"), None)
        if crossing:
            ax.axvline(crossing, color="gray", ls="--", lw=1, label="compute-bound from here")
        if 0 < plan.decode_max_batch < b[-1]:
            ax.axvline(plan.decode_max_batch, color="tab:red", ls=":", lw=1, label="KV cache full beyond")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    m = plan.memory
    fig.suptitle(
        f"{plan.spec.name}, {m.weight_dtype} weights, on {m.num_gpus} x {plan.hardware.name} "
        f"({plan.speed_from}, {plan.decode[0].context} tokens of context)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
