"""The KV connector interface: how an engine offers a finished prefill's blocks to others (producer) and pulls
another engine's blocks into its own paged cache (consumer). vLLM's KVConnectorBase_V1 splits this into a
scheduler half and a worker half; here the engine core and the cache live in one process, so one object does both,
and all bookkeeping of which blocks are held stays in the core's thread (engine/kv_transfer/transfer.py)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass
class PullJob:
    """Copy the producer's `remote_block_ids` (under its transfer `transfer_id`) into `local_block_ids`."""

    request_id: str
    host: str
    port: int
    transfer_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    cancelled: bool = False  # set by the core (an abort): the connector stops writing and reports


@dataclass
class PullResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class ConnectorStats:
    """Cumulative counts (the core adds its own: blocks held, fallbacks, leases expired)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    pulls: int = 0  # completed
    pull_seconds: float = 0.0
    pull_seconds_each: list[float] = field(default_factory=list)
    pulls_via: dict[str, int] = field(default_factory=dict)  # completed pulls by data path (inline, shm, p2p)


class KVConnector(abc.ABC):
    """Moves KV blocks between engines. Methods are called from the core's thread; an implementation does its
    I/O on threads of its own and must never write a block the core has not handed it in a PullJob, nor read a
    block after `withdraw` returned True for it."""

    stats: ConnectorStats

    @property
    @abc.abstractmethod
    def address(self) -> tuple[str, int] | None:
        """Where consumers pull from (producers only)."""

    def handshake(self) -> dict:
        """What the producer adds to kv_transfer_params and the consumer to its description (its data path), for
        config.transport_problem."""
        return {}

    # -- producer ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        """Make these blocks pullable under `transfer_id` (the core holds them meanwhile)."""

    @abc.abstractmethod
    def withdraw(self, transfer_id: str) -> bool:
        """Stop offering a transfer; False (and nothing changed) while a pull is reading its blocks right now."""

    @abc.abstractmethod
    def released(self) -> list[str]:
        """Transfers whose consumer said it has its copy since the last call (their blocks may be freed)."""

    # -- consumer ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def pull(self, job: PullJob) -> None:
        """Start a pull; its PullResult comes back from `finished_pulls`, whatever happens."""

    @abc.abstractmethod
    def finished_pulls(self) -> list[PullResult]: ...

    @abc.abstractmethod
    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds, or until a pull finishes."""

    @abc.abstractmethod
    def close(self) -> None: ...
