"""Paged KV-cache bookkeeping: block tables, ref counts, copy-on-write and prefix caching.

Physical blocks live in one pool per layer (allocated by the model runner); this class only decides which block
ids each sequence owns. Free blocks sit in an LRU queue (OrderedDict: O(1) push, pop and removal). A freed block
keeps its prefix-cache entry until it is reallocated (lazy eviction), so a later request can still hit it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagekube.engine.core import block_hash as hashing
from pagekube.engine.core.sequence import Sequence
from pagekube.engine.kv_events import events as kv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit
    filled: int = 0  # slots written, while the block is in use (the fragmentation gauge's count)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self.cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write block copies for the runner
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens served from cache
        self.tokens_held = 0  # written slots over blocks in use, shared blocks once: kept as blocks change
        # Prefix-cache changes as vLLM's KV events (engine/kv_events/), when a publisher takes them: a block enters
        # when it is registered and leaves when it is evicted, so a subscriber's view equals `cached`.
        self.kv_events: list[kv.KVCacheEvent] | None = None

    def record_kv_events(self) -> None:
        """Start recording (the engine drains `kv_events` after each step); subscribers first learn the cache
        holds nothing, so a restarted engine's old blocks are forgotten."""
        self.kv_events = [kv.AllBlocksCleared()]

    def take_kv_events(self) -> list[kv.KVCacheEvent]:
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    # ---- capacity -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Blocks holding the longest cached prefix of `seq`, never including its last token."""
        if not self.enable_prefix_caching:
            return [], []
        ids, hashes, parent = [], [], None
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            h = hashing.block_hash(parent, chunk, seq.cache_extra_keys)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        stored = None  # this call's run of newly registered blocks: one BlockStored, as vLLM sends per request
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hashing.block_hash(parent, chunk, seq.cache_extra_keys)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                block.hash, block.token_ids = h, tuple(chunk)
                self.cached[h] = block.block_id
                if self.kv_events is not None:
                    stored = self._record_stored(stored, seq, parent, h, chunk)
            else:
                stored = None

    def _record_stored(self, stored: kv.BlockStored | None, seq: Sequence, parent: bytes | None, h: bytes,
                       chunk: list[int]) -> kv.BlockStored:
        if stored is None:
            lora = seq.request.lora
            stored = kv.BlockStored(block_hashes=[], parent_block_hash=None if parent is None else kv.external_hash(parent),
                                    token_ids=[], block_size=self.block_size, lora_id=None if lora is None else lora.id,
                                    medium=kv.MEDIUM, lora_name=None if lora is None else lora.name)
            self.kv_events.append(stored)
        stored.block_hashes.append(kv.external_hash(h))
        stored.token_ids.extend(chunk)
        return stored

    # ---- allocation ---------------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = (),
                       cached_hashes: list[bytes] = ()) -> bool:
        """Make room for the next `num_new_tokens` of `seq`, after adopting `cached_blocks` (a prefix hit from
        `find_cached_prefix`). Returns False, changing nothing, when blocks run out. The sequence's progress is not
        touched here: the scheduler counts adopted blocks as computed.

        Blocks about to be written that are shared with another sequence are copied first (copy-on-write).
        """
        bs = self.block_size
        fresh = seq.num_computed_tokens == 0 and not seq.block_table
        start = seq.num_computed_tokens + len(cached_blocks) * bs
        end_blocks = self.blocks_needed(start + num_new_tokens)
        new_blocks = max(0, end_blocks - len(seq.block_table) - len(cached_blocks))
        cow = [i for i in range(start // bs, min(len(seq.block_table), end_blocks))
               if self.blocks[seq.block_table[i]].ref_count > 1]
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if new_blocks + len(cow) + revived > self.num_free_blocks:
            return False
        if fresh:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached_blocks) * bs
        for b in cached_blocks:
            self._ref(b)
            self._fill(b, bs)
        seq.block_table.extend(cached_blocks)
        seq.block_hashes.extend(cached_hashes)
        for i in cow:
            old = seq.block_table[i]
            self.blocks[old].ref_count -= 1
            seq.block_table[i] = self._take_free_block()
            self.pending_copies.append((old, seq.block_table[i]))
            self._fill(seq.block_table[i], self.blocks[old].filled)
        for _ in range(new_blocks):
            seq.block_table.append(self._take_free_block())
        end = start + num_new_tokens
        for i in range(start // bs, self.blocks_needed(end)):
            self._fill(seq.block_table[i], min(bs, end - i * bs))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (n > 1 sampling): ref counts go up, nothing is copied yet. (The
        scheduler copies the parent's progress.)"""
        if not parent.block_table:  # its KV is gone (finished or preempted): the child would read others' blocks
            raise RuntimeError(f"fork from {parent} which holds no blocks")
        for b in parent.block_table:
            self.blocks[b].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        self._release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past the sequence's tokens: what rejected speculative tokens were given slots in.
        (Rejected slots inside a kept block are simply written over by the tokens that come next.)"""
        keep = self.blocks_needed(seq.num_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        last = self.blocks[seq.block_table[-1]] if keep else None
        if last is not None and last.ref_count == 1:  # rejected slots in its own last block hold nothing now
            tail = seq.num_tokens - (keep - 1) * self.block_size
            self.tokens_held -= max(0, last.filled - tail)
            last.filled = min(last.filled, tail)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fragmentation(self) -> float:
        """Allocated token slots / slots written, over blocks in use (shared blocks counted once). O(1): the
        counts are kept as blocks are filled and released, not recounted per step."""
        used = self.num_blocks - self.num_free_blocks
        return used * self.block_size / self.tokens_held if self.tokens_held else 1.0

    # ---- internals ----------------------------------------------------------------------------------------
    def _release(self, block_ids: list[int]) -> None:
        # Tail blocks first, so they are evicted before the shared prefix they extend.
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {b}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.tokens_held -= block.filled
                block.filled = 0
                self.free_queue[b] = None
                if block.hash is None:  # holds nothing reusable: hand it out before cached blocks
                    self.free_queue.move_to_end(b, last=False)

    def _fill(self, block_id: int, slots: int) -> None:
        block = self.blocks[block_id]
        if slots > block.filled:
            self.tokens_held += slots - block.filled
            block.filled = slots

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # lazy eviction of its prefix-cache entry
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.kv_events is not None:
                    self.kv_events.append(kv.BlockRemoved(block_hashes=[kv.external_hash(block.hash)], medium=kv.MEDIUM))
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id
