"""The engine core's side of P/D disaggregation (`KVTransfer`): which blocks are held for whom, in the core's thread.

A producer leases a finished request's prompt blocks to consumers instead of freeing them (`on_finish`). A consumer's
request waits here while the prompt blocks it lacks are pulled, then reaches the scheduler as a prefix-cache hit; a
pull that fails or times out leaves it to prefill locally, so no request is lost (`add`, `poll`)."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.kv_layout import cache_layout, model_fingerprint
from fulcrum.engine.kv_transfer.base import KVConnector, PullJob
from fulcrum.engine.kv_transfer.config import KVTransferConfig, block_hashes
from fulcrum.engine.kv_transfer.p2p_connector import TorchDistConnector
from fulcrum.engine.kv_transfer.shm_connector import SharedMemoryConnector
from fulcrum.engine.kv_transfer.zmq_connector import ZmqConnector
from fulcrum.engine.request import Request, RequestStatus
from fulcrum.errors import InvalidRequestError

log = logging.getLogger(__name__)


# config.CONNECTORS' data paths
CONNECTOR_CLASSES = {"zmq": ZmqConnector, "shm": SharedMemoryConnector, "torch.distributed": TorchDistConnector}


@dataclass
class Lease:
    holder: str  # the id the blocks are held under in the KV cache manager
    block_ids: list[int]
    expires: float  # monotonic


@dataclass
class Pending:
    req: Request
    stand_in: Request
    job: PullJob


class KVTransfer:
    def __init__(self, cfg: KVTransferConfig, kv: KVCacheManager, runner, model_path: Path):
        if cfg.consumes and not kv.enable_prefix_caching:
            raise InvalidRequestError(
                "a KV consumer needs prefix caching (pulled blocks reach the request as a prefix hit)", "kv_role"
            )
        if kv.sliding_window is not None:
            raise InvalidRequestError("KV transfer does not support sliding-window models yet", "kv_role")
        self.cfg, self.kv = cfg, kv
        caches, kv_layout = cache_layout(runner)
        self.connector: KVConnector = CONNECTOR_CLASSES[cfg.transport](
            caches, cfg.produces, cfg.consumes, cfg.kv_ip, cfg.kv_port, cfg.pull_timeout_s
        )
        self.engine_id = secrets.token_hex(6)
        # what the handshake compares (config.LAYOUT_FIELDS)
        self.layout = {
            "block_size": kv.block_size,
            "kv_dtype": runner.kv_cache_dtype_name,
            "model": model_fingerprint(model_path),
            "kv_layout": kv_layout,
        }
        self.leases: dict[str, Lease] = {}
        self.pending: dict[str, Pending] = {}
        self.holds: dict[str, Request] = {}  # pulled, waiting in the scheduler: request id -> its stand-in
        self.fallbacks = self.leases_expired = self.local_hits = 0
        # (request, first block) -> how many blocks from there the offload tiers hold (engine/kv_offload), if any
        self.local_tiers = None

    def describe(self) -> dict:
        """For the frontend's handshake check (messages.CoreReady.kv_transfer)."""
        return {"role": self.cfg.kv_role, **self.layout, **self.connector.handshake()}

    # -- producer ---------------------------------------------------------------------------------

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        """The scheduler's hook, before the request's blocks are freed. A producer's request
        (`kv_transfer_params: {"do_remote_decode": true}`) that finished hands the full blocks of its prompt to a lease
        instead, offered to consumers, and its output carries the kv_transfer_params a consumer needs. The lease ends
        when the consumer releases it or after lease_timeout_s."""
        params = req.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.cfg.produces:
            return
        req.kv_transfer_params = None
        if status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return  # aborted or failed: nothing to offer, the blocks are freed as usual
        n = req.num_prompt_tokens
        num_full = (n - 1) // self.kv.block_size  # what a consumer's prefix lookup covers
        transfer_id = f"{self.engine_id}-{req.request_id}"
        holder = f"{req.request_id}#lease"
        block_ids = self.kv.hand_over(req.request_id, holder, num_full)
        self.leases[transfer_id] = Lease(holder, block_ids, time.monotonic() + self.cfg.lease_timeout_s)
        self.connector.offer(transfer_id, block_ids)
        self._trim(keep=transfer_id)
        host, port = self.connector.address
        req.kv_transfer_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": transfer_id,
            "remote_block_ids": block_ids,
            "num_prompt_tokens": n,
            # what the blocks hold: a consumer refuses them for any other prompt (it would cache them as its own)
            "block_hashes": block_hashes(req.prompt_token_ids, self.kv.block_size)[: len(block_ids)],
            **self.layout,
            **self.connector.handshake(),
        }
        if self.cfg.secret:  # a consumer sharing the secret contacts this producer only on its word
            req.kv_transfer_params["signature"] = self.cfg.sign(req.kv_transfer_params)

    def _trim(self, keep: str) -> None:
        """End the oldest leases (not one being read) while they hold more than max_held_fraction of the cache."""
        cap = self.cfg.max_held_fraction * self.kv.num_blocks
        for tid in list(self.leases):  # oldest first
            if sum(len(x.block_ids) for x in self.leases.values()) <= cap:
                return
            if tid != keep and self._end_lease(tid):
                self.leases_expired += 1
                log.warning("KV lease %s ended early: leases held over %.0f%% of the cache", tid,
                            100 * self.cfg.max_held_fraction)  # fmt: skip

    def _end_lease(self, transfer_id: str) -> bool:
        lease = self.leases.get(transfer_id)
        if lease is None or not self.connector.withdraw(transfer_id):
            return False
        del self.leases[transfer_id]
        self.kv.release(lease.holder)
        return True

    # -- consumer ---------------------------------------------------------------------------------

    def add(self, req: Request) -> bool:
        """Take a request that asks for a remote prefill: True when a pull started (it waits here); False when
        it goes to the scheduler at once (nothing to pull, or no room: it prefills locally). The full prompt blocks it
        lacks (after its own prefix-cache hit) are pulled into blocks reserved under a stand-in id; once in, they join
        the prefix cache and the scheduler finds them as a prefix hit, computing only the tail (less than a block, and
        the last token, whose logits give the first output token: the prefill engine's first token is not reused, so
        the response holds it once). A pull that fails or times out frees the reserved blocks (`poll`)."""
        params = req.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.cfg.consumes:
            return False
        req.kv_transfer_params = None  # consumed; the response carries none
        why = self.cfg.distrust(params)
        if why is not None:  # the frontend refused these already; an offline caller's go no further either
            log.warning("request %s: %s; prefilling locally", req.request_id, why)
            self.fallbacks += 1
            return False
        bs = self.kv.block_size
        num_full = (req.num_tokens - 1) // bs
        try:  # the frontend checked the fields' types; a bad value still only costs this request its transfer
            job = PullJob(req.request_id, str(params["remote_host"]), int(params["remote_port"]),
                          str(params["remote_request_id"]), [int(b) for b in params["remote_block_ids"]], [])  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            log.warning("request %s: unusable kv_transfer_params (%s); prefilling locally", req.request_id, e)
            self.fallbacks += 1
            return False
        remote = job.remote_block_ids
        mine = block_hashes(req.prompt_token_ids, bs)[:num_full]
        if len(remote) != num_full or params.get("block_hashes") != mine:
            log.warning("request %s: the producer offers %d blocks for %d here; prefilling locally",
                        req.request_id, len(remote), num_full)  # fmt: skip
            self.fallbacks += 1
            self._release_remote(job)
            return False
        computed, _ = self.kv.get_computed_blocks(req)
        have = len(computed)
        below = self.local_tiers(req, have) if self.local_tiers is not None else 0
        if have + below >= num_full:  # all here already (the tiers load the rest): the producer may free its copy now
            self.local_hits += 1
            self._release_remote(job)
            return False
        stand_in = Request(f"{req.request_id}#kv", req.prompt_token_ids[: num_full * bs], req.sampling_params)
        if not self.kv.allocate_slots(stand_in, (num_full - have) * bs, computed, register=False):
            self.fallbacks += 1
            self._release_remote(job)
            return False
        job.remote_block_ids = remote[have:]
        job.local_block_ids = self.kv.block_table(stand_in.request_id)[have:num_full]
        self.pending[req.request_id] = Pending(req, stand_in, job)
        self.connector.pull(job)
        return True

    def _release_remote(self, job: PullJob) -> None:
        """A pull of no blocks: the producer answers at once and gets the release (its answer is dropped)."""
        self.connector.pull(PullJob(f"{job.request_id}#release", job.host, job.port, job.transfer_id, [], []))

    def abort(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests still waiting for their blocks; the blocks are freed when the pull reports."""
        done = []
        for rid in request_ids:
            p = self.pending.get(rid)
            if p is not None and not p.job.cancelled:
                p.job.cancelled = True
                p.req.status = status
                done.append(p.req)
        return done

    # -- each step --------------------------------------------------------------------------------

    def poll(self) -> list[Request]:
        """Pulls that ended (their requests, for the scheduler), leases released or expired."""
        ready = []
        for r in self.connector.finished_pulls():
            p = self.pending.pop(r.request_id, None)
            if p is None:
                continue  # a release-only pull
            if p.job.cancelled:
                self.kv.free(p.stand_in)
                self.kv.release(p.req.request_id)  # the hashes its prefix lookup left
                continue
            if r.ok:
                self.kv.cache_blocks(p.stand_in)
                self.holds[r.request_id] = p.stand_in
            else:
                log.warning("request %s: the KV pull failed (%s); prefilling locally", r.request_id, r.error)
                self.kv.free(p.stand_in)
                self.fallbacks += 1
            ready.append(p.req)
        for tid in self.connector.released():
            self._end_lease(tid)
        now = time.monotonic()
        for tid in [t for t, lease in self.leases.items() if lease.expires <= now]:
            if self._end_lease(tid):
                self.leases_expired += 1
                log.warning("KV lease %s expired before a consumer pulled it; its blocks are freed", tid)
        return ready

    def after_schedule(self, requests: dict[str, Request]) -> None:
        """Drop the stand-ins of pulled requests the scheduler admitted (they hold the blocks themselves now)
        or that ended."""
        for rid in list(self.holds):
            req = requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING:
                self.kv.free(self.holds.pop(rid))

    def busy(self) -> bool:
        return bool(self.pending)

    def requests(self) -> list[Request]:
        """The requests waiting for their pull."""
        return [p.req for p in self.pending.values()]

    def wait(self, timeout: float) -> None:
        self.connector.wait(timeout)

    def stats(self) -> dict:
        s = self.connector.stats
        return dict(
            kv_transfer_bytes_sent=s.bytes_sent,
            kv_transfer_bytes_received=s.bytes_received,
            kv_transfer_blocks_received=s.blocks_received,
            kv_transfer_pulls=s.pulls,
            kv_transfer_inline_pulls=s.pulls_via.get("inline", 0),
            kv_transfer_seconds=s.pull_seconds,
            kv_transfer_fallbacks=self.fallbacks,
            kv_transfer_leases_expired=self.leases_expired,
            kv_transfer_held_blocks=sum(len(x.block_ids) for x in self.leases.values()),
            kv_transfer_pending=len(self.pending),
        )

    def close(self) -> None:
        self.connector.close()
