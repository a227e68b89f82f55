"""KV transfer between engines for prefill/decode disaggregation: the connector interface, the CPU (ZeroMQ)
connector, the handshake check, and the engine core's bookkeeping of leases and pulls."""

from fulcrum.engine.kv_transfer.config import KVTransferConfig, KVTransferError, check_remote_prefill
from fulcrum.engine.kv_transfer.engine import KVTransfer

__all__ = ["KVTransfer", "KVTransferConfig", "KVTransferError", "check_remote_prefill"]
