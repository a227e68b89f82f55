"""KV transfer between engines for prefill/decode disaggregation: the connector interface, its connectors (ZeroMQ
over TCP, shared memory on one host, torch.distributed send/recv: NCCL on CUDA, gloo on CPU), the handshake
check, and the engine core's bookkeeping of leases and pulls."""

from fulcrum.engine.kv_transfer.config import KVTransferConfig, KVTransferError, check_remote_prefill
from fulcrum.engine.kv_transfer.transfer import KVTransfer

__all__ = ["KVTransfer", "KVTransferConfig", "KVTransferError", "check_remote_prefill"]
