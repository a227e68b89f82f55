"""The figures of a run, defined as vLLM's `bench serve` defines them; goodput as DistServe does.

TTFT: start to the first content chunk. TPOT: (e2e - TTFT) / (output tokens - 1), for requests of 2+ tokens. ITL:
every gap between content chunks, pooled. E2E: start to the last content chunk. Throughputs are per second of the run;
goodput counts the completed requests that met every SLO given; percentiles are numpy's linear interpolation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from fulcrum.bench.client import RequestResult
from fulcrum.utils.arg_types import seconds_with_unit
from fulcrum.utils.cost import cost_per_million_tokens

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=200ms,tpot=50ms,e2e=5s` -> seconds per metric."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO {key!r}: use {', '.join(SLO_KEYS)}")
        try:
            slo[key] = seconds_with_unit(value)
        except ValueError:
            raise ValueError(f"bad SLO value {part!r}: write e.g. ttft=200ms or e2e=2s") from None
    return slo


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, std and percentiles, in milliseconds."""
    if len(values) == 0:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=float) * 1e3
    return {
        "mean": float(a.mean()),
        "std": float(a.std()),
        **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES},
    }


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}  # one output token: no TPOT to miss
    return r.ok and all(got[k] <= v for k, v in slo.items())


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo: dict[str, float] | None = None,
    price_per_hour: float | None = None,
    replicas: int = 1,
) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    s = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "token_source": dict(Counter(r.token_source for r in ok)),
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),  # as vLLM: requests of 2+ tokens
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        s["slo"] = {k: v * 1e3 for k, v in slo.items()}
        s["goodput"] = per_s(good)
        s["slo_attainment"] = good / len(results) if results else 0.0
    if price_per_hour is not None:
        s["price_per_hour"], s["replicas"] = price_per_hour, replicas
        s["cost_per_1m_output_tokens"] = cost_per_million_tokens(price_per_hour, s["output_throughput"], replicas)
        s["cost_per_1m_total_tokens"] = cost_per_million_tokens(price_per_hour, s["total_token_throughput"], replicas)
    return s


def summarize_by_tag(results: Sequence[RequestResult], duration: float, **kw) -> dict[str, dict]:
    """The summary of each class of requests (long-prefill's short and long ones, multi-turn's turns)."""
    tags = sorted({r.tag for r in results if r.tag})
    return {t: summarize([r for r in results if r.tag == t], duration, **kw) for t in tags}
