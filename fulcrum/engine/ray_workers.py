"""A parallel engine's workers as Ray actors: one per rank after rank 0, each in a bundle of one placement group
(one CPU each, or one GPU on CUDA), so that `ray start --head` on one machine and `ray start --address` on others
give the engine ranks on every machine. Rank 0, the engine core, is Ray's driver: the actors end with it."""

from __future__ import annotations

import os
import queue
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fulcrum.config import EngineConfig
from fulcrum.errors import ModelLoadError

STARTUP_TIMEOUT_S = 600


class RankActor:
    """A worker's life (engine/workers.py: run_worker) in one long call; its reports wait in a queue that rank 0
    reads through a second, concurrent call."""

    def __init__(self):
        self.reports: queue.Queue = queue.Queue()

    def ping(self) -> str:
        return ray.util.get_node_ip_address()

    def run(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from fulcrum.engine.workers import run_worker

        run_worker(config, rank, init_method, self.reports.put)

    def next_report(self, timeout: float):
        try:
            return self.reports.get(timeout=timeout)
        except queue.Empty:
            return None


class RayCluster:
    def __init__(self, config: EngineConfig, num_workers: int):
        """Connect to the cluster RAY_ADDRESS names (or start one on this machine) and place the actors."""
        self.config = config
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        cuda = str(config.device).startswith("cuda")
        self.pg = placement_group([{"GPU" if cuda else "CPU": 1}] * num_workers, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ModelLoadError(
                f"the Ray cluster has no room for {num_workers} workers of one {'GPU' if cuda else 'CPU'} each "
                f"(resources: {ray.cluster_resources()})"
            ) from None
        cls = ray.remote(RankActor)
        self.actors = [
            cls.options(
                num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(num_workers)
        ]  # fmt: skip
        ray.get([a.ping.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        self.driver_ip = ray.util.get_node_ip_address()
        self.loops: list = []

    def start(self, init_method: str) -> None:
        self.loops = [a.run.remote(self.config, r, init_method) for r, a in enumerate(self.actors, start=1)]

    def loaded_blocks(self) -> list[int]:
        """Each worker's KV block count, once its part of the model is loaded; a worker that fails raises."""
        counts = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, actor in enumerate(self.actors, start=1):
            while True:
                report = ray.get(actor.next_report.remote(0.5))
                if report is not None:
                    counts.append(report[1])
                    break
                for r, ref in enumerate(self.loops, start=1):
                    done, _ = ray.wait([ref], timeout=0)
                    if done:
                        try:
                            ray.get(ref)
                        except Exception as e:
                            raise ModelLoadError(f"worker {r} failed to start: {e}") from None
                        raise ModelLoadError(f"worker {r} ended during startup")
                if time.monotonic() > deadline:
                    raise ModelLoadError(f"worker {rank} did not start within {STARTUP_TIMEOUT_S} s")
        return counts

    def dead_ranks(self) -> list[int]:
        """Workers whose run ended (they only end when told to, or when they fail or their actor dies)."""
        if not self.loops:
            return []
        done, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        return [r for r, ref in enumerate(self.loops, start=1) if ref in done]

    def shutdown(self) -> None:
        deadline = time.monotonic() + 5
        for ref in self.loops:  # told to stop: each ends its loop; a stuck one is killed with its actor
            ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)
