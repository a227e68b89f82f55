"""One engine step's cost, as a function of its shape: the toolkit's single cost model (plan predicts from it,
`fulcrum sim` runs fleets on it, `fulcrum sim calibrate` fits it to the engine's measured steps).

A step's shape is what the scheduler decided: how many tokens it computes, how many rows sample a token, how much KV
the decode rows read and how much attention the prefill chunks do. The measured model is linear in those features
with a piecewise-linear term in the step's token count (a GEMM's cost is flat while it is bound by reading the
weights, then grows with the rows), fitted by non-negative least squares. For hardware that is not here, the same
interface is answered by plan's roofline (`RooflineCosts`), labelled as predicted.

Torch-free: plan imports it, and a cost file is plain JSON."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.model_spec import ModelSpec, kv_bytes_per_token
from fulcrum.plan.roofline import Efficiency, attention_flops, matmul_params, step_overhead, weight_bytes_read

FORMAT = "fulcrum-step-costs/1"
# the knots of the token-count term: dense where small batches change kernels, sparse where GEMMs are compute-bound
DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
LINEAR_FEATURES = ("samples", "decode_kv", "prefill_rows", "prefill_attn")


@dataclass
class StepShape:
    """What a step computes. `decode_kv`: the KV positions the one-token rows attend over, summed;
    `prefill_attn`: the (query, key) pairs of the multi-token rows' causal attention, summed."""

    tokens: int = 0
    rows: int = 0
    samples: int = 0
    decode_kv: int = 0
    prefill_rows: int = 0
    prefill_attn: float = 0.0

    def add(self, new_tokens: int, computed: int, samples: bool) -> None:
        """One scheduled row: `new_tokens` computed after `computed` tokens already in the cache."""
        self.tokens += new_tokens
        self.rows += 1
        self.samples += samples
        if new_tokens == 1:
            self.decode_kv += computed + 1
        else:
            self.prefill_rows += 1
            self.prefill_attn += new_tokens * (computed + (new_tokens + 1) / 2)

    def as_dict(self) -> dict:
        return asdict(self)


def hat_features(tokens: float, knots: tuple[int, ...]) -> list[float]:
    """The piecewise-linear basis at `tokens`: weights on the two knots around it (clamped below the first,
    extrapolated along the last segment above the last)."""
    out = [0.0] * len(knots)
    if tokens <= knots[0]:
        out[0] = 1.0
        return out
    i = min(bisect.bisect_right(knots, tokens), len(knots) - 1)
    lo, hi = knots[i - 1], knots[i]
    w = (tokens - lo) / (hi - lo)
    out[i - 1], out[i] = 1.0 - w, w
    return out


@dataclass
class StepCosts:
    """A fitted step-cost model. `knot_seconds[i]`: a step of `knots[i]` tokens before the other terms;
    `coef`: seconds per unit of each of LINEAR_FEATURES. `frontend_s`: what a served request spends outside the
    engine's steps before its first token (HTTP, tokenizing, the hop between processes), added to TTFT."""

    knots: tuple[int, ...]
    knot_seconds: list[float]
    coef: dict[str, float]
    source: str = "measured"  # measured (calibrated on a machine) or predicted (plan's roofline)
    model: str = ""
    engine: dict = field(default_factory=dict)  # dtype, kv_cache_dtype, block_size, num_blocks, threads, ...
    machine: dict = field(default_factory=dict)  # cpu, flags, cores: where it was measured
    frontend_s: float = 0.0
    kv_transfer_s_per_block: float = 0.0  # P/D: moving one KV block between engines
    fit: dict = field(default_factory=dict)  # steps fitted, held out, the held-out error

    @property
    def step_budget(self) -> int | None:
        """The step budget of the replica these costs describe: what `fulcrum serve` took with the calibrated
        settings (files calibrated before that was kept: the sweep's own), None when the file says neither."""
        budget = self.engine.get("served_max_num_batched_tokens") or self.engine.get("max_num_batched_tokens")
        return int(budget) if budget else None

    def step_seconds(self, s: StepShape) -> float:
        return self.seconds(s.tokens, s.samples, s.decode_kv, s.prefill_rows, s.prefill_attn)

    def seconds(self, tokens: int, samples: int, decode_kv: int, prefill_rows: int, prefill_attn: float) -> float:
        """The step's seconds for a shape given as its features."""
        if tokens <= 0:
            return 0.0
        knots, ks = self.knots, self.knot_seconds
        if tokens <= knots[0]:
            base = ks[0]
        else:
            i = min(bisect.bisect_right(knots, tokens), len(knots) - 1)
            lo, hi = knots[i - 1], knots[i]
            base = ks[i - 1] + (ks[i] - ks[i - 1]) * (tokens - lo) / (hi - lo)
        c = self.coef
        t = base + c["samples"] * samples + c["decode_kv"] * decode_kv
        t += c["prefill_rows"] * prefill_rows + c["prefill_attn"] * prefill_attn
        return max(t, 0.0)

    # -- files ----------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        d = asdict(self)
        d["knots"] = list(self.knots)
        return {"format": FORMAT, **d}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, d: dict, where: str = "step costs") -> StepCosts:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a fulcrum step-cost file (format {FORMAT!r}; write one with "
                             "`fulcrum sim calibrate`)")  # fmt: skip
        try:
            costs = cls(
                knots=tuple(int(k) for k in d["knots"]),
                knot_seconds=[float(x) for x in d["knot_seconds"]],
                coef={k: float(d["coef"][k]) for k in LINEAR_FEATURES},
                source=str(d.get("source", "measured")),
                model=str(d.get("model", "")),
                engine=dict(d.get("engine") or {}),
                machine=dict(d.get("machine") or {}),
                frontend_s=float(d.get("frontend_s", 0.0)),
                kv_transfer_s_per_block=float(d.get("kv_transfer_s_per_block", 0.0)),
                fit=dict(d.get("fit") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed step-cost file ({type(e).__name__}: {e})") from None
        if len(costs.knots) != len(costs.knot_seconds) or list(costs.knots) != sorted(set(costs.knots)):
            raise ValueError(f"{where}: knots must rise and match knot_seconds one for one")
        return costs

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"step-cost file {path} not found (write one with `fulcrum sim calibrate`)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return cls.from_json(d, str(path))


def decode_seconds(costs: StepCosts | RooflineCosts, batch: int, context: int) -> float:
    """A step that decodes one token for each of `batch` rows, each over `context` cached tokens: TPOT."""
    return costs.seconds(batch, batch, batch * (context + 1), 0, 0.0)


def prefill_seconds(costs: StepCosts | RooflineCosts, tokens: int, chunk: int) -> float:
    """One prompt of `tokens` computed alone in chunks of `chunk` tokens (the engine's max_num_batched_tokens):
    each chunk a step of one row over the chunks before it, the last one sampling the first token."""
    total, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        s = StepShape()
        s.add(n, done, done + n == tokens)
        total += costs.step_seconds(s)
        done += n
    return total


# -- fitting ------------------------------------------------------------------------------------------


def design_row(s: StepShape, knots: tuple[int, ...]) -> list[float]:
    return hat_features(s.tokens, knots) + [float(getattr(s, f)) for f in LINEAR_FEATURES]


def supported_knots(tokens: list[int], knots: tuple[int, ...]) -> tuple[int, ...]:
    """The knots whose basis function is non-zero at some measured token count (at least two, so that there is a
    segment to interpolate along)."""
    used = {i for t in tokens for i, w in enumerate(hat_features(t, knots)) if w}
    kept = tuple(k for i, k in enumerate(knots) if i in used)
    if len(kept) >= 2:
        return kept
    i = min(used)
    return tuple(knots[i : i + 2]) if i + 1 < len(knots) else tuple(knots[i - 1 : i + 1])


def nnls(a: list[list[float]], b: list[float], weights: list[float] | None = None) -> list[float]:
    """Least squares with every coefficient >= 0 (an active-set loop over numpy's lstsq: the columns whose
    coefficient comes out negative are held at zero and the rest refitted). `weights` scale each row's residual."""
    import numpy as np

    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        x, y = x * w[:, None], y * w
    free = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1] + 1):
        coef = np.zeros(x.shape[1])
        if not free.any():
            break
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        coef[free] = sol
        negative = coef < 0
        if not negative.any():
            break
        free &= ~negative
    return [float(max(c, 0.0)) for c in coef]


def fit(steps: list[tuple[StepShape, float]], knots: tuple[int, ...] = DEFAULT_KNOTS, **meta) -> StepCosts:
    """Fit the model to measured (shape, seconds) steps, each weighted by 1/seconds so that the error fitted is a
    relative one (a 1 ms decode step counts as much as a 100 ms prefill). Knots no measured step's token count
    touches are dropped: nothing would fix their value, and least squares would leave it at 0 (a step of 2
    tokens free, or a fall past the largest step measured); the model interpolates between the knots kept and
    extrapolates along its last segment."""
    if not steps:
        raise ValueError("no measured steps to fit")
    knots = supported_knots([s.tokens for s, _ in steps], knots)
    rows = [design_row(s, knots) for s, _ in steps]
    secs = [t for _, t in steps]
    coef = nnls(rows, secs, [1.0 / max(t, 1e-6) for t in secs])
    n = len(knots)
    return StepCosts(knots, coef[:n], dict(zip(LINEAR_FEATURES, coef[n:])), **meta)


def errors(costs: StepCosts, steps: list[tuple[StepShape, float]]) -> dict:
    """The model's relative error on measured steps: mean and 90th percentile of |predicted - measured| /
    measured, and the largest."""
    rel = sorted(abs(costs.step_seconds(s) - t) / t for s, t in steps if t > 0)
    if not rel:
        return {"steps": 0}
    p90 = rel[min(len(rel) - 1, math.ceil(0.9 * len(rel)) - 1)]
    return {"steps": len(rel), "mean_abs_rel_error": sum(rel) / len(rel), "p90_abs_rel_error": p90, "max": rel[-1]}


# -- predicted (roofline) -------------------------------------------------------------------------------


class RooflineCosts:
    """The same interface, predicted from plan's roofline for hardware that is not here (`--hardware NAME`): a
    step reads the weights once and the decode rows' KV, and computes every token's matmuls and attention; the
    slower of the two, plus the hardware's per-step overhead. `source` is "predicted"."""

    source = "predicted"

    def __init__(self, spec: ModelSpec, hw: Hardware, dtype: str, kv_dtype: str, tp: int = 1,
                 eff: Efficiency = Efficiency(), frontend_s: float = 0.0):  # noqa: B008 (frozen)  # fmt: skip
        self.spec, self.hw, self.dtype, self.tp, self.eff = spec, hw, dtype, tp, eff
        self.model = spec.name
        self.kv_token_bytes = kv_bytes_per_token(spec, kv_dtype)
        self.matmul_flops_per_token = 2 * matmul_params(spec)
        self.attn_flops_per_pair = attention_flops(spec, 1, 1, causal=False)
        self.overhead = step_overhead(spec, hw)
        self.frontend_s = frontend_s
        self.kv_transfer_s_per_block = 0.0
        self.engine = {"dtype": dtype, "kv_cache_dtype": kv_dtype, "tensor_parallel": tp}
        self.machine = {"hardware": hw.name, "source": hw.source}
        self.fit = {}
        self._weights: dict[int, float] = {}

    def _weight_bytes(self, rows: int) -> float:
        w = self._weights.get(rows)
        if w is None:
            w = self._weights[rows] = weight_bytes_read(self.spec, self.dtype, rows)
        return w

    def step_seconds(self, s: StepShape) -> float:
        return self.seconds(s.tokens, s.samples, s.decode_kv, s.prefill_rows, s.prefill_attn)

    def seconds(self, tokens: int, samples: int, decode_kv: int, prefill_rows: int, prefill_attn: float) -> float:
        if tokens <= 0:
            return 0.0
        bw = self.tp * self.hw.stream_bandwidth(min(tokens, 64)) * self.eff.bandwidth
        t_mem = (self._weight_bytes(min(tokens, 64)) + decode_kv * self.kv_token_bytes) / bw
        rate = self.tp * self.hw.peak_flops(self.dtype) * self.eff.compute
        flops = self.matmul_flops_per_token * tokens + self.attn_flops_per_pair * (decode_kv + prefill_attn)
        return max(t_mem, flops / rate) + self.overhead

    def to_json(self) -> dict:
        return {"source": self.source, "model": self.model, "engine": self.engine, "machine": self.machine}
