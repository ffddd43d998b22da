"""KV events as vLLM publishes them: a real ZeroMQ subscriber on the engine's PUB socket and its replay socket.

The payloads are decoded twice: as plain msgpack (the wire layout a Go or Rust subscriber sees: arrays, the event's
class name first), and with msgspec into struct definitions written here as vLLM's subscriber example writes them,
not imported from the engine.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pagekube.engine.config import EngineConfig
from pagekube.engine.kv_events.events import external_hash
from pagekube.engine.sampling_params import SamplingParams


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 4


def events_config(tmp_path, **extra) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub", "topic": "kv@test",
            "replay_endpoint": f"ipc://{tmp_path}/replay", **extra}


def subscriber(tmp_path) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"ipc://{tmp_path}/pub")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    return sub


def receive_all(sub: zmq.Socket) -> list[tuple[int, bytes]]:
    got = []
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@test"
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def replay_all(tmp_path) -> list[tuple[int, bytes]]:
    """Every buffered batch from the replay socket. A DEALER sends what a REQ client would (empty delimiter, the
    first sequence number wanted) and takes every answer, up to the end marker."""
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(f"ipc://{tmp_path}/replay")
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    try:
        while True:
            assert replay.poll(5000), "no replay answer"
            _, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return replayed
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        replay.close(linger=0)


def generate(engine, prompts: list[list[int]], max_tokens: int = 3) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{len(p)}-{p[-1]}", p, SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def engine_with_events(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(block_size=BS, kv_events_config=events_config(tmp_path))
    sub = subscriber(tmp_path)
    yield engine, sub
    sub.close(linger=0)
    engine.close()


def test_events_are_vllms_wire_format_and_chain_from_announced_blocks(engine_with_events):
    engine, sub = engine_with_events
    time.sleep(0.3)  # a SUB socket misses what was sent before it connected (the replay test covers that)
    shared = list(range(100, 120))  # 5 full blocks
    generate(engine, [shared + [1, 2, 3]])
    generate(engine, [shared + [7, 8, 9, 10, 11]])
    messages = receive_all(sub)
    assert [seq for seq, _ in messages] == list(range(messages[0][0], messages[0][0] + len(messages)))

    raw = msgspec.msgpack.decode(messages[-1][1])  # the layout without any struct definitions
    assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2] == 0  # [ts, events, data_parallel_rank]
    assert raw[1][0][0] == "BlockStored" and raw[1][0][4] == BS and raw[1][0][6] == "GPU"

    stored = [e for _, p in messages for e in DECODER.decode(p).events if isinstance(e, BlockStored)]
    first, second = stored[0], stored[-1]
    assert first.parent_block_hash is None and first.token_ids[:20] == shared and first.lora_id is None
    # the second prompt hit the first one's 5 blocks: it stores only what follows them, chained to the 5th
    assert second.parent_block_hash == first.block_hashes[4]
    assert second.token_ids[:BS] == [7, 8, 9, 10]
    assert not set(second.block_hashes) & set(first.block_hashes)
    announced = set()
    for e in stored:
        assert e.parent_block_hash is None or e.parent_block_hash in announced
        announced |= set(e.block_hashes)
    assert announced == {external_hash(h) for h in engine.block_manager.cached}


def test_evictions_are_announced_and_replay_resends_what_a_late_subscriber_missed(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(block_size=BS, kv_cache_memory=64 * 1024, kv_events_config=events_config(tmp_path))
    try:
        capacity = engine.block_manager.num_blocks
        # more distinct prompt blocks than the pool holds: the oldest cached ones are evicted
        prompts = [[1000 + 50 * i + t for t in range(4 * BS + 1)] for i in range(capacity // 4 + 4)]
        generate(engine, prompts, max_tokens=1)
        replayed = replay_all(tmp_path)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        events = [e for _, p in replayed for e in DECODER.decode(p).events]
        assert isinstance(events[0], AllBlocksCleared)  # a (re)started engine holds nothing
        held: set[int] = set()
        for e in events:
            if isinstance(e, BlockStored):
                held |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= held
                held -= set(e.block_hashes)
        assert any(isinstance(e, BlockRemoved) for e in events)
        assert held == {external_hash(h) for h in engine.block_manager.cached}
    finally:
        engine.close()


@pytest.mark.parametrize("value, message", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "ZeroMQ address"),
    ('{"enable_kv_cache_events": true, "topics": "x"}', "topics"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_kv_events_config_is_refused_with_the_reason(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_events_config=value)


def test_events_off_by_default_cost_nothing(tiny_engine_factory):
    engine = tiny_engine_factory(block_size=BS, kv_events_config='{"enable_kv_cache_events": false}')
    assert engine.kv_event_publisher is None and engine.block_manager.kv_events is None



def test_an_adapters_blocks_carry_its_id_and_name(tiny_engine_factory, tiny_dir, tmp_path):
    from pagekube.engine.lora.request import LoRARequest
    from tests.lora_adapters import ATTENTION, write_adapter

    adapter = write_adapter(tiny_dir, tmp_path / "sql", ATTENTION)
    engine = tiny_engine_factory(block_size=BS, enable_lora=True, kv_events_config=events_config(tmp_path))
    try:
        prompt = list(range(200, 212))
        engine.add_request("base", prompt, SamplingParams(temperature=0, max_tokens=1))
        engine.add_request("sql", prompt, SamplingParams(temperature=0, max_tokens=1),
                           lora_request=LoRARequest("sql", 3, str(adapter)))
        while engine.has_unfinished_requests():
            engine.step()
        stored = [e for _, p in replay_all(tmp_path) for e in DECODER.decode(p).events if isinstance(e, BlockStored)]
    finally:
        engine.close()
    by_adapter = {(e.lora_id, e.lora_name): e for e in stored}
    assert set(by_adapter) == {(None, None), (3, "sql")}
    base, sql = by_adapter[(None, None)], by_adapter[(3, "sql")]
    assert base.token_ids == sql.token_ids == prompt  # the same tokens in blocks of their own
    assert not set(base.block_hashes) & set(sql.block_hashes)
