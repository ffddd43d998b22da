"""Block manager: on-demand allocation, ref counts, copy-on-write, prefix caching, LRU eviction, no leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagekube.engine.core import block_hash as hashing
from pagekube.engine.core.block_manager import BlockManager
from pagekube.engine.core.sequence import Request, Sequence
from pagekube.engine.kv_events import events as kv
from pagekube.engine.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], n: int = 1) -> Sequence:
    return Request("r", None, tokens, SamplingParams(n=n, max_tokens=8), 8).seqs[0]


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does for a waiting sequence: adopt its cached prefix, then allocate the rest."""
    cached, hashes = bm.find_cached_prefix(seq)
    if not bm.allocate_slots(seq, seq.num_tokens - len(cached) * bm.block_size, cached, hashes):
        return False
    seq.num_computed_tokens += len(cached) * bm.block_size
    seq.num_cached_tokens = len(cached) * bm.block_size
    return True


def fork(bm: BlockManager, parent: Sequence, child: Sequence) -> None:
    """What the scheduler does for n > 1: the child shares the parent's blocks and progress."""
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens


def compute(bm: BlockManager, seq: Sequence) -> None:
    """What a step does: the scheduled tokens are now computed, and full blocks get cached."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_blocks_are_allocated_on_demand_and_freed():
    bm = BlockManager(10, BS)
    seq = make_seq(list(range(6)))
    assert admit(bm, seq) and len(seq.block_table) == 2
    compute(bm, seq)
    for tok in range(6, 9):  # decode: a new block only when the last one is full
        seq.token_ids.append(tok)
        assert bm.allocate_slots(seq, 1)
        compute(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(12)))
    assert not admit(bm, seq)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(10, BS)
    parent = make_seq(list(range(6)), n=2)
    child = parent.request.seqs[1]
    admit(bm, parent)
    compute(bm, parent)
    fork(bm, parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    shared_last = parent.block_table[1]  # half full: both will write into it
    for seq, tok in ((parent, 100), (child, 200)):
        seq.token_ids.append(tok)
        assert bm.allocate_slots(seq, 1)
    copies = bm.take_pending_copies()
    assert copies == [(shared_last, parent.block_table[1])]  # the first writer copied; the second owns the original
    assert child.block_table[1] == shared_last and bm.blocks[shared_last].ref_count == 1
    assert parent.block_table[0] == child.block_table[0] and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 10


def test_prefix_cache_hits_across_requests_and_never_serves_the_last_prompt_token():
    bm = BlockManager(10, BS)
    first = make_seq(list(range(8)))
    admit(bm, first)
    compute(bm, first)
    bm.free(first)  # blocks stay cached after free
    same = make_seq(list(range(8)))  # 8 tokens = 2 full blocks, but the last token must be computed
    cached, _ = bm.find_cached_prefix(same)
    assert len(cached) == 1
    longer = make_seq(list(range(8)) + [50, 51])
    cached, _ = bm.find_cached_prefix(longer)
    assert len(cached) == 2
    assert admit(bm, longer)
    assert longer.num_computed_tokens == 8 and longer.num_cached_tokens == 8
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 8 + 10
    other = make_seq([9, 9, 9, 9, 9])
    assert bm.find_cached_prefix(other) == ([], [])


def test_prefix_cache_can_be_disabled():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(8)))
    admit(bm, seq)
    compute(bm, seq)
    bm.free(seq)
    assert bm.find_cached_prefix(make_seq(list(range(9)))) == ([], [])


def test_hash_collisions_are_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(hashing, "block_hash", lambda parent, tokens, extra=(): b"same")
    bm = BlockManager(10, BS)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    b = make_seq([7, 7, 7, 7, 5])  # same (forced) hash, other tokens
    assert bm.find_cached_prefix(b) == ([], [])


def test_block_hash_is_stable_and_chained():
    h1 = hashing.block_hash(None, [1, 2, 3, 4])
    assert h1 == hashing.block_hash(None, [1, 2, 3, 4])  # not salted per process like hash()
    assert hashing.block_hash(h1, [5]) != hashing.block_hash(None, [5])
    assert len(h1) == 32 and h1 != hashing.block_hash(None, [1, 2, 3, 5])


def test_lru_eviction_reuses_the_least_recently_freed_cached_block_first():
    bm = BlockManager(4, BS)
    seqs = []
    for base in (0, 100, 200, 300):
        s = make_seq([base + i for i in range(BS)] + [999])
        seqs.append(s)
    for s in seqs[:2]:
        assert admit(bm, s)
        compute(bm, s)
    old, new = seqs[0], seqs[1]
    old_block, new_block = old.block_table[0], new.block_table[0]
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    # a request needing 2 fresh blocks takes the empty tail blocks first, then evicts the LRU cached block
    taker = make_seq([500 + i for i in range(BS * 2 + 1)])
    assert admit(bm, taker)
    assert old_block in taker.block_table and new_block not in taker.block_table
    assert len(bm.find_cached_prefix(make_seq(list(range(100, 100 + BS)) + [1]))[0]) == 1  # newer one survives
    assert bm.find_cached_prefix(make_seq(list(range(BS)) + [1])) == ([], [])  # evicted lazily, on reuse


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "speculate", "fork", "free"]), st.integers(0, 1000)),
                max_size=60))
def test_random_operations_never_leak_or_double_free(ops):
    bm = BlockManager(24, BS)
    bm.record_kv_events()
    announced: set[int] = set()  # what a KV-event subscriber believes the cache holds
    ever: set[int] = set()  # (a parent may since have been evicted: its copy in the sequence was a duplicate)
    live: list[Sequence] = []
    for op, arg in ops:
        if op == "new":
            seq = make_seq([arg % 7 + i % 3 for i in range(1 + arg % 13)])
            if admit(bm, seq):
                compute(bm, seq)
                live.append(seq)
        elif op == "append" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(arg % 5)
            if bm.allocate_slots(seq, 1):
                compute(bm, seq)
            else:
                seq.token_ids.pop()
        elif op == "speculate" and live:
            # A decode with k drafts (slots for the token and each draft), then `accepted` of them kept: the
            # rejected ones' slots are rolled back (trim), the kept ones are computed.
            seq = live[arg % len(live)]
            k, accepted = 1 + arg % 5, arg % 3
            seq.token_ids.append(arg % 5)
            if bm.allocate_slots(seq, 1 + k):
                seq.token_ids.extend([arg % 7] * min(accepted, k))
                compute(bm, seq)
                bm.trim(seq)
                assert len(seq.block_table) == bm.blocks_needed(seq.num_tokens)
                assert len(seq.block_hashes) <= seq.num_computed_tokens // BS
            else:
                seq.token_ids.pop()
        elif op == "fork" and live:
            parent = live[arg % len(live)]
            child = make_seq(list(parent.token_ids))
            fork(bm, parent, child)
            live.append(child)
        elif op == "free" and live:
            bm.free(live.pop(arg % len(live)))
        refs = {}
        for s in live:
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        # The fragmentation gauge's count, kept incrementally, equals a recount over every live block table.
        filled: dict[int, int] = {}
        for s in live:
            for i, b in enumerate(s.block_table):
                filled[b] = max(filled.get(b, 0), min(BS, s.num_tokens - i * BS))
        assert bm.tokens_held == sum(filled.values())
        # KV events: a subscriber that applies them holds exactly the prefix cache's blocks, and every stored run
        # extends a block announced before (or starts a prompt).
        for event in bm.take_kv_events():
            if isinstance(event, kv.AllBlocksCleared):
                announced.clear()
            elif isinstance(event, kv.BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in ever
                assert not announced & set(event.block_hashes)
                announced |= set(event.block_hashes)
                ever |= set(event.block_hashes)
            else:
                assert set(event.block_hashes) <= announced
                announced -= set(event.block_hashes)
        assert announced == {kv.external_hash(h) for h in bm.cached}
    bm.take_pending_copies()
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
