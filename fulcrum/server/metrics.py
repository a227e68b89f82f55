"""Prometheus metrics, the set vLLM exposes, named `fulcrum:*` and, with `--metrics-compat vllm`,
also under vLLM's own names so that dashboards and autoscalers written for vLLM work unchanged."""

from __future__ import annotations

import time
import uuid

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from fulcrum.engine.kv_offload.offload import LATENCY_BUCKETS
from fulcrum.engine.messages import CoreOutputs, CoreReady, SchedulerStats
from fulcrum.engine.spec.stats import acceptance_rate, mean_accepted_length
from fulcrum.server.stages import STAGE_BUCKETS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)

# our suffix -> vLLM's name
VLLM_NAMES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "gpu_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "request_success": "vllm:request_success",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


class _Family:
    """One metric registered under our name and, optionally, vLLM's."""

    def __init__(self, kind, suffix: str, doc: str, registry, model: str, compat: bool, labels=(), **kw):
        names = [f"fulcrum:{suffix}"] + ([VLLM_NAMES[suffix]] if compat else [])
        self.metrics = [kind(n, doc, ["model_name", *labels], registry=registry, **kw) for n in names]
        self.model = model
        self._children: dict[tuple, list] = {}  # labels -> the labelled series (labels() locks and looks up)

    def _each(self, **labels):
        key = tuple(labels.items())
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = [m.labels(model_name=self.model, **labels) for m in self.metrics]
        return got

    def set(self, v, **labels):
        for m in self._each(**labels):
            m.set(v)

    def inc(self, v=1, **labels):
        if v:
            for m in self._each(**labels):
                m.inc(v)

    def observe(self, v, **labels):
        for m in self._each(**labels):
            m.observe(v)


class LoRACollector:
    """LoRA adapters' series, from the core's latest stats at scrape time: requests running and waiting per adapter,
    adapter loads into a slot and evictions from one, and vLLM's lora_requests_info (the adapters running and waiting
    as labels). Nothing is shown until an engine with LoRA reports."""

    def __init__(self, model: str):
        self.model = model
        self.stats = None
        self.max_loras = 0

    def collect(self):
        s = self.stats
        if s is None:
            return
        for kind, counts in (("running", s.lora_running), ("waiting", s.lora_waiting)):
            family = GaugeMetricFamily(f"fulcrum:lora_requests_{kind}", f"Requests {kind} per LoRA adapter",
                                       labels=["model_name", "lora_name"])  # fmt: skip
            for name, n in counts.items():
                family.add_metric([self.model, name], n)
            yield family
        for key, doc in (("loads", "LoRA adapters put in a slot"), ("evictions", "LoRA adapters taken out of a slot "
                                                                                 "for another")):  # fmt: skip
            family = CounterMetricFamily(f"fulcrum:lora_{key}", doc, labels=["model_name"])
            family.add_metric([self.model], getattr(s, f"lora_{key}"))
            yield family
        info = GaugeMetricFamily("fulcrum:lora_requests_info", "The LoRA adapters running and waiting (vLLM's)",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])  # fmt: skip
        info.add_metric([str(self.max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)], 1)
        yield info


class OffloadCollector:
    """The offload tiers' series (engine/kv_offload), read from the core's cumulative counts at scrape time: per
    tier (ram, disk) hits, stores, errors, occupancy and capacity, and load/store latency histograms. Nothing is
    shown until an engine with tiers reports."""

    # count name (after the tier) -> metric suffix, help, gauge?
    SERIES = {
        "hit_blocks": ("kv_offload_hit_blocks", "KV blocks found in an offload tier and loaded", False),
        "hit_bytes": ("kv_offload_hit_bytes", "KV bytes loaded from an offload tier", False),
        "hit_tokens": ("kv_offload_hit_tokens", "Prompt tokens found in an offload tier (in prefix_cache_hits too)",
                       False),
        "stored_blocks": ("kv_offload_stored_blocks", "KV blocks stored in an offload tier", False),
        "stored_bytes": ("kv_offload_stored_bytes", "KV bytes stored in an offload tier", False),
        "errors": ("kv_offload_errors", "Offload reads or writes that failed (recomputed instead)", False),
        "dropped_blocks": ("kv_offload_dropped_blocks", "KV blocks not stored: the writer was behind", False),
        "corrupt_blocks": ("kv_offload_corrupt_blocks", "Block files dropped: truncated, corrupt or foreign", False),
        "used_bytes": ("kv_offload_used_bytes", "Bytes an offload tier holds", True),
        "capacity_bytes": ("kv_offload_capacity_bytes", "Bytes an offload tier may hold", True),
    }  # fmt: skip

    def __init__(self, model: str, buckets: tuple[float, ...]):
        self.model, self.buckets = model, buckets
        self.counts: dict[str, int] = {}
        self.latency: dict[str, list[int]] = {}

    def collect(self):
        if not self.counts:
            return
        for key, (suffix, doc, gauge) in self.SERIES.items():
            family = (GaugeMetricFamily if gauge else CounterMetricFamily)(f"fulcrum:{suffix}", doc,
                                                                           labels=["model_name", "tier"])  # fmt: skip
            for tier in ("ram", "disk"):
                if f"{tier}_{key}" in self.counts:
                    family.add_metric([self.model, tier], self.counts[f"{tier}_{key}"])
            yield family
        loading = GaugeMetricFamily(
            "fulcrum:kv_offload_loading_requests", "Requests waiting for disk-tier reads", labels=["model_name"]
        )
        loading.add_metric([self.model], self.counts.get("loading_requests", 0))
        yield loading
        for op in ("load", "store"):
            family = HistogramMetricFamily(f"fulcrum:kv_offload_{op}_seconds", f"Offload tier {op}s, per operation "
                                           "(a request's load, a step's copy-out, a block file's write)",
                                           labels=["model_name", "tier"])  # fmt: skip
            for tier in ("ram", "disk"):
                enc = self.latency.get(f"{op}:{tier}")
                if not enc:
                    continue
                *counts, sum_us = enc
                cum, running = [], 0
                for bound, n in zip((*map(str, self.buckets), "+Inf"), counts):
                    running += n
                    cum.append((bound, running))
                family.add_metric([self.model, tier], cum, sum_us / 1e6)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, compat_vllm: bool = False):
        self.registry = CollectorRegistry()
        r, m, c = self.registry, model_name, compat_vllm
        self.running = _Family(Gauge, "num_requests_running", "Requests in the running batch", r, m, c)
        self.waiting = _Family(Gauge, "num_requests_waiting", "Requests waiting to be scheduled", r, m, c)
        self.kv_usage = _Family(Gauge, "kv_cache_usage_perc", "KV cache usage (1 = full)", r, m, c)
        self.gpu_usage = _Family(Gauge, "gpu_cache_usage_perc", "KV cache usage (older vLLM name)", r, m, c)
        self.prefix_queries = _Family(Counter, "prefix_cache_queries", "Prompt tokens looked up", r, m, c)
        self.prefix_hits = _Family(Counter, "prefix_cache_hits", "Prompt tokens found cached", r, m, c)
        self.preemptions = _Family(Counter, "num_preemptions", "Requests preempted", r, m, c)
        self.prompt_tokens = _Family(Counter, "prompt_tokens", "Prompt tokens processed", r, m, c)
        self.generation_tokens = _Family(Counter, "generation_tokens", "Tokens generated", r, m, c)
        self.success = _Family(Counter, "request_success", "Finished requests", r, m, c, labels=("finished_reason",))
        self.ttft = _Family(Histogram, "time_to_first_token_seconds", "TTFT", r, m, c, buckets=TTFT_BUCKETS)
        self.itl = _Family(Histogram, "inter_token_latency_seconds", "ITL", r, m, c, buckets=ITL_BUCKETS)
        self.tpot = _Family(
            Histogram, "time_per_output_token_seconds", "TPOT (older name of ITL)", r, m, c, buckets=ITL_BUCKETS
        )
        self.e2e = _Family(Histogram, "e2e_request_latency_seconds", "End-to-end latency", r, m, c, buckets=E2E_BUCKETS)
        self.queue = _Family(
            Histogram, "request_queue_time_seconds", "Time waiting before first scheduled", r, m, c, buckets=E2E_BUCKETS
        )
        # the frontend's stages before the engine (server/stages.py): where the HTTP arrival's time goes
        self.frontend = _Family(
            Histogram, "frontend_stage_seconds", "Frontend time per stage, HTTP arrival to the engine", r, m, False,
            labels=("stage",), buckets=STAGE_BUCKETS,
        )  # fmt: skip
        # data parallel: what each engine core was given and runs now (labelled by its index)
        self.engine_requests = _Family(
            Counter, "engine_requests", "Requests (samples) sent to each engine core", r, m, False, labels=("engine",)
        )
        self.engine_running = _Family(
            Gauge, "engine_num_requests_running", "Requests running on each engine core", r, m, False,
            labels=("engine",),
        )  # fmt: skip
        self._engine_given: dict[int, int] = {}
        # the cache's shape, as vLLM's cache_config_info: set once the engine reports ready
        self.kv_capacity = _Family(Gauge, "kv_cache_capacity_tokens", "Tokens the KV cache holds", r, m, False)
        self.cache_info = Gauge(
            "fulcrum:cache_config_info", "KV cache configuration", ["model_name", "block_size", "num_blocks",
            "cache_dtype"], registry=r,
        )  # fmt: skip
        # the weights' format and size (a GGUF file's block types), set once the engine reports ready
        self.weights_info = Gauge(
            "fulcrum:model_weights_bytes", "Bytes the loaded weights hold, labelled with their format",
            ["model_name", "quantization"], registry=r,
        )  # fmt: skip
        # speculative decoding, as vLLM counts it (engine/spec/stats.py); the ratios as gauges of our own
        self.spec_drafts = _Family(Counter, "spec_decode_num_drafts", "Request-steps that verified proposals", r, m, c)
        self.spec_draft_tokens = _Family(Counter, "spec_decode_num_draft_tokens", "Proposals verified", r, m, c)
        self.spec_accepted = _Family(Counter, "spec_decode_num_accepted_tokens", "Proposals accepted", r, m, c)
        self.spec_accepted_per_pos = _Family(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Proposals accepted at each position", r, m, c,
            labels=("position",),
        )  # fmt: skip
        self.spec_acceptance_rate = _Family(
            Gauge, "spec_decode_acceptance_rate", "Accepted over proposed tokens, since start", r, m, False
        )
        self.spec_mean_accepted_length = _Family(
            Gauge, "spec_decode_mean_accepted_length", "Tokens per speculating request-step, since start", r, m, False
        )
        # P/D disaggregation (engine/kv_transfer): the SchedulerStats field each counter follows
        self.kv_transfer_counters = {
            "kv_transfer_bytes_sent": Counter("fulcrum:kv_transfer_sent_bytes", "KV bytes sent to consumers",
                                              ["model_name"], registry=r),
            "kv_transfer_bytes_received": Counter("fulcrum:kv_transfer_received_bytes", "KV bytes pulled",
                                                  ["model_name"], registry=r),
            "kv_transfer_blocks_received": Counter("fulcrum:kv_transfer_received_blocks", "KV blocks pulled",
                                                   ["model_name"], registry=r),
            "kv_transfer_pulls": Counter("fulcrum:kv_transfer_pulls", "KV pulls completed", ["model_name"],
                                         registry=r),
            "kv_transfer_inline_pulls": Counter("fulcrum:kv_transfer_inline_pulls",
                                                "KV pulls whose bytes came as TCP frames (ZmqConnector, or a "
                                                "shared-memory pull with /dev/shm full)", ["model_name"],
                                                registry=r),
            "kv_transfer_seconds": Counter("fulcrum:kv_transfer_time_seconds", "Seconds spent in KV pulls",
                                           ["model_name"], registry=r),
            "kv_transfer_fallbacks": Counter("fulcrum:kv_transfer_fallbacks",
                                             "Remote prefills that fell back to a local prefill", ["model_name"],
                                             registry=r),
            "kv_transfer_leases_expired": Counter("fulcrum:kv_transfer_leases_expired",
                                                  "Prefills whose blocks were freed unpulled", ["model_name"],
                                                  registry=r),
        }  # fmt: skip
        self.kv_held = _Family(Gauge, "kv_transfer_held_blocks", "KV blocks held for pulls not yet made", r, m, False)
        self.kv_pending = _Family(Gauge, "kv_transfer_pending", "Requests waiting for their KV pull", r, m, False)
        self.kv_free_blocks = _Family(
            Gauge, "kv_cache_free_blocks", "KV cache blocks free (cached or not)", r, m, False
        )
        for counter in self.kv_transfer_counters.values():
            counter.labels(model_name=m)  # shown at 0 from the start, so a dashboard sees the series
        self._last_kv: dict[str, float] = {}
        self.offload = OffloadCollector(m, LATENCY_BUCKETS)
        self.lora = LoRACollector(m)
        r.register(self.lora)
        r.register(self.offload)
        self._last = {"q": 0, "h": 0, "p": 0, "sd": 0, "st": 0, "sa": 0}
        self._last_per_pos: list[int] = []
        self._last_token_time: dict[str, float] = {}
        # streamed requests' ids: their TTFT is taken when the first token's chunk is written (StreamTimer)
        self._write_timed: set[str] = set()

    def record_engines(self, given: list[int], running: list[int]) -> None:
        """Each engine core's cumulative requests given and its running count (the frontend's, at scrape time)."""
        for i, (g, n) in enumerate(zip(given, running)):
            self.engine_requests.inc(g - self._engine_given.get(i, 0), engine=str(i))
            self._engine_given[i] = g
            self.engine_running.set(n, engine=str(i))

    def record_ready(self, ready: CoreReady) -> None:
        self.kv_capacity.set(ready.num_blocks * ready.block_size)
        self.cache_info.labels(
            model_name=self.kv_capacity.model, block_size=str(ready.block_size), num_blocks=str(ready.num_blocks),
            cache_dtype=ready.kv_cache_dtype,
        ).set(1)  # fmt: skip
        if ready.max_loras:
            self.lora.max_loras, self.lora.stats = ready.max_loras, SchedulerStats()
        if ready.weights:
            self.weights_info.labels(model_name=self.kv_capacity.model, quantization=ready.weights).set(
                ready.weight_bytes
            )

    def stream_timer(self, arrival: float) -> StreamTimer:
        """The TTFT clock of one streamed HTTP request (its prompts and their samples), which stops when the chunk
        carrying each prompt's first token has been written to the connection (as the client will see it), not
        when the token reaches the frontend."""
        return StreamTimer(self, arrival)

    def record(self, msg: CoreOutputs, now: float) -> None:
        """A core's message, received by the frontend at `now`. TTFT and end-to-end latency run from the request's
        arrival (over HTTP, server/stages.py) to `now`, when the frontend has the token, as the user will; the
        queue time to the core's first scheduling of it."""
        s = msg.stats
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_free_blocks.set(s.num_free_blocks)
        self.kv_held.set(s.kv_transfer_held_blocks)
        self.kv_pending.set(s.kv_transfer_pending)
        for field, counter in self.kv_transfer_counters.items():
            v = getattr(s, field)
            if v > self._last_kv.get(field, 0):
                counter.labels(model_name=self.kv_capacity.model).inc(v - self._last_kv.get(field, 0))
            self._last_kv[field] = v
        self.gpu_usage.set(s.kv_cache_usage)
        self.offload.counts, self.offload.latency = s.kv_offload, s.kv_offload_latency
        if self.lora.max_loras:
            self.lora.stats = s
        # the core reports cumulative counts; prometheus counters take increments
        self.prefix_queries.inc(s.prefix_cache_queries - self._last["q"])
        self.prefix_hits.inc(s.prefix_cache_hits - self._last["h"])
        self.preemptions.inc(s.num_preemptions - self._last["p"])
        self.spec_drafts.inc(s.spec_num_drafts - self._last["sd"])
        self.spec_draft_tokens.inc(s.spec_num_draft_tokens - self._last["st"])
        self.spec_accepted.inc(s.spec_num_accepted_tokens - self._last["sa"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            seen = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            self.spec_accepted_per_pos.inc(n - seen, position=str(pos))
        self._last_per_pos = list(s.spec_accepted_per_pos)
        if s.spec_num_drafts:
            self.spec_acceptance_rate.set(acceptance_rate(s.spec_num_accepted_tokens, s.spec_num_draft_tokens))
            self.spec_mean_accepted_length.set(mean_accepted_length(s.spec_num_accepted_tokens, s.spec_num_drafts))
        self._last = {
            "q": s.prefix_cache_queries, "h": s.prefix_cache_hits, "p": s.num_preemptions,
            "sd": s.spec_num_drafts, "st": s.spec_num_draft_tokens, "sa": s.spec_num_accepted_tokens,
        }  # fmt: skip
        for o in msg.outputs:
            rid = o.request_id
            self.generation_tokens.inc(len(o.new_token_ids))
            if o.new_token_ids:
                last = self._last_token_time.get(rid)
                if last is None:
                    self.prompt_tokens.inc(o.num_prompt_tokens)
                    # the frontend's clock (`now`): the token has reached it; a streamed request's when its chunk is
                    # written (StreamTimer)
                    if o.first_token_time and rid.rpartition("-")[0] not in self._write_timed:
                        self.ttft.observe(now - o.arrival_time)
                else:
                    self.itl.observe(now - last)
                    self.tpot.observe(now - last)
                self._last_token_time[rid] = now
            if o.finish_reason is not None:
                self._last_token_time.pop(rid, None)
                self.success.inc(finished_reason=o.finish_reason)
                if o.finish_time:
                    self.e2e.observe(now - o.arrival_time)
                if o.first_scheduled_time:
                    self.queue.observe(o.first_scheduled_time - o.arrival_time)


class StreamTimer:
    """TTFT for a streamed response (ServerMetrics.stream_timer): `request_id(i)` names prompt i's engine request
    (its samples `{id}-{k}` are excluded from the output loop's TTFT), `written(ids)` is called after each chunk is
    written with the prompts that have had tokens so far, and `close()` when the stream ends (a prompt whose first
    token was never written, a client gone, gets no TTFT)."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.prefix = f"stream-{uuid.uuid4().hex[:16]}"
        self.ids: dict[str, int] = {}  # request id -> its samples
        self.timed: set[str] = set()

    def request_id(self, i: int, samples: int) -> str:
        rid = f"{self.prefix}-{i}"
        self.ids[rid] = samples
        self.metrics._write_timed.add(rid)
        return rid

    def written(self, started) -> None:
        now = time.time()
        for rid in started:
            if rid in self.ids and rid not in self.timed:
                self.timed.add(rid)
                for _ in range(self.ids[rid]):
                    self.metrics.ttft.observe(now - self.arrival)

    def close(self) -> None:
        for rid in self.ids:
            self.metrics._write_timed.discard(rid)
