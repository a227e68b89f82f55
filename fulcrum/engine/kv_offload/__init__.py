"""Offload tiers below the KV pool: host memory and disk (engine/kv_offload/offload.py, tiers.py)."""

from fulcrum.engine.kv_offload.offload import KVOffload

__all__ = ["KVOffload"]
