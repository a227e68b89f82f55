"""The fleet beyond this machine: tune's scale-out and P/D answers simulated by `fulcrum sim` on the best
configuration's engine settings. sim imports the engine and tune may not (it tunes other engines' servers the
same way), so sim and its calibration run as processes and tune reads the JSON `fulcrum sim --out` writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.bench.workloads import WorkloadSpec
from fulcrum.defaults import serve_max_num_batched_tokens
from fulcrum.tune.space import Config
from fulcrum.tune.target import Bound, slo_misses

MAX_REPLICAS = 64
MAX_PROCESS_S = 3600.0  # one sim or calibration run, however long the budget
QUICK_BELOW_S = 300.0  # a calibration with less time than this left takes the quick sweep
NO_CALIBRATION = "no step-cost calibration"  # what `fulcrum sim` says when this machine has none for the settings
# knobs one simulated replica does not model: sim's step costs are one engine's, without ranks or a proposer
UNMODELLED = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "speculative_config")

Runner = Callable[[list[str], float], tuple[int, str]]  # (command, timeout s) -> (exit code, output)


def run_process(cmd: list[str], timeout: float) -> tuple[int, str]:
    """The command's exit code and output; a timeout is exit code 124, as `timeout` reports it."""
    timeout = min(max(timeout, 1.0), MAX_PROCESS_S)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def workload_flags(spec: WorkloadSpec) -> list[str]:
    """The workload as `fulcrum sim`'s workload flags (the same `add_workload_args` tune takes)."""
    out = ["--workload", spec.name, "--input-len", str(spec.input_len), "--output-len", str(spec.output_len),
           "--num-groups", str(spec.num_groups), "--prefix-len", str(spec.prefix_len), "--long-fraction",
           f"{spec.long_fraction:g}", "--long-input-len", str(spec.long_input_len), "--turns", str(spec.turns),
           "--seed", str(spec.seed)]  # fmt: skip
    return out + (["--dataset", spec.dataset] if spec.dataset else [])


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


@dataclass
class SimRun:
    """One simulated fleet at the target rate: colocated replicas, or P/D's prefill and decode engines."""

    replicas: int  # machines: colocated replicas, or prefill + decode engines
    prefill: int = 0
    decode: int = 0
    summary: dict = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)
    path: str = ""
    wall_s: float = 0.0
    error: str | None = None

    @property
    def met(self) -> bool:
        return self.error is None and not self.misses

    @property
    def shape(self) -> str:
        return f"P/D {self.prefill}+{self.decode}" if self.prefill else f"{self.replicas} replica(s)"

    def p90s(self) -> str:
        s = self.summary
        return ", ".join(f"{m} p90 {s[f'{m}_ms']['p90']:,.0f}ms" for m in ("ttft", "tpot")
                         if s.get(f"{m}_ms", {}).get("p90") is not None)  # fmt: skip

    def describe(self) -> str:
        if self.error:
            return f"{self.shape}: {self.error}"
        return f"{self.shape}: {self.p90s()}: " + ("meets the SLO" if self.met else "; ".join(self.misses))

    def as_dict(self) -> dict:
        return {"replicas": self.replicas, "prefill": self.prefill, "decode": self.decode, "met": self.met,
                "misses": self.misses, "error": self.error, "file": self.path, "wall_s": round(self.wall_s, 2),
                "p90": {m: self.summary.get(f"{m}_ms", {}).get("p90") for m in ("ttft", "tpot", "itl", "e2e")}}  # fmt: skip


def parse_result(path: str | Path, bounds: list[Bound]) -> tuple[dict, list[str]]:
    """The first run's summary of a `fulcrum sim --out` file, and the SLO bounds it breaks (as tune judges a
    measured load point: each percentile against its bound; failed requests are a miss too)."""
    doc = json.loads(Path(path).read_text())
    summary = doc["runs"][0]["summary"]
    misses = slo_misses(summary, bounds)
    if summary.get("failed"):
        misses.append(f"{summary['failed']} requests failed")
    return summary, misses


class FleetSim:
    """Runs `fulcrum sim` for tune: `model` as tune serves it, the walk's workload and SLO, files under `folder`.
    `costs`: a step-cost file to use (default: this machine's calibration of the settings, made when missing)."""

    def __init__(
        self,
        model: str,
        workload: WorkloadSpec,
        slo: list[Bound],
        folder: Path,
        *,
        dtype: str = "auto",
        tokenizer: str | None = None,
        costs: str | None = None,
        device: str = "cpu",
        runner: Runner = run_process,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model, self.workload, self.slo, self.folder = model, workload, slo, Path(folder)
        self.dtype, self.tokenizer, self.costs, self.runner, self.clock = dtype, tokenizer, costs, runner, clock
        self.device = device  # where tune's servers run: their step budget's default is this device's
        self.calibrations: list[dict] = []  # what was calibrated for this tune: command, seconds, outcome
        self._costs_of: dict[tuple, str | None] = {}  # a quantized setting's own cost file (sim cannot find it)

    def why_not(self, config: Config) -> str | None:
        """Why `config` cannot be simulated, or None."""
        if config.pd:
            return "the best is already P/D"
        knobs = [k for k in UNMODELLED if k in config.changes]
        if knobs:
            return f"sim models one engine per replica, not {', '.join(knobs)}"
        return None

    def budget(self, config: Config) -> int:
        """The step budget `config`'s server runs with: its own, else `fulcrum serve`'s default on this device."""
        return config.get("max_num_batched_tokens") or serve_max_num_batched_tokens(
            self.device, config.get("max_num_seqs")
        )

    # -- commands ----------------------------------------------------------------------------------------------
    def _base(self) -> list[str]:
        return [sys.executable, "-m", "fulcrum.cli", "sim"]

    def calibrate_command(self, config: Config, quick: bool, out: str | None = None) -> list[str]:
        cmd = [*self._base(), "calibrate", self.model, "--dtype", self.dtype,
               "--kv-cache-dtype", str(config.get("kv_cache_dtype")),
               "--max-num-seqs", str(config.get("max_num_seqs")),
               "--max-num-batched-tokens", str(self.budget(config))]  # fmt: skip
        if config.get("quantization"):
            cmd += ["--quantization", str(config.get("quantization"))]
        return cmd + (["--quick"] if quick else []) + (["--out", out] if out else [])

    def sim_command(self, config: Config, rate: float, policy: str, out: str, *, replicas: int = 1,
                    prefill: int = 0, decode: int = 0, costs: str | None = None) -> list[str]:  # fmt: skip
        """`fulcrum sim` of `config`'s engine settings (the scheduler's limits and prefix caching; the dtypes name
        the calibration) at `rate` requests/s: `replicas` colocated, or `prefill` + `decode` engines."""
        cmd = [*self._base(), "--model", self.model, "--dtype", self.dtype,
               "--kv-cache-dtype", str(config.get("kv_cache_dtype")),
               "--max-num-seqs", str(config.get("max_num_seqs")),
               "--max-num-batched-tokens", str(self.budget(config)),
               "--policy", policy, "--request-rate", f"{rate:g}",
               "--num-prompts", str(self.num_prompts(rate)), "--out", out, "--no-requests"]  # fmt: skip
        if config.get("no_prefix_caching"):
            cmd.append("--no-enable-prefix-caching")
        cmd += ["--prefill-replicas", str(prefill), "--decode-replicas", str(decode)] if prefill else \
            ["--replicas", str(replicas)]  # fmt: skip
        costs = costs or self.costs
        cmd += ["--costs", costs] if costs else []
        cmd += ["--tokenizer", self.tokenizer] if self.tokenizer else []
        return cmd + workload_flags(self.workload)

    @staticmethod
    def num_prompts(rate: float) -> int:
        """A minute of arrivals at `rate`, 300 to 2000 requests: past the fleet's warm-up, yet seconds to run."""
        return max(300, min(2000, round(rate * 60)))

    # -- running -----------------------------------------------------------------------------------------------
    def _calibrated(self, config: Config, deadline: float) -> str | None:
        """Calibrate `config`'s settings on this machine (the quick sweep when little time is left): a quantized
        setting into the tune's folder (sim looks up unquantized ones only), else where sim finds it."""
        key = (config.get("kv_cache_dtype"), config.get("quantization"))
        if key in self._costs_of:
            return self._costs_of[key]
        left = deadline - self.clock()
        quick = left < QUICK_BELOW_S
        out = None
        if config.get("quantization"):
            self.folder.mkdir(parents=True, exist_ok=True)
            out = str(self.folder / f"step-costs-{config.get('quantization')}-kv{config.get('kv_cache_dtype')}.json")
        cmd = self.calibrate_command(config, quick, out)
        t0 = self.clock()
        rc, output = self.runner(cmd, left)
        record = {"command": " ".join(cmd[2:]), "seconds": round(self.clock() - t0, 1), "quick": quick}
        if rc != 0:
            record["error"] = _last_line(output)
            self.calibrations.append(record)
            raise RuntimeError(f"fulcrum sim calibrate failed: {record['error']}")
        self.calibrations.append(record)
        self._costs_of[key] = out
        return out

    def run(self, config: Config, rate: float, policy: str, deadline: float, *, replicas: int = 1,
            prefill: int = 0, decode: int = 0) -> SimRun:  # fmt: skip
        """One simulated fleet, calibrating first when this machine has no step costs for the settings. A run
        that cannot finish (sim's error, the deadline) comes back with `error` set."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"pd-{prefill}p{decode}d" if prefill else f"replicas-{replicas}"
        out = str(self.folder / f"sim-{name}.json")
        res = SimRun(prefill + decode if prefill else replicas, prefill, decode, path=out)
        t0 = self.clock()
        try:
            costs = None
            if self.costs is None and config.get("quantization"):
                costs = self._calibrated(config, deadline)
            kw = dict(replicas=replicas, prefill=prefill, decode=decode)
            rc, output = self.runner(self.sim_command(config, rate, policy, out, costs=costs, **kw),
                                     deadline - self.clock())  # fmt: skip
            if rc != 0 and NO_CALIBRATION in output and self.costs is None:
                self._calibrated(config, deadline)
                rc, output = self.runner(self.sim_command(config, rate, policy, out, costs=costs, **kw),
                                         deadline - self.clock())  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"fulcrum sim exited {rc}: {_last_line(output)}")
            res.summary, res.misses = parse_result(out, self.slo)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            res.error = str(e)
        res.wall_s = self.clock() - t0
        return res

    def fewest_replicas(self, config: Config, rate: float, policy: str, start: int, deadline: float):
        """The fewest colocated replicas whose simulated percentiles meet every bound, searched from `start` (the
        arithmetic answer): down while it holds, up by doubling steps while it does not (to MAX_REPLICAS), then
        bisected between the two. Returns (the answer's SimRun or None, every run by replica count, why none)."""
        tried: dict[int, SimRun] = {}

        def met(n: int) -> bool:
            if n not in tried:
                tried[n] = self.run(config, rate, policy, deadline, replicas=n)
                if tried[n].error:
                    raise RuntimeError(tried[n].error)
            return tried[n].met

        start = max(1, min(start, MAX_REPLICAS))
        try:
            lo, hi, step = 0, None, 1  # lo: the most replicas known to break the SLO; hi: the fewest that meet it
            if met(start):
                hi = start
                while hi - step > lo and met(hi - step):
                    hi, step = hi - step, step * 2
                lo = max(lo, hi - step) if hi - step > 0 else 0
            else:
                lo = start
                while lo < MAX_REPLICAS:
                    n = min(lo + step, MAX_REPLICAS)
                    if met(n):
                        hi = n
                        break
                    lo, step = n, step * 2
            if hi is None:
                return None, tried, f"no fleet of up to {MAX_REPLICAS} replicas met the SLO"
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if met(mid) else (mid, hi)
        except RuntimeError as e:
            return None, tried, str(e)
        return tried[hi], tried, None


def pd_splits(machines: int) -> list[tuple[int, int]]:
    """P/D splits of `machines` engines, a third prefill first (prompts are usually the smaller share of the work),
    then half and a quarter: (prefill, decode), each pool at least one."""
    out = []
    for p in (machines // 3, machines // 2, machines // 4):
        split = (max(1, p), machines - max(1, p))
        if split[1] >= 1 and split not in out:
            out.append(split)
    return out
