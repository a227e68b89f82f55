"""The KV-cache event schema and wire format, as vLLM publishes them (vllm/distributed/kv_events.py, checked
against vLLM 0.32's own decoder): the engine encodes these, the router decodes them, and a consumer of vLLM's
events reads ours. Each ZeroMQ message is [topic, 8-byte big-endian sequence number, payload], the payload an
EventBatch in msgpack; `decoder` reads older vLLM's encoding too, so the router fronts old and new vLLM alike.
A block hash is the publisher's own: an int for fulcrum (xxh3) and for vLLM by default (the low 64 bits of its
sha256), or vLLM's 32-byte sha256 digest with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; fields a newer publisher adds
are skipped when decoding.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

BlockHash: TypeAlias = int | bytes  # the publisher's hash, compared only with the same publisher's

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's last frame: this sequence, an empty payload


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An array [ts, events, data_parallel_rank?]."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A map tagged with the class name under "type" ({"type": "BlockStored", ...}), fields at their defaults left
    out."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]  # consecutive blocks of one request, in order
    parent_block_hash: BlockHash | None  # the block before the first one; None at the start of a prompt
    token_ids: list[int]  # the tokens of all those blocks
    block_size: int
    lora_id: int | None
    medium: str | None  # "GPU" as vLLM names its device cache; "CPU" for a CPU engine's
    lora_name: str | None  # set for an adapter's blocks, whose hashes are seeded with its name
    # optional fields of newer vLLM, left out when unset: per block, what else its hash covers (LoRA name,
    # multimodal hashes, cache salt) or None; the KV-cache group
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class _KeyedBatch(msgspec.Struct, gc=False):
    """A batch as a map ({"ts": ..., "events": [...]}): vLLM's newer source declares its batch without array_like."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _Legacy(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Older vLLM's events (and its example subscriber's): arrays in field order, the tag first
    (["BlockStored", hashes, ...]); trailing fields it lacked are optional here."""


class _LegacyBlockStored(_Legacy, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _LegacyBlockRemoved(_Legacy, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(_Legacy, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(EventBatch):
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]


def _modern(ev):
    if isinstance(ev, _LegacyBlockStored):
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium,
                           None)  # fmt: skip
    if isinstance(ev, _LegacyBlockRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium)
    return AllBlocksCleared()


class decoder:  # noqa: N801 (used like msgspec's Decoder)
    """Payload -> KVEventBatch, from today's encoding, a batch encoded as a map, or older vLLM's."""

    def __init__(self):
        self._new = msgspec.msgpack.Decoder(KVEventBatch)
        self._keyed = msgspec.msgpack.Decoder(_KeyedBatch)
        self._old = msgspec.msgpack.Decoder(_LegacyBatch)

    def decode(self, payload: bytes) -> KVEventBatch:
        try:
            return self._new.decode(payload)
        except msgspec.ValidationError:
            pass
        try:
            b = self._keyed.decode(payload)
            return KVEventBatch(b.ts, b.events, b.data_parallel_rank)
        except msgspec.ValidationError:
            old = self._old.decode(payload)  # raises when it is none of them
            return KVEventBatch(old.ts, [_modern(e) for e in old.events], old.data_parallel_rank)
