"""KV cache manager: fixed-size blocks of one preallocated cache, with reference counts and prefix caching.

Full blocks are registered under a chained hash of their tokens. A freed block keeps its hash and
goes to the tail of an LRU free queue, so a later request with the same prefix can take it back
without recomputing; new allocations evict from the head (least recently freed) first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fulcrum.engine.request import Request
from fulcrum.utils.hashing import chain_seed, hash_block_tokens
from fulcrum.utils.kv_event_schema import BlockRemoved, BlockStored


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    stored: bool = False  # an offload tier holds its data (engine/kv_offload)


@dataclass
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, found cached

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None,
        events_medium: str | None = None,
    ):  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the widest window, when every layer has one
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block
        # a request's blocks by position; None where a block fell out of the window and was released
        self.req_blocks: dict[str, list[Block | None]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks, in order
        # positions of a request's blocks already registered (or found held, or released): each step registers only
        # the blocks that filled since, instead of walking the whole list again
        self.req_registered: dict[str, int] = {}
        self.queries = self.hits = 0
        # KV-cache events since the engine core last took them, kept when `events_medium` names where the cache lives
        self.events: list | None = [] if events_medium is not None else None
        self.medium = events_medium
        # with offload tiers (engine/kv_offload): registered blocks freed since the offload last copied them out,
        # block id -> hash; an evicted block stays listed (its data is intact until the next step writes it)
        self.unstored: dict[int, int] | None = None

    # -- lookups -------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def block_table(self, request_id: str) -> list[int]:
        """Block ids by position. A released block's entry repeats the first block still held: the attention
        never reads it (out of every layer's window), and it keeps finite data there, never another's fresh block."""
        blocks = self.req_blocks.get(request_id, [])
        live = next((b.block_id for b in blocks if b is not None), 0)
        return [live if b is None else b.block_id for b in blocks]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(b is not None for b in self.req_blocks.get(request_id, []))

    def _full_block_hashes(self, req: Request, num_tokens: int) -> list[int]:
        """Extend the request's chain of block hashes to cover the first `num_tokens` tokens."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        mm = getattr(req, "mm", None)
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else chain_seed(getattr(req, "lora_name", None))
            # a block where an image's tokens begin names the image (its hash), and the chain carries it on: two
            # images with the same placeholder tokens never share a block
            images = b"".join(h.encode() for start, h in mm.spans if i * bs <= start < (i + 1) * bs) if mm else b""
            tokens = req.all_token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block_tokens(parent, tokens, b"image:" + images if images else b""))
        return hashes

    def prompt_hashes(self, req: Request) -> list[int]:
        """The hashes of the full blocks a prefix lookup covers (all but the last token)."""
        return self._full_block_hashes(req, req.num_tokens - 1)

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of a request that has none yet: (blocks, number of tokens).
        The last token is always recomputed: its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.prompt_hashes(req)
        hit: list[Block] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt in the prefix-cache stats (the scheduler calls this once per request)."""
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[Block] | None = None, register: bool = True
    ) -> bool:
        """Make room for `num_new_tokens` more tokens (after `computed` cached blocks, for a new
        request). Returns False, changing nothing, when there are not enough free blocks.
        `register` False: the new full blocks stay out of the prefix cache until `cache_blocks` (blocks that a
        KV transfer fills later must not be found by a prefix hit before then)."""
        computed = computed or []
        held = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(held) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # cached blocks now in the free queue
        if needed > len(self.free_queue) - revived:
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        for b in computed:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1
            blocks.append(b)
        removed = []
        for _ in range(max(needed, 0)):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:  # evict the stale prefix entry
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    removed.append(b.block_hash)
                b.block_hash, b.stored = None, False
            b.ref_cnt = 1
            blocks.append(b)
        if removed and self.events is not None:
            self.events.append(BlockRemoved(removed, self.medium))
        if self.enable_prefix_caching and register:
            self._cache_full_blocks(req, blocks, total)
        return True

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register a request's full blocks (those of its first `num_tokens` tokens) in the prefix cache now (after
        `allocate_slots(register=False)`)."""
        if self.enable_prefix_caching:
            n = req.num_tokens if num_tokens is None else num_tokens
            self._cache_full_blocks(req, self.req_blocks.get(req.request_id, []), n)

    def hand_over(self, request_id: str, holder_id: str, num_blocks: int) -> list[int]:
        """Move a request's first `num_blocks` blocks to `holder_id` (a KV transfer's lease, freed later with
        `release`) and free the rest; returns the ids handed over (none when one of them was already released)."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_hashes.pop(request_id, None)
        self.req_registered.pop(request_id, None)
        keep = blocks[:num_blocks]
        if len(keep) < num_blocks or any(b is None for b in keep):
            keep = []
        self.req_blocks[holder_id] = keep
        self._drop(blocks[len(keep) :])
        return [b.block_id for b in keep]

    def release_out_of_window(self, req: Request) -> None:
        """Free the blocks wholly before the window of the request's next token (position num_computed_tokens
        sees positions above num_computed_tokens - window), when every attention layer has a sliding window: a long
        conversation then holds about a window of blocks. They keep their hash: a prefix hit can still take them
        back while they wait in the free queue."""
        if self.sliding_window is None:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        first_seen = req.num_computed_tokens - self.sliding_window + 1
        for i in range(min(max(first_seen, 0) // self.block_size, len(blocks))):
            b = blocks[i]
            if b is not None:
                blocks[i] = None
                b.ref_cnt -= 1
                if b.ref_cnt == 0:
                    self._freed(b)

    def _cache_full_blocks(self, req: Request, blocks: list[Block | None], num_tokens: int) -> None:
        """Register the blocks that `num_tokens` known tokens fill completely."""
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.req_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._full_block_hashes(req, num_full * self.block_size)
        stored = []  # positions newly registered (a block whose hash another block holds is not)
        self.req_registered[req.request_id] = num_full
        for i in range(start, num_full):
            b = blocks[i]
            if b is not None and b.block_hash is None:
                b.block_hash = hashes[i]
                if self.cached.setdefault(hashes[i], b) is b:
                    stored.append(i)
        if stored and self.events is not None:
            self._record_stored(req, hashes, stored)

    def _record_stored(self, req: Request, hashes: list[int], positions: list[int]) -> None:
        """One BlockStored per run of consecutive positions, each with its parent's hash and its tokens."""
        bs, start = self.block_size, 0
        for k in range(1, len(positions) + 1):
            if k < len(positions) and positions[k] == positions[k - 1] + 1:
                continue
            first, last = positions[start], positions[k - 1]
            self.events.append(
                BlockStored(
                    hashes[first : last + 1],
                    hashes[first - 1] if first else None,
                    list(req.all_token_ids[first * bs : (last + 1) * bs]),
                    bs,
                    None,
                    self.medium,
                    getattr(req, "lora_name", None),  # vLLM's: a LoRA request's blocks name their adapter
                )
            )
            start = k

    def take_events(self) -> list:
        """The events recorded since the last call (empty when none are kept). With `events` set to a list the
        manager records what its prefix cache gains and loses (engine/kv_event_publisher.py): a block registered under its
        hash (BlockStored), a cached block evicted for reuse (BlockRemoved)."""
        events, self.events = self.events or [], [] if self.events is not None else None
        return events

    def free(self, req: Request) -> None:
        self.release(req.request_id)

    def release(self, request_id: str) -> None:
        """Release the blocks held under an id (a request's, or a lease's). Tail blocks go to the free queue
        first so that they are evicted before the shared prefix blocks."""
        self._drop(self.req_blocks.pop(request_id, []))
        self.req_hashes.pop(request_id, None)
        self.req_registered.pop(request_id, None)

    def _drop(self, blocks: list[Block | None]) -> None:
        for b in reversed(blocks):
            if b is None:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._freed(b)

    def _freed(self, b: Block) -> None:
        self.free_queue[b.block_id] = b
        if self.unstored is not None and b.block_hash is not None and not b.stored:
            self.unstored[b.block_id] = b.block_hash

    def take_unstored(self) -> dict[int, int]:
        """The registered blocks freed since the last call that no offload tier holds yet (block id -> hash)."""
        out, self.unstored = self.unstored or {}, {} if self.unstored is not None else None
        return out

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_blocks - len(self.free_queue), self.queries, self.hits)
