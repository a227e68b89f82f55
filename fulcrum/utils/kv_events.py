"""The KV-cache event schema and wire format, as vLLM publishes them (vllm/distributed/kv_events.py): the engine
encodes these, the router decodes them, and a consumer of vLLM's events reads ours.

Each ZeroMQ message is [topic, 8-byte big-endian sequence number, payload]; the payload is an EventBatch in msgpack,
its structs encoded as arrays in field order (so field order is the format) and events tagged by class name.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's last frame: this sequence, an empty payload


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged with the class name: the first element of each encoded event says which it is."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # consecutive blocks of one request, in order
    parent_block_hash: int | None  # the block before the first one; None at the start of a prompt
    token_ids: list[int]  # the tokens of all those blocks
    block_size: int
    lora_id: int | None
    medium: str | None  # "GPU" as vLLM names its device cache; "CPU" for a CPU engine's
    lora_name: str | None
    # newer vLLM fields, trailing and optional: older decoders ignore them, newer ones find them
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KVEventBatch)
