"""Stage 1 of the method, the target: latency SLOs as percentiles (`ttft_p90=500ms`), the quality a quantization
may cost (`kl=0.01`), and whether a measured load point meets them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.utils.arg_types import seconds_with_unit

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p95", "p99")
QUALITY_KEYS = {  # key: (eval's figure, whether larger is worse)
    "kl": ("kl_mean", True),
    "kl_p99": ("kl_p99", True),
    "top1": ("top1_agreement", False),
    "ppl_ratio": ("perplexity_ratio", True),
}


@dataclass(frozen=True)
class Bound:
    """One latency SLO: `stat` of `metric` over a load point's requests at most `seconds`."""

    metric: str
    stat: str
    seconds: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    @property
    def quantile(self) -> float | None:
        """The share of requests allowed over `seconds` (None for a mean)."""
        return None if self.stat == "mean" else 1 - int(self.stat[1:]) / 100

    def __str__(self) -> str:
        return f"{self.key}={self.seconds * 1e3:g}ms"


def _seconds(text: str, part: str) -> float:
    try:
        value = seconds_with_unit(text)
    except ValueError:
        raise ValueError(f"bad SLO value {part!r}: write e.g. ttft_p90=500ms or e2e_p99=10s") from None
    if not value > 0:
        raise ValueError(f"bad SLO value {part!r}: it must be above 0")
    return value


def parse_slo(text: str) -> list[Bound]:
    """`ttft_p90=500ms,tpot_p90=50ms` -> bounds; a metric without a statistic (`ttft=500ms`) is its p90."""
    bounds = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        metric, _, stat = key.strip().lower().partition("_")
        stat = stat or "p90"
        if not eq or metric not in METRICS or stat not in STATS:
            raise ValueError(
                f"bad SLO {part!r}: write METRIC_STAT=VALUE with METRIC one of {', '.join(METRICS)} and STAT one of "
                f"{', '.join(STATS)}, e.g. ttft_p90=500ms"
            )
        bounds.append(Bound(metric, stat, _seconds(value, part)))
    if not bounds:
        raise ValueError("give at least one SLO, e.g. --slo ttft_p90=500ms,tpot_p90=50ms")
    if len({b.key for b in bounds}) < len(bounds):
        raise ValueError(f"an SLO is given twice in {text!r}")
    return bounds


def parse_quality(text: str) -> dict[str, float]:
    """`kl=0.01,top1=0.9` -> the bounds a quantized candidate's `fulcrum eval` figures must meet."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in QUALITY_KEYS:
            raise ValueError(f"bad quality bound {part!r}: use {', '.join(QUALITY_KEYS)}, e.g. kl=0.01")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"bad quality bound {part!r}: the value must be a number") from None
    return out


def quality_verdict(figures: dict, bounds: dict[str, float]) -> str | None:
    """None when `fulcrum eval`'s figures meet every bound; else why not, in words."""
    misses = []
    for key, limit in bounds.items():
        name, larger_is_worse = QUALITY_KEYS[key]
        got = figures.get(name)
        if got is None:
            misses.append(f"{key} missing from fulcrum eval's figures")
        elif got > limit if larger_is_worse else got < limit:
            misses.append(f"{key} {got:.4g} {'>' if larger_is_worse else '<'} {limit:g}")
    return "; ".join(misses) or None


def slo_misses(summary: dict, bounds: list[Bound]) -> list[str]:
    """The bounds a load point's summary (bench's `summarize`) breaks, as `ttft_p90 612ms > 500ms`."""
    out = []
    for b in bounds:
        got = summary[f"{b.metric}_ms"][b.stat]
        if got is None and b.metric in ("tpot", "itl"):
            continue  # one-token replies: no gaps to miss
        if got is None or got > b.seconds * 1e3:
            shown = "none completed" if got is None else f"{got:,.0f}ms"
            out.append(f"{b.key} {shown} > {b.seconds * 1e3:g}ms")
    return out


class EarlyBreak:
    """Tells, while a load point runs, that its SLO is already lost: so many of its `planned` requests missed a
    percentile bound (or failed) that no later request can bring the percentile back under it."""

    def __init__(self, bounds: list[Bound], planned: int):
        self.bounds = [b for b in bounds if b.quantile is not None and b.metric != "itl"]
        # numpy's percentile is certainly over the bound once the value at floor(p * (n - 1)) is a miss
        self.allowed = {b.key: planned - math.floor((1 - b.quantile) * (planned - 1) + 1e-9) - 1 for b in self.bounds}
        self.misses = dict.fromkeys(self.allowed, 0)
        self.reason: str | None = None

    def add(self, result) -> bool:
        """Count one finished request (bench's RequestResult); True once the point cannot meet its SLO."""
        got = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
        for b in self.bounds:
            value = got[b.metric]
            if not result.ok or (value is not None and value > b.seconds):
                self.misses[b.key] += 1
                if self.misses[b.key] > self.allowed[b.key] and self.reason is None:
                    self.reason = f"{b.key}: {self.misses[b.key]} requests over {b.seconds * 1e3:g}ms already"
        return self.reason is not None
