"""Publishes KV-event batches on a ZeroMQ PUB socket, as vLLM's ZmqEventPublisher does: three frames per message
(topic, 8-byte big-endian sequence number, msgpack payload), and an optional ROUTER socket that answers a replay
request (the first sequence number wanted, 8 bytes) with every buffered batch from there, then (-1, b"").

The engine's thread only queues; a daemon thread encodes and sends, so a slow or absent subscriber never slows a
step (PUB drops at its high-water mark; the replay buffer lets a subscriber catch up)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from pagekube.engine.kv_events.config import KVEventsConfig
from pagekube.engine.kv_events.events import KVEventBatch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        # vLLM's rule: bind a wildcard or local address (a stable server), connect to anything else
        if "*" in config.endpoint or "::" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()
        log.info("KV events: publishing on %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # the engine never waits on a subscriber; the gap shows in the sequence numbers
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.warning("KV events: queue full, %d batches dropped", self._dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        self._encoder, self._sequence = msgspec.msgpack.Encoder(), count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                if not self._send_queued():  # a replay then holds every batch the engine published before it
                    return
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            self._send(batch)

    def _send_queued(self) -> bool:
        """Send what waits in the queue; False at the shutdown sentinel."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            self._send(batch)

    def _send(self, batch: KVEventBatch) -> None:
        seq, payload = next(self._sequence), self._encoder.encode(batch)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            log.exception("KV events: send failed")
        self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # (identity, empty delimiter, start) from a REQ or DEALER client
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:  # this thread alone appends to it
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

