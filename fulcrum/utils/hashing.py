"""The block hash of prefix caching: one function, shared by the KV cache manager and the router.

A block's hash chains its parent's hash with its own token ids, so equal hashes mean equal
prefixes up to and including that block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

NONE_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.intdigest()


def chain_seed(adapter: str | None) -> int:
    """The parent hash of a request's first block: NONE_HASH for the base model, the adapter's own for a LoRA
    request, so that two adapters (or an adapter and the base) never share a block for the same tokens."""
    return NONE_HASH if adapter is None else hash_block_tokens(NONE_HASH, [], b"lora:" + adapter.encode())


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
