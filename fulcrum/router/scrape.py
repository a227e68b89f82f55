"""A replica's /metrics read into the few numbers routing and autoscaling need, from fulcrum's names or vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("fulcrum:", "vllm:", "sglang:")


@dataclass
class Histogram:
    """Cumulative bucket counts (upper bound -> count), summed over label sets."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0

    def minus(self, older: Histogram | None) -> Histogram:
        if older is None:
            return self
        return Histogram(
            {le: c - older.buckets.get(le, 0.0) for le, c in self.buckets.items()}, self.count - older.count
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear inside the bucket that holds the q-th observation."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * ((rank - below) / (c - below) if c > below else 1.0)
            lower, below = le, c
        return lower


def add(a: Histogram, b: Histogram) -> Histogram:
    keys = set(a.buckets) | set(b.buckets)
    return Histogram({k: a.buckets.get(k, 0.0) + b.buckets.get(k, 0.0) for k in keys}, a.count + b.count)


@dataclass
class ReplicaMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)


def sample_totals(text: str, split_by: str | None = None) -> dict[str, float]:
    """Every sample of a /metrics text by name, its values summed over label sets; with `split_by`, a sample carrying
    that label is kept apart as `name{value}`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels[split_by] + "}" if split_by in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def _suffix(name: str) -> str | None:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return None


def parse_metrics(text: str) -> ReplicaMetrics:
    """fulcrum's own names win over vLLM's where a server exposes both (`--metrics-compat vllm`)."""
    m = ReplicaMetrics()
    seen: dict[str, str] = {}  # suffix -> prefix it was taken from
    for family in text_string_to_metric_families(text):
        suffix = _suffix(family.name)
        if suffix is None:
            continue
        prefix = family.name[: -len(suffix)]
        if suffix in seen and seen[suffix] == "fulcrum:" and prefix != "fulcrum:":
            continue
        seen[suffix] = prefix
        samples = family.samples
        if suffix in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
            value = sum(s.value for s in samples)
            if suffix == "num_requests_waiting":
                m.waiting = value
            elif suffix == "num_requests_running":
                m.running = value
            elif suffix == "kv_cache_usage_perc" or ("kv_cache_usage_perc" not in seen):
                m.kv_usage = value
        elif suffix == "cache_config_info":
            for s in samples:
                if "block_size" in s.labels:
                    m.block_size = int(s.labels["block_size"])
                if s.labels.get("num_gpu_blocks", s.labels.get("num_blocks", "")).isdigit():
                    m.num_blocks = int(s.labels.get("num_gpu_blocks", s.labels.get("num_blocks")))
        elif suffix in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
            h = Histogram()
            for s in samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h.buckets[le] = h.buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_count"):
                    h.count += s.value
            if suffix == "time_to_first_token_seconds":
                m.ttft = h
            else:
                m.itl = h
    return m
