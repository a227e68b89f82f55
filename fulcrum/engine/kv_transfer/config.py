"""What a prefill/decode pair agrees on: the engine's KV transfer settings (vLLM's --kv-transfer-config, spelled
as vLLM spells it) and the handshake check that refuses a pair whose caches differ in shape or meaning."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field

from fulcrum.errors import InvalidRequestError
from fulcrum.utils.hashing import hash_prefix_blocks

# vLLM's role names, and the short ones of `--kv-role`
ROLES = {"kv_producer": "kv_producer", "kv_consumer": "kv_consumer", "kv_both": "kv_both",
         "producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}  # fmt: skip
# each connector's names (ours, and the spelling a vLLM user reaches for first) and the data path it names:
# zmq (TCP frames), shm (/dev/shm segments, one host), torch.distributed (send/recv: NCCL on CUDA, gloo on CPU)
CONNECTORS = {"ZmqConnector": "zmq", "CpuConnector": "zmq", "fulcrum": "zmq",
              "SharedMemoryConnector": "shm", "ShmConnector": "shm",
              "TorchDistributedConnector": "torch.distributed", "P2pNcclConnector": "torch.distributed"}  # fmt: skip
EXTRA_KEYS = ("lease_timeout_s", "pull_timeout_s", "max_held_fraction", "secret", "allowed_producers")
# the secret a producer signs its kv_transfer_params with and a consumer checks them by, when the config gives none
SECRET_ENV = "FULCRUM_KV_TRANSFER_SECRET"
# what a producer's signature covers: everything a consumer acts on (where it connects, what it pulls)
SIGNED_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
                 "block_hashes", "num_prompt_tokens")  # fmt: skip
# the fields of kv_transfer_params that describe the producer's cache, checked against the consumer's own
LAYOUT_FIELDS = ("block_size", "kv_dtype", "model", "kv_layout")


class KVTransferError(InvalidRequestError):
    """A kv_transfer_params handshake the decode engine refuses (the pair's caches differ): HTTP 400."""


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer listens for pulls (and what it tells consumers)
    kv_port: int = 0  # 0: a free port, chosen at start
    # how long a producer keeps a finished prefill's blocks for a consumer that has not pulled them
    lease_timeout_s: float = 30.0
    # how long a consumer waits for a pull before it prefills locally instead
    pull_timeout_s: float = 10.0
    # the most of a producer's cache that leases may hold: past it the oldest lease ends early, so that prefills
    # nobody pulls (a consumer gone, a client that never decodes) cannot starve the producer's own requests
    max_held_fraction: float = 0.5
    # Which producers a consumer contacts (a client could otherwise point it at any host and port): those whose
    # kv_transfer_params carry an HMAC by the secret both engines share (FULCRUM_KV_TRANSFER_SECRET by default),
    # or those listed as "host:port"
    secret: str | None = None
    allowed_producers: list[str] = field(default_factory=list)
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def transport(self) -> str:
        return CONNECTORS[self.kv_connector]

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: dict | str | None, role: str | None = None) -> KVTransferConfig | None:
        """--kv-transfer-config's JSON (or dict) and/or --kv-role; None when neither is given."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"kv_transfer_config is not valid JSON: {e}", "kv_transfer_config") from None
        if value is None and role is None:
            return None
        d = dict(value or {})
        if not isinstance(value, dict | None):
            raise InvalidRequestError("kv_transfer_config must be a JSON object", "kv_transfer_config")
        if role is not None:
            d.setdefault("kv_role", role)
            if ROLES.get(d["kv_role"]) != ROLES.get(role):
                raise InvalidRequestError(
                    f"--kv-role {role} contradicts kv_transfer_config's {d['kv_role']}", "kv_role"
                )
        extra = d.pop("kv_connector_extra_config", None) or {}
        unknown = [k for k in d if k not in cls.__dataclass_fields__] + [k for k in extra if k not in EXTRA_KEYS]
        if unknown:
            raise InvalidRequestError(
                f"kv_transfer_config: unknown field(s) {', '.join(unknown)}", "kv_transfer_config"
            )
        for k in EXTRA_KEYS:  # vLLM puts connector-specific settings here; they may as well be top-level
            if k in extra:
                d.setdefault(k, extra[k])
        cfg = cls(**d, kv_connector_extra_config=extra)
        if cfg.kv_role not in ROLES:
            raise InvalidRequestError(f"kv_role must be one of {', '.join(ROLES)}, got {cfg.kv_role!r}", "kv_role")
        cfg.kv_role = ROLES[cfg.kv_role]
        if cfg.kv_connector not in CONNECTORS:
            raise InvalidRequestError(
                f"kv_connector {cfg.kv_connector!r} is not available (this build has {', '.join(CONNECTORS)})",
                "kv_transfer_config",
            )
        if not (isinstance(cfg.kv_port, int) and 0 <= cfg.kv_port < 65536):
            raise InvalidRequestError(f"kv_port must be a port number, got {cfg.kv_port!r}", "kv_transfer_config")
        for name in ("lease_timeout_s", "pull_timeout_s"):
            if not (isinstance(getattr(cfg, name), int | float) and getattr(cfg, name) > 0):
                raise InvalidRequestError(f"{name} must be a positive number of seconds", "kv_transfer_config")
        if not (isinstance(cfg.max_held_fraction, int | float) and 0 < cfg.max_held_fraction <= 1):
            raise InvalidRequestError("max_held_fraction must be in (0, 1]", "kv_transfer_config")
        cfg.secret = cfg.secret or os.environ.get(SECRET_ENV) or None
        if cfg.secret is not None and not isinstance(cfg.secret, str):
            raise InvalidRequestError("secret must be a string", "kv_transfer_config")
        if not (isinstance(cfg.allowed_producers, list) and all(_is_address(a) for a in cfg.allowed_producers)):
            raise InvalidRequestError('allowed_producers must be a list of "host:port"', "kv_transfer_config")
        return cfg

    def sign(self, params: dict) -> str:
        return hmac.new(self.secret.encode(), _signed_text(params), hashlib.sha256).hexdigest()

    def distrust(self, params: dict) -> str | None:
        """Why a consumer must not contact the producer these kv_transfer_params name; None when it may."""
        address = f"{params.get('remote_host')}:{params.get('remote_port')}"
        if address in self.allowed_producers:
            return None
        if self.secret:
            signature = params.get("signature")
            if isinstance(signature, str) and hmac.compare_digest(signature, self.sign(params)):
                return None
            return (
                "kv_transfer_params are not signed by a producer this engine trusts (the prefill engine signs them "
                "with the secret both engines share: kv_connector_extra_config.secret or " + SECRET_ENV + ")"
            )
        return (
            f"this engine contacts only producers it trusts, and {address} is not one: give both engines the same "
            f"kv_connector_extra_config.secret (or {SECRET_ENV}), or list the producer in allowed_producers"
        )


def _signed_text(params: dict) -> bytes:
    return json.dumps({k: params.get(k) for k in SIGNED_FIELDS}, sort_keys=True, separators=(",", ":")).encode()


def _is_address(value) -> bool:
    host, _, port = str(value).rpartition(":")
    return isinstance(value, str) and bool(host) and port.isdigit()


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """The chained hashes of the full blocks a transfer covers (all but the last token), as hex for JSON."""
    return [f"{h:016x}" for h in hash_prefix_blocks(token_ids[: len(token_ids) - 1], block_size)]


def layout_differences(local: dict, remote: dict) -> list[str]:
    """What differs between this engine's cache description and the one a producer sent in kv_transfer_params,
    one phrase per field, so that the refusal names each."""
    out = []
    for name in LAYOUT_FIELDS:
        mine, theirs = local.get(name), remote.get(name)
        if mine != theirs:
            out.append(f"{name} (prefill engine: {json.dumps(theirs)}, this engine: {json.dumps(mine)})")
    return out


def transport_problem(local: dict, params: dict) -> str | None:
    """Why this consumer cannot pull what the producer offers, or None. Every producer answers ZMQ pulls (the
    inline frames), so a ZmqConnector consumer takes any; the others need their own kind on the other side, and
    shared memory the same host. Refused, not quietly moved over TCP: SharedMemoryConnector says the pair shares
    a host, and a pair that does not is a deployment mistake a fallback would hide in the throughput."""
    mine, theirs = local.get("kv_transport", "zmq"), params.get("kv_transport", "zmq")
    if mine == "zmq":
        return None
    if theirs != mine:
        return (f"this engine pulls KV over {mine}, the prefill engine offers {theirs}: start both with the same "
                "kv_connector, or this one with ZmqConnector (it pulls from any)")  # fmt: skip
    if mine == "shm" and params.get("host_id") != local.get("host_id"):
        return (f"SharedMemoryConnector needs the prefill engine on this host (its host {params.get('host_id')!r}, "
                f"this one {local.get('host_id')!r}); between hosts use ZmqConnector")  # fmt: skip
    return None


def check_remote_prefill(
    params: dict, local: dict | None, prompt_ids: list[int], trust: KVTransferConfig | None = None
) -> None:
    """The consumer's half of the handshake, run in the frontend so that a refusal is a 400 before anything is
    queued. `local`: this engine's cache description (None when it was not started as a KV consumer); `trust`: its
    config, which says which producers it may contact."""
    if local is None or local.get("role") == "kv_producer" or trust is None:
        raise KVTransferError(
            "kv_transfer_params asks for a remote prefill, but this engine takes no KV "
            "(start it with --kv-role consumer or both)",
            "kv_transfer_params",
        )
    missing = [k for k in ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "block_hashes",
                           *LAYOUT_FIELDS)
               if k not in params]  # fmt: skip
    if missing:
        raise KVTransferError(f"kv_transfer_params lacks {', '.join(missing)}", "kv_transfer_params")
    types = {"remote_host": str, "remote_port": int, "remote_request_id": str, "remote_block_ids": list}

    def ok(k, t):
        v = params[k]
        if k == "remote_block_ids":
            return isinstance(v, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in v)
        return isinstance(v, t) and not isinstance(v, bool)

    wrong = [k for k, t in types.items() if not ok(k, t)]
    if wrong:
        raise KVTransferError(f"kv_transfer_params: {', '.join(wrong)} has the wrong type", "kv_transfer_params")
    why = trust.distrust(params)
    if why is not None:
        raise KVTransferError(why, "kv_transfer_params")
    diffs = layout_differences(local, params)
    if diffs:
        raise KVTransferError(
            "the prefill engine's KV cache does not match this engine's, refused: " + "; ".join(diffs),
            "kv_transfer_params",
        )
    n = params.get("num_prompt_tokens")
    if n is not None and n != len(prompt_ids):
        raise KVTransferError(
            f"kv_transfer_params is for a prompt of {n} tokens, this request's has {len(prompt_ids)}",
            "kv_transfer_params",
        )
    problem = transport_problem(local, params)
    if problem:
        raise KVTransferError(problem, "kv_transfer_params")
    theirs, mine = params.get("block_hashes"), block_hashes(prompt_ids, local["block_size"])
    if theirs != mine[: len(theirs) if isinstance(theirs, list) else None]:
        first = (
            next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), None)
            if isinstance(theirs, list)
            else None
        )
        where = f" (block {first} differs)" if first is not None else ""
        raise KVTransferError(
            f"kv_transfer_params were made for another prompt{where}: its blocks would be cached as this one's",
            "kv_transfer_params",
        )
