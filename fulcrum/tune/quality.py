"""The quality gate of the quantization stage: `fulcrum eval` scores a format against the unquantized model (KL
divergence, top-1 agreement, perplexity ratio) in its own process, before any server of it is started."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

EVAL_WINDOWS = 8  # windows of 256 tokens: enough to tell int8 (KL ~1e-4) from int4 (~1e-2) on the bundled model


@dataclass
class QualityResult:
    figures: dict  # eval's JSON: kl_mean, kl_p99, top1_agreement, perplexity_ratio, ...
    error: str | None = None


class EvalGate:
    """Runs `fulcrum eval` once per format and remembers the answer."""

    def __init__(self, model: str | None, data: str | None = None, windows: int = EVAL_WINDOWS, timeout: float = 900):
        self.model, self.data, self.windows, self.timeout = model, data, windows, timeout
        self.cache: dict[tuple, QualityResult] = {}
        self.seconds = 0.0

    def __call__(self, quantization: str | None, kv_cache_dtype: str = "auto", timeout: float | None = None):
        """The figures of a format (None, "auto": the unquantized model); `timeout` caps this one score."""
        key = (quantization, kv_cache_dtype)
        if key not in self.cache:
            self.cache[key] = self._run(quantization, kv_cache_dtype, min(self.timeout, timeout or self.timeout))
        return self.cache[key]

    def _run(self, quantization: str | None, kv_cache_dtype: str, timeout: float) -> QualityResult:
        if self.model is None:
            return QualityResult({}, "no local folder of the model for fulcrum eval to score")
        cmd = [sys.executable, "-m", "fulcrum.cli", "eval", self.model, "--json", "--max-windows", str(self.windows)]
        if quantization:
            cmd += ["--quantization", quantization]
        if kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", kv_cache_dtype]
        if self.data:
            cmd += ["--data", self.data]
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return QualityResult({}, f"fulcrum eval took over {timeout:.0f} s (the budget left)")
        finally:
            self.seconds += time.monotonic() - t0
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return QualityResult({}, f"fulcrum eval failed: {last}")
        try:
            return QualityResult(json.loads(done.stdout))
        except ValueError:
            return QualityResult({}, f"fulcrum eval printed no JSON: {done.stdout[-200:]!r}")
