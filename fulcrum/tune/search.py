"""The walk: target, baseline, memory and batching, quantization, parallelism, scale out, disaggregate. Each stage
tries a few changes on top of the best configuration so far and keeps one only when its measured goodput under the
SLO beat the best by `min_gain`; what cannot fit is pruned first, a quantization over the quality bound is
rejected before any speed run, and a candidate the budget cannot pay for is skipped, saying so."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fulcrum.tune.measure import Measurement
from fulcrum.tune.space import Config
from fulcrum.tune.target import quality_verdict

STAGES = (
    "target",
    "baseline",
    "memory & batching",
    "quantization",
    "parallelism",
    "scale out",
    "disaggregate",
    "final check",
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class Trial:
    """One row of a stage's table: a change tried on top of the best so far, and what became of it."""

    stage: str
    change: str
    config: Config
    verdict: str  # kept / rejected / skipped, and why
    kept: bool = False
    measurement: Measurement | None = None
    quality: dict | None = None
    predicted: bool = False  # a figure from arithmetic, not a run (labelled so in the report)
    notes: dict = field(default_factory=dict)


@dataclass
class Facts:
    """What the walk knows before it measures: the machine, the model, the workload, and plan's arithmetic."""

    device: str = "cpu"  # cpu or cuda
    units: int = 1  # CPU cores or GPUs the candidates may use
    num_heads: int = 1
    num_kv_heads: int = 1
    num_layers: int = 1
    shares_prefixes: bool = False
    mean_input_len: float = 0.0
    mean_output_len: float = 0.0
    kv_cache_need_gib: float | None = None  # KV of the ladder's top concurrency at the workload's lengths
    kv_cache_default_gib: float | None = None  # what the engine takes by default (CPU: 2 GiB)
    fits: Callable[[Config], str | None] = lambda c: None  # why a config cannot fit (plan's memory), or None
    draft: str | None = None  # a draft model folder for speculative decoding
    quantizations: tuple[str, ...] = ("int8", "fp8", "int4")
    kv_cache_dtypes: tuple[str, ...] = ("int8", "fp8")
    exposes: Callable[[str], bool] = lambda knob: True  # whether the server command takes the knob
    pd_possible: str | None = None  # why P/D cannot be measured here (None: it can)
    target_rate: float | None = None
    price_per_hour: float | None = None
    router_policy: str = "least-load"


class Walk:
    """Runs the stages. `measure(config, start_at, deadline)` measures one candidate; `gate(quantization,
    kv_cache_dtype)` scores a format (`quality.EvalGate`); `progress(stage, change, seconds_left)` shows where the
    walk is."""

    def __init__(
        self,
        measure: Callable[..., Measurement],
        gate,
        facts: Facts,
        quality_bounds: dict[str, float],
        budget_s: float,
        min_gain: float = 0.05,
        progress: Callable[[str, str, float], None] = lambda *a: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.measure_fn, self.gate, self.facts, self.bounds = measure, gate, facts, quality_bounds
        self.budget_s, self.min_gain, self.progress, self.clock = budget_s, min_gain, progress, clock
        self.t0 = clock()
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.baseline: Trial | None = None
        self.bar = 0.0  # the goodput a change must beat: the best's, raised by its reruns
        self.measured_s: list[float] = []

    # -- time ------------------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.budget_s - (self.clock() - self.t0)

    def _estimate(self) -> float:
        """What one more candidate will take: the median of those measured so far."""
        if not self.measured_s:
            return 0.0
        s = sorted(self.measured_s)
        return s[len(s) // 2]

    # -- one candidate -------------------------------------------------------------------------------------------
    def _record(self, trial: Trial) -> Trial:
        self.trials.append(trial)
        return trial

    def skip(self, stage: str, change: str, config: Config, why: str) -> Trial:
        return self._record(Trial(stage, change, config, f"skipped: {why}"))

    def try_(self, stage: str, change: str, config: Config, *, keep_if_better: bool = True) -> Trial:
        """Measure `config` and keep it if it beat the best (or unconditionally as the baseline)."""
        for knob in config.changes:
            if not self.facts.exposes(knob):
                return self.skip(stage, change, config, f"the server command does not expose {knob}")
        why = self.facts.fits(config)
        if why:
            return self.skip(stage, change, config, f"does not fit ({why}); pruned by plan, not started")
        if self.best is not None and self.left() < 1.2 * self._estimate():
            return self.skip(stage, change, config, f"budget ({self.left():.0f} s left, a candidate takes ~"
                                                    f"{self._estimate():.0f} s)")  # fmt: skip
        self.progress(stage, change, self.left())
        start_at = max(1, self._best_concurrency() // 2)
        m = self.measure_fn(config, start_at, self.clock() + max(self.left(), 1.0) if self.best else None)
        self.measured_s.append(m.seconds)
        trial = Trial(stage, change, config, "", measurement=m)
        if not keep_if_better:
            trial.kept, trial.verdict = True, "baseline"
            self.best = self.baseline = trial
            self.bar = m.goodput
        elif m.error:
            trial.verdict = f"rejected: {m.error}"
        elif self._beats(m) and self._beats(m := self._confirm(config, m, trial)):
            gain = f"x{m.goodput / self.bar:.2f} of the best so far" if self.bar else "the first to meet the SLO"
            trial.measurement, trial.kept = m, True
            trial.verdict = f"kept: goodput {gain} (the lower of two runs against the higher of the best's)"
            self.best, self.bar = trial, m.goodput
        elif m.error:  # it won once, and the confirming runs could not be made
            trial.verdict = f"rejected: won once, but {m.error}"
        else:
            runs = " (the lower of two runs)" if "runs" in trial.notes else ""
            trial.measurement, trial.verdict = (
                m,
                (f"rejected: goodput {m.goodput:.3g} req/s{runs} vs {self.bar:.3g} kept (needs +{self.min_gain:.0%})"),
            )
        return self._record(trial)

    def _beats(self, m: Measurement) -> bool:
        return m.goodput > 0 and m.goodput > self.bar * (1 + self.min_gain)

    def _confirm(self, config: Config, first: Measurement, trial: Trial) -> Measurement:
        """A candidate that seemed to win runs again, and so does the best so far, one after the other: the
        candidate's lower run must still beat the best's higher one, so that a lucky run or an unlucky baseline
        on a noisy machine keeps nothing."""
        if self.left() < 2 * first.seconds:
            trial.notes["confirmation"] = "none: out of budget, so the first run's win is not kept"
            return Measurement(error="no budget left to confirm the win")
        again = self._measure(config, first)
        incumbent = self._measure(self.best.config, self.best.measurement)
        trial.notes["runs"] = [first.as_dict(), again.as_dict()]
        trial.notes["best_rerun"] = incumbent.as_dict()
        self.bar = max(self.bar, incumbent.goodput)
        return min(first, again, key=lambda x: x.goodput)

    def _measure(self, config: Config, before: Measurement) -> Measurement:
        """Another run of a configuration, its load starting below where its last run did best."""
        start = max(1, (before.best.concurrency if before.best else 2) // 2)
        m = self.measure_fn(config, start, self.clock() + max(self.left(), 1.0))
        self.measured_s.append(m.seconds)
        return m

    def _best_concurrency(self) -> int:
        p = self.best.measurement.best if self.best and self.best.measurement else None
        return p.concurrency if p else 1

    # -- the stages ----------------------------------------------------------------------------------------------
    def run(self) -> list[Trial]:
        self.baseline_stage()
        if self.baseline.measurement.error:  # the defaults do not serve: nothing to tune against
            return self.trials
        self.memory_stage()
        self.quantization_stage()
        self.parallelism_stage()
        self.scale_out_stage()
        self.disaggregate_stage()
        self.final_check()
        return self.trials

    def final_check(self) -> None:
        """The default and the best, run once more back to back: the gain the report states, on the same machine
        minutes apart rather than at either end of the walk."""
        if self.best is self.baseline:
            return
        if self.left() < 2 * self._estimate():
            self.skip("final check", "the default and the best, back to back", self.best.config,
                      f"budget ({self.left():.0f} s left)")  # fmt: skip
            return
        for name, trial in (("the default, again", self.baseline), ("the best, again", self.best)):
            self.progress("final check", name, self.left())
            m = self._measure(trial.config, trial.measurement)
            self._record(Trial("final check", name, trial.config, "measured for the report", measurement=m))

    def baseline_stage(self) -> None:
        self.try_("baseline", "defaults", Config(), keep_if_better=False)

    def memory_stage(self) -> None:
        stage, f = "memory & batching", self.facts
        if f.kv_cache_need_gib and f.kv_cache_default_gib and f.kv_cache_need_gib > f.kv_cache_default_gib:
            size = round(f.kv_cache_need_gib * 1.25, 2)
            self.try_(stage, f"kv-cache-memory {size:g} GiB (the load needs {f.kv_cache_need_gib:.2f})",
                      self.best.config.with_(kv_cache_memory=size))  # fmt: skip
        elif f.kv_cache_need_gib is not None:
            self.skip(stage, "kv-cache-memory", self.best.config,
                      f"the default cache ({f.kv_cache_default_gib:g} GiB) already holds the load's "
                      f"{f.kv_cache_need_gib:.2f} GiB of KV")  # fmt: skip
        for chunk in (512, 8192):
            self.try_(stage, f"max-num-batched-tokens {chunk}", self.best.config.with_(max_num_batched_tokens=chunk))
        c = self._best_concurrency()
        seqs = max(4, 2 * c)
        if seqs < self.best.config.get("max_num_seqs"):
            self.try_(stage, f"max-num-seqs {seqs} (twice the best point's load)",
                      self.best.config.with_(max_num_seqs=seqs))  # fmt: skip
        if f.shares_prefixes:
            self.skip(stage, "no-prefix-caching", self.best.config, "the workload shares prefixes: caching stays on")
        else:
            self.try_(stage, "no-prefix-caching (no prefix is shared)", self.best.config.with_(no_prefix_caching=True))
        if f.device == "cpu" and f.units > 1:  # by default the engine leaves the frontend one core
            self.try_(stage, f"cpu-threads {f.units} (the frontend shares the cores)",
                      self.best.config.with_(cpu_threads=f.units))  # fmt: skip

    def _gated(self, stage: str, change: str, config: Config, quantization, kv_dtype: str) -> None:
        if not all(self.facts.exposes(k) for k in config.changes):
            self.try_(stage, change, config)  # skipped there, saying why
            return
        if self.left() < 1.2 * self._estimate():  # neither the score nor the run would fit
            self.try_(stage, change, config)  # skipped there, saying so
            return
        q = self.gate(quantization, kv_dtype)
        if q.error:
            self.skip(stage, change, config, f"quality not known ({q.error})")
            return
        miss = quality_verdict(q.figures, self.bounds)
        if miss:
            t = Trial(stage, change, config, f"rejected unmeasured: quality {miss}", quality=q.figures)
            self._record(t)
            return
        t = self.try_(stage, change, config)
        t.quality = q.figures

    def quantization_stage(self) -> None:
        stage, f = "quantization", self.facts
        base = self.best.config
        for q in f.quantizations:
            self._gated(stage, f"weights {q}", base.with_(quantization=q), q, "auto")
        for kv in f.kv_cache_dtypes:
            quant = self.best.config.get("quantization")
            self._gated(stage, f"KV cache {kv}", self.best.config.with_(kv_cache_dtype=kv), quant, kv)

    def parallelism_stage(self) -> None:
        stage, f = "parallelism", self.facts
        base = self.best.config.with_(cpu_threads=None)  # the ranks share the cores out themselves
        sizes = [n for n in (2, 4, 8) if n <= f.units]
        if not sizes:
            self.skip(stage, "tensor / pipeline / data parallel", base, f"one {_unit(f)} only")
        for n in sizes:
            if f.num_heads % n or f.num_kv_heads % n and n % f.num_kv_heads:
                self.skip(stage, f"tensor-parallel-size {n}", base, f"{f.num_heads} heads do not split {n} ways")
            else:
                self.try_(stage, f"tensor-parallel-size {n}", base.with_(tensor_parallel_size=n))
        for n in sizes:
            if n > f.num_layers:
                self.skip(stage, f"pipeline-parallel-size {n}", base, f"{f.num_layers} layers")
            else:
                self.try_(stage, f"pipeline-parallel-size {n}", base.with_(pipeline_parallel_size=n))
        for n in sizes:
            self.try_(stage, f"data-parallel-size {n}", base.with_(data_parallel_size=n))
        self.try_(stage, "speculative decoding, n-gram (4 tokens)", self.best.config.with_(speculative_config=NGRAM))
        if f.draft:
            spec = {"method": "draft_model", "model": f.draft, "num_speculative_tokens": 4}
            self.try_(stage, "speculative decoding, draft model", self.best.config.with_(speculative_config=spec))
        else:
            self.skip(stage, "speculative decoding, draft model", self.best.config, "no --draft given")

    def scale_out_stage(self) -> None:
        f, best = self.facts, self.best
        g = best.measurement.goodput
        notes = {"per_replica_goodput_rps": g, "router_policy": f.router_policy}
        why_policy = ("the workload shares prefixes: requests go where their prefix is cached"
                      if f.shares_prefixes else "no shared prefixes: the least-loaded replica")  # fmt: skip
        if f.target_rate is None:
            verdict = f"computed: one replica holds {g:.3g} req/s under the SLO; give --rate for the fleet"
        elif g <= 0:
            verdict = f"computed: no configuration met the SLO, so no number of replicas holds {f.target_rate:g} req/s"
        else:
            n = math.ceil(f.target_rate / g)
            notes.update(replicas=n, target_rate=f.target_rate)
            verdict = f"computed: {n} replica(s) of the best configuration hold {f.target_rate:g} req/s"
            if f.price_per_hour is not None:
                notes["fleet_cost_per_hour"] = n * f.price_per_hour * best.config.engines()
                verdict += f", ${notes['fleet_cost_per_hour']:.2f}/h"
        verdict += f"; router --policy {f.router_policy} ({why_policy})"
        self._record(Trial("scale out", "replicas behind the router", best.config, verdict, predicted=True,
                           notes=notes))  # fmt: skip

    def disaggregate_stage(self) -> None:
        stage, f = "disaggregate", self.facts
        pd = Config(self.best.config.with_(cpu_threads=None, data_parallel_size=1).changes, pd=True)
        why = f.pd_possible
        if why is None and self.left() < 1.5 * self._estimate():
            why = f"budget ({self.left():.0f} s left)"
        if why is None:
            t = self.try_(stage, "P/D: a prefill and a decode engine, half the machine each", pd)
            if t.measurement is not None:
                return
            why = t.verdict
        ratio = f.mean_input_len / max(f.mean_output_len, 1.0)
        pays = ratio >= 4
        self._record(Trial(stage, "P/D: a prefill and a decode engine", pd,
                           f"predicted, not measured ({why}): prompts are {ratio:.1f}x the output, so P/D "
                           + ("may pay (prefill-heavy: long prompts stall decodes)" if pays
                              else "is unlikely to pay (decode-heavy: a split idles the prefill engine)"),
                           predicted=True))  # fmt: skip


def _unit(f: Facts) -> str:
    return "GPU" if f.device == "cuda" else "core"
