"""The walk: target, baseline, memory and batching, quantization, parallelism, scale out, disaggregate. Each stage
tries a few changes on top of the best configuration so far and keeps one only when its measured goodput under the
SLO beat the best by `min_gain`; what cannot fit is pruned first, a quantization over the quality bound is
rejected before any speed run, and a candidate the budget cannot pay for is skipped, saying so. The fleet beyond
this machine (replicas for --rate, P/D splits of them) is simulated with `fulcrum sim` (fleet.py), a prediction."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fulcrum.defaults import serve_max_num_batched_tokens
from fulcrum.tune.facts import Facts
from fulcrum.tune.fleet import FleetSim, SimRun, pd_splits
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
MIN_SIM_S = 30.0  # the least budget a simulated fleet gets: a quick calibration and a few `fulcrum sim` runs
SIM_RUN_S = 3.0  # one `fulcrum sim` run of a minute's arrivals: mostly its process starting
BUDGET_FACTOR = 4  # the memory stage's step budgets: the server's own for the device divided and multiplied by this
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


def budget_candidates(device: str, max_num_seqs: int, fulcrum_server: bool = True) -> list[int]:
    """The step budgets the memory stage tries: a smaller one (shorter steps, so running decodes wait less behind a
    prefill) and a larger one (prefills in fewer steps), around the budget `fulcrum serve` takes on the device when none
    is given: on CPU 256 (so 128 and 1024), on a GPU 2048 (512 and 8192). Never below max_num_seqs, where not every
    running sequence's decode token fits a step. For fulcrum's server never the default itself, which its baseline
    ran; another engine's baseline ran at that engine's own default, which tune does not know, so fulcrum's default
    for the device is a candidate there too (between the two)."""
    default = serve_max_num_batched_tokens(device, max_num_seqs)
    lower = max(default // BUDGET_FACTOR, max_num_seqs)
    if not fulcrum_server:
        return sorted({lower, max(default, max_num_seqs), default * BUDGET_FACTOR})
    return [b for b in (lower, default * BUDGET_FACTOR) if b != default]


class Walk:
    """Runs the stages. `measure(config, start_at, deadline)` measures one candidate; `gate(quantization,
    kv_cache_dtype)` scores a format (`quality.EvalGate`); `progress(stage, change, seconds_left)` shows where the
    walk is. `fleet` simulates scale out and P/D with `fulcrum sim` (None: arithmetic only, `fleet_why` says why)."""

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
        fleet: FleetSim | None = None,
        fleet_why: str = "no fleet simulator",
    ):
        self.measure_fn, self.gate, self.facts, self.bounds = measure, gate, facts, quality_bounds
        self.budget_s, self.min_gain, self.progress, self.clock = budget_s, min_gain, progress, clock
        self.t0 = clock()
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.baseline: Trial | None = None
        self.best_runs: list[float] = []  # the goodput of each run of the best so far
        self.bar = 0.0  # what a change must beat: the mean of the best's runs
        self.measured_s: list[float] = []
        self.gate_s: list[float] = []  # how long each quality score took
        self.fleet, self.fleet_why = fleet, fleet_why
        self.fleet_answer: SimRun | None = None  # scale out's simulated fleet, which P/D is set against

    # -- time ------------------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.budget_s - (self.clock() - self.t0)

    def _kept(self) -> float:
        """With a rate to hold, the simulated fleet at the end of the walk keeps its share of the budget."""
        return MIN_SIM_S if self.fleet is not None and self.facts.target_rate else 0.0

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

    def _why_not(self, config: Config, takes: float | None = None) -> str | None:
        """Why a candidate is not started: a knob the server command lacks, plan's memory, or the budget (`takes`:
        what the step costs, by default a speed run: the median so far)."""
        for knob in config.changes:
            if not self.facts.exposes(knob):
                return f"the server command does not expose {knob}"
        why = self.facts.fits(config)
        if why:
            return f"does not fit ({why}); pruned by plan, not started"
        takes = self._estimate() if takes is None else takes
        kept = self._kept()
        if self.left() - kept < 1.2 * takes:
            also = f", {kept:.0f} s kept for fulcrum sim" if kept else ""
            return f"budget ({self.left():.0f} s left, this takes ~{takes:.0f} s{also})"
        return None

    def _measure(self, config: Config, like: Measurement | None) -> Measurement:
        """One run of a configuration, its load starting at half the concurrency where `like` did best."""
        start = max(1, (like.best.concurrency if like and like.best else 2) // 2)
        m = self.measure_fn(config, start, self.t0 + self.budget_s - self._kept())
        self.measured_s.append(m.seconds)
        return m

    def candidate(self, stage: str, change: str, config: Config) -> Trial:
        """Measure a change on top of the best so far, and keep it when it wins twice (`_judge`)."""
        why = self._why_not(config)
        if why:
            return self.skip(stage, change, config, why)
        self.progress(stage, change, self.left())
        trial = Trial(stage, change, config, "", measurement=self._measure(config, self.best.measurement))
        self._judge(trial)
        return self._record(trial)

    def _beats(self, goodput: float, bar: float) -> bool:
        return goodput > 0 and goodput > bar * (1 + self.min_gain)

    def _judge(self, trial: Trial) -> None:
        """A candidate that beat the bar once runs again, and so does the best, one after the other; kept when the
        lower of its two runs beats the higher of the best's, so that neither a lucky run of the candidate nor an
        unlucky one of the best keeps anything on a noisy machine."""
        first, need = trial.measurement, f"needs +{self.min_gain:.0%}"
        if first.error:
            trial.verdict = f"rejected: {first.error}"
            return
        if not self._beats(first.goodput, self.bar):
            trial.verdict = f"rejected: goodput {first.goodput:.3g} req/s vs {self.bar:.3g} kept ({need})"
            return
        if self.left() - self._kept() < 2 * first.seconds:
            trial.verdict = "rejected: won once, but no budget was left to confirm the win"
            return
        again = self._measure(trial.config, first)
        rerun = self._measure(self.best.config, self.best.measurement)
        trial.notes.update(runs=[first.as_dict(), again.as_dict()], best_rerun=rerun.as_dict())
        low = min(first, again, key=lambda m: m.goodput)
        high = max(self.best_runs + [rerun.goodput])
        self.best_runs.append(rerun.goodput)
        trial.measurement = low
        if again.error or not self._beats(low.goodput, high):
            trial.verdict = (f"rejected: goodput {low.goodput:.3g} req/s, the lower of two runs, vs {high:.3g}, the "
                             f"higher of the best's ({need})")  # fmt: skip
        else:
            trial.kept = True
            trial.verdict = f"kept: goodput x{low.goodput / high:.2f} (its lower run against the best's higher)"
            self.best, self.best_runs = trial, [first.goodput, again.goodput]
        self.bar = sum(self.best_runs) / len(self.best_runs)

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

    def baseline_stage(self) -> None:
        """The defaults, measured whatever plan's arithmetic says: every change is judged against them."""
        self.progress("baseline", "defaults", self.left())
        m = self._measure(Config(), None)
        verdict = f"the defaults did not serve: {m.error}" if m.error else "baseline"
        self.best = self.baseline = self._record(Trial("baseline", "defaults", Config(), verdict, not m.error, m))
        self.best_runs, self.bar = [m.goodput], m.goodput

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

    def memory_stage(self) -> None:
        stage, f = "memory & batching", self.facts
        # first: on a small machine the core the engine leaves its frontend is the largest lever of this stage, and
        # a budget that runs short must not end before it (the 0.5B shape on 2 cores: x1.7)
        if f.device == "cpu" and f.units > 1:
            self.candidate(stage, f"cpu-threads {f.units} (the frontend shares the cores)",
                           self.best.config.with_(cpu_threads=f.units))  # fmt: skip
        if f.kv_cache_need_gib and f.kv_cache_default_gib and f.kv_cache_need_gib > f.kv_cache_default_gib:
            size = round(f.kv_cache_need_gib * 1.25, 2)
            self.candidate(stage, f"kv-cache-memory {size:g} GiB (the load needs {f.kv_cache_need_gib:.2f})",
                           self.best.config.with_(kv_cache_memory=size))  # fmt: skip
        elif f.kv_cache_need_gib is not None:
            self.skip(stage, "kv-cache-memory", self.best.config,
                      f"the default cache ({f.kv_cache_default_gib:g} GiB) already holds the load's "
                      f"{f.kv_cache_need_gib:.2f} GiB of KV")  # fmt: skip
        for chunk in budget_candidates(f.device, self.best.config.get("max_num_seqs"), f.fulcrum_server):
            self.candidate(
                stage, f"max-num-batched-tokens {chunk}", self.best.config.with_(max_num_batched_tokens=chunk)
            )
        best = self.best.measurement.best
        c = best.concurrency if best else 1
        seqs = max(4, 2 * c)
        if seqs < self.best.config.get("max_num_seqs"):
            self.candidate(stage, f"max-num-seqs {seqs} (twice the best point's load)",
                      self.best.config.with_(max_num_seqs=seqs))  # fmt: skip
        if f.shares_prefixes:
            self.skip(stage, "no-prefix-caching", self.best.config, "the workload shares prefixes: caching stays on")
        else:
            self.candidate(
                stage, "no-prefix-caching (no prefix is shared)", self.best.config.with_(no_prefix_caching=True)
            )

    def _gated(self, stage: str, change: str, config: Config, quantization, kv_dtype: str) -> None:
        """A quantized candidate: scored against the unquantized model first, measured only within the bound."""
        # the score alone must fit the budget: a format over the bound then costs no speed run at all
        scores = sorted(self.gate_s)
        why = self._why_not(config, takes=scores[len(scores) // 2] if scores else 1.0)
        if why:
            self.skip(stage, change, config, why)
            return
        t0 = self.clock()
        q = self.gate(quantization, kv_dtype, timeout=max(self.left() - self._kept(), 1.0))
        self.gate_s.append(self.clock() - t0)
        if q.error:
            self.skip(stage, change, config, f"quality not known ({q.error})")
            return
        miss = quality_verdict(q.figures, self.bounds)
        if miss:
            self._record(Trial(stage, change, config, f"rejected unmeasured: quality {miss}", quality=q.figures))
            return
        self.candidate(stage, change, config).quality = q.figures

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
        for n in sizes:  # a shape not known (another engine's model) is tried: its server says if it splits
            kv_split = f.num_kv_heads % n == 0 or n % f.num_kv_heads == 0 if f.num_kv_heads else True
            if f.num_heads and (f.num_heads % n or not kv_split):
                self.skip(stage, f"tensor-parallel-size {n}", base,
                          f"{f.num_heads} query and {f.num_kv_heads} KV heads do not split {n} ways")  # fmt: skip
            else:
                self.candidate(stage, f"tensor-parallel-size {n}", base.with_(tensor_parallel_size=n))
        for n in sizes:
            if f.num_layers and n > f.num_layers:
                self.skip(stage, f"pipeline-parallel-size {n}", base, f"{f.num_layers} layers")
            else:
                self.candidate(stage, f"pipeline-parallel-size {n}", base.with_(pipeline_parallel_size=n))
        for n in sizes:
            self.candidate(stage, f"data-parallel-size {n}", base.with_(data_parallel_size=n))
        self.candidate(
            stage, "speculative decoding, n-gram (4 tokens)", self.best.config.with_(speculative_config=NGRAM)
        )
        if f.draft:
            spec = {"method": "draft_model", "model": f.draft, "num_speculative_tokens": 4}
            self.candidate(stage, "speculative decoding, draft model", self.best.config.with_(speculative_config=spec))
        else:
            self.skip(stage, "speculative decoding, draft model", self.best.config, "no --draft given")

    def _sim_deadline(self, share: float, least: float) -> float | None:
        """When simulated runs must end: `share` of what the final check leaves (all that is left when that is
        under MIN_SIM_S: the fleet answers --rate, the check only restates a gain), None when under `least`."""
        final = 2 * self._estimate() if self.best is not self.baseline else 0.0
        spare = self.left() - final
        spare = spare if spare >= MIN_SIM_S else self.left()
        if spare < least:
            return None
        return self.clock() + max(least, share * spare)

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
            notes.update(replicas=n, arithmetic_replicas=n, target_rate=f.target_rate)
            arithmetic = f"{n} replica(s) of the best configuration hold {f.target_rate:g} req/s"
            verdict, n = self._simulated_fleet(n, notes, arithmetic)
            if f.price_per_hour is not None:  # a replica is a machine like this one, P/D pair or not
                notes["fleet_cost_per_hour"] = n * f.price_per_hour
                verdict += f", ${notes['fleet_cost_per_hour']:.2f}/h"
        verdict += f"; router --policy {f.router_policy} ({why_policy})"
        self._record(Trial("scale out", "replicas behind the router", best.config, verdict, predicted=True,
                           notes=notes))  # fmt: skip

    def _simulated_fleet(self, n: int, notes: dict, arithmetic: str) -> tuple[str, int]:
        """The fewest replicas `fulcrum sim` says meet every bound at the target rate, searched from the arithmetic
        `n`; the arithmetic verdict, with the reason, when sim cannot run or answer."""
        f, config = self.facts, self.best.config
        why = self.fleet_why if self.fleet is None else self.fleet.why_not(config)
        deadline = None if why else self._sim_deadline(0.6 if f.pd_possible else 1.0, MIN_SIM_S / 2)
        if deadline is None:
            why = why or f"budget ({self.left():.0f} s left)"
            return f"computed: {arithmetic} (not simulated: {why})", n
        self.progress("scale out", f"fulcrum sim: replicas for {f.target_rate:g} req/s", self.left())
        t0 = self.clock()
        answer, tried, why = self.fleet.fewest_replicas(config, f.target_rate, f.router_policy, n, deadline)
        notes["sim"] = {"tried": {k: r.as_dict() for k, r in sorted(tried.items())}, "wall_s": self.clock() - t0,
                        "calibrations": self.fleet.calibrations}  # fmt: skip
        if answer is None:
            return f"computed: {arithmetic} (not simulated: {why})", n
        self.fleet_answer = answer
        notes.update(replicas=answer.replicas, sim_file=answer.path)
        fewer = tried.get(answer.replicas - 1)
        below = f"; {fewer.replicas} break it ({'; '.join(fewer.misses)})" if fewer and not fewer.met else ""
        return (f"simulated: {answer.replicas} replica(s) of the best configuration hold {f.target_rate:g} req/s "
                f"({answer.p90s()}{below}); arithmetic from the measured goodput: {n}"), answer.replicas  # fmt: skip

    def disaggregate_stage(self) -> None:
        stage, f = "disaggregate", self.facts
        pd = Config(self.best.config.with_(cpu_threads=None, data_parallel_size=1).changes, pd=True)
        why = f.pd_possible
        if why is None and self.left() < 1.5 * self._estimate():
            why = f"budget ({self.left():.0f} s left)"
        if why is None:
            t = self.candidate(stage, "P/D: a prefill and a decode engine, half the machine each", pd)
            if t.measurement is not None:
                return
            why = t.verdict
        ratio = f.mean_input_len / max(f.mean_output_len, 1.0)
        pays = ratio >= 4
        context = (f"prompts are {ratio:.1f}x the output, so P/D "
                   + ("may pay (prefill-heavy: long prompts stall decodes)" if pays
                      else "is unlikely to pay (decode-heavy: a split idles the prefill engine)"))  # fmt: skip
        notes: dict = {}
        simulated = self._simulated_pd(notes) if self.fleet_answer is not None else None
        verdict = (f"simulated, not measured ({why}): {simulated}; {context}" if simulated
                   else f"predicted, not measured ({why}): {context}")  # fmt: skip
        if "sim_error" in notes:
            verdict += f" (not simulated: {notes['sim_error']})"
        self._record(Trial(stage, "P/D: a prefill and a decode engine", pd, verdict, predicted=True, notes=notes))

    def _simulated_pd(self, notes: dict) -> str | None:
        """P/D splits of the scaled-out fleet's machine count (and of one machine fewer, when one holds), set
        against the colocated fleet by `fulcrum sim`: which met the SLO on fewer machines. None: not simulated."""
        f, colocated = self.facts, self.fleet_answer
        if colocated.replicas < 2:  # P/D needs a prefill and a decode engine
            return (
                f"one replica holds {f.target_rate:g} req/s ({colocated.p90s()}): P/D's two engines take more machines"
            )
        deadline = self._sim_deadline(1.0, 2 * SIM_RUN_S)
        if deadline is None:
            return None
        n = colocated.replicas
        self.progress("disaggregate", f"fulcrum sim: P/D splits of {n} machines", self.left())
        runs: list[SimRun] = []

        def first_met(machines: int) -> SimRun | None:
            for p, d in pd_splits(machines):
                if self.clock() >= deadline:
                    return None
                runs.append(self.fleet.run(self.best.config, f.target_rate, f.router_policy, deadline,
                                           prefill=p, decode=d))  # fmt: skip
                if runs[-1].met:
                    return runs[-1]
            return None

        t0 = self.clock()
        same = first_met(n)
        fewer = first_met(n - 1) if same and n - 1 >= 2 else None
        notes["sim"] = {"colocated": colocated.as_dict(), "pd": [r.as_dict() for r in runs],
                        "wall_s": self.clock() - t0}  # fmt: skip
        if not runs or all(r.error for r in runs):
            notes["sim_error"] = runs[0].error if runs else "no time left for a run"
            return None
        tried = ", ".join(r.describe() for r in runs)
        if fewer:
            return (f"P/D {fewer.prefill}+{fewer.decode} meets the SLO on {fewer.replicas} machines where "
                    f"colocated replicas need {colocated.replicas}: P/D takes fewer machines ({tried})")  # fmt: skip
        if same:
            fewer_too = f"no split of {n - 1} does" if n > 2 else "P/D takes two at least"
            return (f"P/D {same.prefill}+{same.decode} meets the SLO on {n} machines, as {n} colocated replicas do, "
                    f"and {fewer_too}: colocated is as good, and simpler ({tried})")  # fmt: skip
        return (
            f"no P/D split of {n} machines met the SLO where {colocated.replicas} colocated replica(s) do: "
            f"colocated takes fewer machines ({tried})"
        )


def _unit(f: Facts) -> str:
    return "GPU" if f.device == "cuda" else "core"
