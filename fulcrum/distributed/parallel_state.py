"""Where this process sits among the ranks of one engine, and the collectives the layers call.

A single process is a world of one: every call below is then a no-op. Otherwise world rank 0 is the engine core
(the scheduler and the sampler), so it holds the last pipeline stage, whose hidden states become logits
(`stage_and_tp_rank`); `init_distributed` joins the world and makes the groups."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# a worker waits in the control broadcast for as long as the engine is idle: no timeout of its own
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ParallelState:
    rank: int = 0  # in the world
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    expert_parallel: bool = False  # experts split across the tensor-parallel ranks (whole experts, not slices)
    layer_partition: list[int] | None = None  # layers per pipeline stage (None: an even split)
    tp_group: object | None = None
    control_group: object | None = None  # gloo, every rank: the engine's step broadcast

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def world_rank(self, pp_rank: int, tp_rank: int) -> int:
        return (self.pp_size - 1 - pp_rank) * self.tp_size + tp_rank


_STATE = ParallelState()


def state() -> ParallelState:
    return _STATE


def stage_and_tp_rank(rank: int, tp: int, pp: int) -> tuple[int, int]:
    """The (pipeline stage, tensor-parallel rank) of world rank `rank`: rank r is tensor-parallel rank r % tp of stage
    (pp - 1) - r // tp, so that rank 0, the engine core, holds the last stage."""
    return pp - 1 - rank // tp, rank % tp


def init_distributed(
    rank: int,
    tp: int,
    pp: int,
    init_method: str,
    backend: str = "gloo",
    expert_parallel: bool = False,
    layer_partition: list[int] | None = None,
) -> ParallelState:
    """Join the world of tp * pp ranks at `init_method` (tcp://host:port; gloo on CPU, NCCL on CUDA) and make the
    groups: one tensor-parallel group per pipeline stage, and one gloo group over every rank for the engine's control
    messages (the step's inputs, broadcast from rank 0). Every rank calls it with the same sizes; group creation is
    collective, so all of them make every group in the same order."""
    global _STATE
    world = tp * pp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=CONTROL_TIMEOUT)
    stage, tp_rank_ = stage_and_tp_rank(rank, tp, pp)
    s = ParallelState(rank, world, tp_rank_, tp, stage, pp, expert_parallel, layer_partition)
    for p in range(pp):
        ranks = [s.world_rank(p, t) for t in range(tp)]
        group = dist.new_group(ranks, backend=backend) if tp > 1 else None
        if p == stage:
            s.tp_group = group
    s.control_group = dist.new_group(list(range(world)), backend="gloo", timeout=CONTROL_TIMEOUT)
    _STATE = s
    return s


def set_single_process() -> None:
    """Back to a world of one (a test that built a rank's model in this process puts things back)."""
    global _STATE
    _STATE = ParallelState()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_single_process()


def held(world_size: int = 1) -> bool:
    """Whether this process cannot host an engine of `world_size` ranks in place: another engine's ranks are joined
    here (the layers read this module's one state), or, for a parallel engine, torch.distributed's one default group
    is already initialized (by an engine, or by the caller)."""
    return _STATE.world_size > 1 or (world_size > 1 and dist.is_initialized())


def tp_rank() -> int:
    return _STATE.tp_rank


def tp_size() -> int:
    return _STATE.tp_size


def pp_rank() -> int:
    return _STATE.pp_rank


def pp_size() -> int:
    return _STATE.pp_size


def expert_parallel() -> bool:
    return _STATE.expert_parallel and _STATE.tp_size > 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size > 1:
        dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send_next(x: torch.Tensor):
    """Hand hidden states to the same tensor-parallel rank of the next stage; returns the pending work."""
    s = _STATE
    return dist.isend(x.contiguous(), s.world_rank(s.pp_rank + 1, s.tp_rank))


def pp_recv_prev(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    s = _STATE
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, s.world_rank(s.pp_rank - 1, s.tp_rank))
    return x


def broadcast_control(obj=None):
    """Rank 0 sends `obj` to every rank; every other rank gets it back (one broadcast of a pickled message)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_STATE.control_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (the KV blocks every rank can hold)."""
    if _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.control_group)
    return int(t.item())


def layer_range(num_layers: int) -> tuple[int, int]:
    """The layers [start, end) of this rank's pipeline stage."""
    sizes = stage_sizes(num_layers, _STATE.pp_size, _STATE.layer_partition)
    start = sum(sizes[: _STATE.pp_rank])
    return start, start + sizes[_STATE.pp_rank]


def stage_sizes(num_layers: int, pp: int, partition: list[int] | None = None) -> list[int]:
    """Layers per stage: `partition` when given (checked), else an even split whose remainder goes to the first
    stages (the last one also computes the logits)."""
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(
                f"pp_layer_partition {partition} must give each of the {pp} pipeline stages at least one layer and "
                f"add up to the model's {num_layers} layers"
            )
        return list(partition)
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    return [base + (i < extra) for i in range(pp)]
