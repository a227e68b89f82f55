"""One simulated engine: fulcrum's own Scheduler and KVCacheManager, stepped on a simulated clock.

Nothing of the scheduling is re-implemented here: admission, chunked prefill, the token budget, prefix caching,
preemption, priorities and the KV block budget are the engine's code, run as the engine core runs them
(engine/core.py's synchronous step: schedule, execute, update). Only the forward pass is replaced: a step takes the
seconds the step-cost model gives its shape, and every row that samples draws the same token (stops are by length,
as in a benchmark that sets ignore_eos). A P/D producer hands a finished prefill's blocks to a lease, and a consumer
pulls them into blocks reserved under a stand-in id, as engine/kv_transfer does."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.request import Request
from fulcrum.engine.scheduler import Scheduler, SchedulerOutput
from fulcrum.plan.step_costs import StepShape
from fulcrum.sampling_params import SamplingParams

SIM_TOKEN = 0  # the token every simulated step samples (only lengths stop a simulated request)


@dataclass
class EngineShape:
    """The engine settings a simulated replica runs with (a calibration file's `engine`, or the flags)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def scheduler_config(self):
        """What Scheduler reads of an EngineConfig."""
        return SimpleNamespace(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )


@dataclass
class Track:
    """One request as the client sees it: when it was sent, and when each of its tokens came back."""

    session: object  # the SimSession
    turn: int
    start: float
    prompt_ids: list[int]
    max_tokens: int
    tag: str = ""
    input_len: int = 0
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    output_ids: list[int] = field(default_factory=list)
    replica: str = ""
    prefill_replica: str = ""
    finish: float | None = None
    error: str | None = None
    rid: str = ""  # the engine request id (P/D: its prefill leg is rid#prefill)
    history: list[int] = field(default_factory=list)  # the conversation after this turn's user tokens
    hashes: object = None  # the router's block hashes of the prompt, computed once


class SimKV(KVCacheManager):
    """The engine's KV-cache manager, less the one thing only a forward pass reads: the block tables."""

    def block_table(self, request_id: str) -> list[int]:
        return []


class SimReplica:
    def __init__(self, name: str, shape: EngineShape, costs, role: str = "both", record: bool = False,
                 kv_events: bool = False):  # fmt: skip
        self.name, self.shape, self.costs, self.role = name, shape, costs, role
        self.kv = SimKV(shape.num_blocks, shape.block_size, shape.enable_prefix_caching,
                                 events_medium="cpu" if kv_events else None)  # fmt: skip
        on_finish = self._hand_over if role == "producer" else None
        self.scheduler = Scheduler(shape.scheduler_config(), shape.max_model_len, self.kv, on_finish=on_finish)
        self.tracks: dict[str, Track] = {}
        self.current: SchedulerOutput | None = None
        self.sampling: list[str] = []
        self.step_end: float | None = None  # when the step running now ends (None: idle)
        self.last_arrival = -1.0
        self.waking = False  # a wake-up is due at this instant (the fleet's WAKE event)
        self.pool_name = ""
        self.busy_s = 0.0
        self.steps = 0
        self.started_at = 0.0
        self.record = record
        self.log: list[tuple[list[tuple[str, int]], list[str]]] = []  # per step: (request, tokens), preempted
        self.leases: dict[str, int] = {}  # producer: request id -> blocks held for a pull
        self.finished_prefills: list[Request] = []

    # -- requests --------------------------------------------------------------------------------------

    def add(self, rid: str, track: Track, prompt_ids: list[int], max_tokens: int, now: float,
            priority: int = 0) -> None:  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        # no two requests reach a live engine at the same instant, and the scheduler breaks ties by arrival (the
        # latest-arrived is preempted first): requests of one simulated instant keep their order, a nanosecond apart
        at = self.last_arrival = max(now, self.last_arrival + 1e-9)
        self.scheduler.add_request(Request(rid, prompt_ids, params, [], priority, at))
        self.tracks[rid] = track

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - len(self.kv.free_queue) / self.kv.num_blocks

    def idle(self) -> bool:
        return self.step_end is None

    # -- steps -----------------------------------------------------------------------------------------

    def begin(self, now: float) -> float | None:
        """Schedule a step; return when it ends (None: nothing to run)."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return None
        shape, sampling = StepShape(), []
        for s in out.scheduled:  # the shape as calibration reads it (probe/step_sweep.py's StepRecorder)
            samples = s.samples_next_token
            shape.add(s.num_new_tokens, s.request.num_computed_tokens, samples)
            if samples:
                sampling.append(s.request.request_id)
        dt = self.costs.step_seconds(shape)
        if self.record:
            self.log.append(([(s.request.request_id, s.num_new_tokens) for s in out.scheduled], list(out.preempted)))
        self.current, self.sampling = out, sampling
        self.busy_s += dt
        self.steps += 1
        self.step_end = now + dt
        return self.step_end

    def end(self, now: float) -> list[tuple[str, Track]]:
        """The step running now ends at `now`: its tokens are taken. Returns the requests that finished."""
        out, self.current, self.step_end = self.current, None, None
        sampled = {rid: [SIM_TOKEN] for rid in self.sampling}
        tracks = self.tracks
        for rid in self.sampling:
            tracks[rid].token_times.append(now)
        done = []
        for req in self.scheduler.update(out, sampled):
            t = tracks.pop(req.request_id)
            t.num_cached_tokens, t.num_preemptions = req.num_cached_tokens, req.num_preemptions
            t.output_ids = req.output_token_ids
            t.finish = now
            done.append((req.request_id, t))
        return done

    # -- P/D -------------------------------------------------------------------------------------------

    def _hand_over(self, req: Request, status) -> None:
        """Producer: a finished prefill's full prompt blocks go to a lease until the consumer has pulled them."""
        num_full = (req.num_tokens - 1) // self.kv.block_size
        lease = f"{req.request_id}#lease"
        held = self.kv.hand_over(req.request_id, lease, num_full)
        self.leases[req.request_id] = len(held)

    def release_lease(self, rid: str) -> None:
        if self.leases.pop(rid, None) is not None:
            self.kv.release(f"{rid}#lease")

    def reserve_pull(self, rid: str, prompt_ids: list[int]) -> int | None:
        """Consumer: reserve blocks for the full prompt blocks this engine lacks (after its own prefix hit), as
        KVTransfer.add does. Returns the blocks to pull (0: all here already), or None when there is no room (the
        request prefills here instead)."""
        bs = self.kv.block_size
        num_full = (len(prompt_ids) - 1) // bs
        probe = Request(rid, prompt_ids, SamplingParams(max_tokens=1))
        computed, _ = self.kv.get_computed_blocks(probe)
        self.kv.req_hashes.pop(rid, None)
        have = min(len(computed), num_full)
        if have >= num_full:
            return 0
        stand_in = Request(f"{rid}#kv", prompt_ids[: num_full * bs], SamplingParams(max_tokens=1))
        if not self.kv.allocate_slots(stand_in, (num_full - have) * bs, computed[:have], register=False):
            return None
        return num_full - have

    def finish_pull(self, rid: str, prompt_ids: list[int]) -> None:
        """The pulled blocks are in: they join the prefix cache and the stand-in lets them go (the request then
        finds them as a prefix hit)."""
        bs = self.kv.block_size
        num_full = (len(prompt_ids) - 1) // bs
        stand_in = Request(f"{rid}#kv", prompt_ids[: num_full * bs], SamplingParams(max_tokens=1))
        self.kv.cache_blocks(stand_in)
        self.kv.release(stand_in.request_id)
