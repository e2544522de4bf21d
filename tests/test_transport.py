"""Transport: shared-memory ring round trips, wrap-around across processes, timeouts, dead peers,
segment hygiene (names, 0600, unlink on every exit path, stale cleanup), control messages."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from omni_stream.config import SamplingParams
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.transport import (AddStream, CancelStream, ChannelClosed, ControlChannel, Flags,
                                   MsgKind, PromptSpec, Ring, SegmentRegistry, Shutdown,
                                   StageError, StatsReply, StatsRequest, StreamStart,
                                   cleanup_stale, decode, encode)
from omni_stream.transport.shm import default_shm_dir

pytestmark = pytest.mark.timeout(120)
SPAWN = mp.get_context("spawn")
SHM = default_shm_dir()


def _ours(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefix))


@pytest.fixture
def registry():
    reg = SegmentRegistry(handle_signals=False)
    yield reg
    reg.close()
    assert _ours(reg.prefix) == []


@pytest.fixture
def endpoints(registry):
    """(owner, producer, consumer) of a 1 MiB ring, all in this process."""
    owner = Ring.create("t", 1 << 20, registry=registry)
    prod, cons = owner.handle("producer").open(), owner.handle("consumer").open()
    yield owner, prod, cons
    for r in (prod, cons, owner):
        r.close()


def _bits(a: np.ndarray) -> bytes:
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


# -- child process bodies (module level: importable under 'spawn') ---------------------------
def _random_message(rng: np.random.Generator, i: int) -> np.ndarray | None:
    choice = rng.integers(0, 5)
    if choice == 0:
        return None
    if choice == 1:
        return rng.integers(-2**62, 2**62, size=(int(rng.integers(1, 40)), 16), dtype=np.int64)
    if choice == 2:
        bits = rng.integers(0, 2**32, size=int(rng.integers(0, 1920 * 2)), dtype=np.uint32)
        return bits.view(np.float32)  # any bit pattern, NaNs included
    if choice == 3:
        return rng.integers(0, 256, size=(2, 3, int(rng.integers(1, 900))), dtype=np.uint8)
    return np.full((), i, dtype=np.int16)


def _produce_random(handle, n: int, seed: int, spin_us: float = 0.0) -> None:
    ring = handle.open(spin_us=spin_us)
    rng = np.random.default_rng(seed)
    for i in range(n):
        ok = ring.put(_random_message(rng, i), kind=MsgKind.DATA, stream_id=i % 5, seq=i,
                      aux=-i, flags=Flags.END if i == n - 1 else 0, timeout=30)
        assert ok, f"put {i} timed out"
    ring.close()


def _produce_from_conn(conn) -> None:
    """Receive the handle over a Connection after start (resource-sharer fd path)."""
    ring = conn.recv().open()
    ring.put(np.arange(10, dtype=np.int64), seq=1, flags=Flags.END, timeout=10)
    conn.recv()  # wait until the parent has read it
    ring.close()


def _produce_then_hang(handle, n: int) -> None:
    ring = handle.open()
    for i in range(n):
        ring.put(np.full(4, i, np.float32), seq=i, timeout=10)
    time.sleep(120)


def _attach_then_hang(handle) -> None:
    handle.open()
    time.sleep(120)


def _owner(conn, mode: str) -> None:
    """Own a registry with two rings, report (prefix, paths), then exit per ``mode``.

    The SIGINT disposition is set explicitly before the registry exists: a spawned child
    inherits its parent's, and a test run started in the background has SIGINT ignored.
    "sigint" models an interactive process (Python's KeyboardInterrupt handler), "sigint_ignored"
    one told to ignore SIGINT; it answers each message on ``conn`` with whether its segments
    exist, so the parent knows a signal sent before the message has been dealt with."""
    if mode == "sigint":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    elif mode == "sigint_ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    reg = SegmentRegistry()
    rings = [Ring.create("a", 1 << 16, registry=reg), Ring.create("b", 1 << 16, registry=reg)]
    paths = [r.path for r in rings]
    conn.send((reg.prefix, paths))
    if mode == "exit":
        return  # no explicit cleanup: atexit must do it
    if mode == "sigint_ignored":
        while conn.recv():
            conn.send([os.path.exists(p) for p in paths])
    time.sleep(120)  # wait for SIGTERM / SIGKILL


# -- round trips -----------------------------------------------------------------------------
def test_roundtrip_codes_and_pcm_bitwise(endpoints):
    _, prod, cons = endpoints
    rng = np.random.default_rng(0)
    sent = []
    for n in (1, 7, 2048):
        sent.append(rng.integers(0, 2048, size=(n, 16), dtype=np.int64))
    for k in (1, 2, 5):
        sent.append(rng.integers(0, 2**32, size=1920 * k, dtype=np.uint32).view(np.float32))
    for i, a in enumerate(sent):
        kind = MsgKind.CODES if a.dtype == np.int64 else MsgKind.PCM
        assert prod.put(a, kind=kind, stream_id=2**40 + i, seq=i, aux=i * 3, timeout=1)
    for i, a in enumerate(sent):
        m = cons.get(timeout=1)
        assert m is not None and _bits(m.payload) == _bits(a)
        assert (m.kind, m.stream_id, m.seq, m.aux, m.flags) == (
            MsgKind.CODES if a.dtype == np.int64 else MsgKind.PCM, 2**40 + i, i, i * 3, 0)
        assert m.enqueue_ns == m.put_ns <= m.get_ns
        assert not m.borrowed


def test_roundtrip_torch_views_and_odd_payloads(endpoints):
    torch = pytest.importorskip("torch")
    _, prod, cons = endpoints
    codes = torch.randint(0, 2048, (3, 16), dtype=torch.int64)
    bf = torch.randn(2, 5, 7).to(torch.bfloat16)
    strided = np.arange(60, dtype=np.int32).reshape(6, 10)[:, ::3]  # non-contiguous
    big_endian = np.arange(5, dtype=">f8")
    for p in (codes, bf, strided, big_endian, None, np.zeros((0, 16), np.int64), np.float64(2.5)):
        assert prod.put(p if not isinstance(p, np.float64) else np.asarray(p), enqueue_ns=123,
                        timeout=1)
    assert torch.equal(cons.get(1).as_tensor(), codes)
    m = cons.get(1)
    assert m.as_tensor().dtype == torch.bfloat16 and torch.equal(m.as_tensor(), bf)
    assert np.array_equal(cons.get(1).payload, strided)
    m = cons.get(1)
    assert m.payload.dtype == np.float64 and np.array_equal(m.payload, big_endian)
    m = cons.get(1)
    assert m.payload is None and m.as_tensor() is None and m.enqueue_ns == 123
    assert cons.get(1).payload.shape == (0, 16)
    assert cons.get(1).payload.shape == ()
    with pytest.raises(ValueError, match="at most 3"):
        prod.put(np.zeros((1, 1, 1, 1)))
    with pytest.raises(TypeError, match="complex"):
        prod.put(np.zeros(3, np.complex64))
    with pytest.raises(ValueError, match="capacity_bytes"):
        prod.put(np.zeros(prod.max_payload_bytes + 1, np.uint8))
    with pytest.raises(RuntimeError, match="consumer"):
        cons.put(None)


def test_borrowed_view_holds_space_until_released(registry):
    owner = Ring.create("v", 4096, registry=registry)
    prod, cons = owner.handle("producer").open(), owner.handle("consumer").open()
    big = np.arange(owner.max_payload_bytes // 8, dtype=np.int64)
    assert prod.put(big, timeout=0) and prod.put(big, timeout=0)
    assert not prod.put(big, timeout=0)  # full
    m = cons.get(0, copy=False)
    assert m.borrowed and np.array_equal(m.payload, big)
    assert not prod.put(big, timeout=0.01)  # still held by the view
    m.release()
    assert prod.put(big, timeout=0)
    m2 = cons.get(0, copy=False)
    m3 = cons.get(0, copy=False)  # releases m2's space implicitly
    assert m3.borrowed and not m2.borrowed
    assert prod.put(big, timeout=0)
    m3.release()
    m2.release()  # stale release is a no-op
    for r in (prod, cons, owner):
        r.close()


def test_end_and_error_flags(endpoints):
    _, prod, cons = endpoints
    prod.put(np.ones(3, np.float32), stream_id=1, flags=Flags.FIRST)
    prod.put(None, kind=MsgKind.EVENT, stream_id=1, flags=Flags.END)
    prod.put(None, kind=MsgKind.EVENT, stream_id=2, flags=Flags.ERROR | Flags.END)
    a, b, c = cons.get(1), cons.get(1), cons.get(1)
    assert a.flags == Flags.FIRST and not a.end and not a.error
    assert b.end and not b.error and b.kind == MsgKind.EVENT
    assert c.end and c.error and c.stream_id == 2


# -- blocking and timeouts -------------------------------------------------------------------
class WaitClock:
    """An injected clock for ring.py's deadlines: it moves only when the ring waits on its
    eventfd, by exactly the time the ring asked to wait (no real waiting, no load)."""

    def __init__(self, monkeypatch) -> None:
        from omni_stream.transport import notify, ring

        self.now = 1000.0
        monkeypatch.setattr(ring, "time", SimpleNamespace(monotonic=lambda: self.now,
                                                          monotonic_ns=time.monotonic_ns))
        monkeypatch.setattr(notify.Notifier, "wait", lambda ev, timeout_s: self._wait(timeout_s))

    def _wait(self, timeout_s: float) -> int:
        self.now += timeout_s
        return 0  # nothing came


def test_get_on_empty_times_out(endpoints, monkeypatch):
    _, _, cons = endpoints
    t = time.monotonic()
    assert cons.get(timeout=0.2) is None
    assert time.monotonic() - t >= 0.19  # a lower bound, which no load can break
    assert cons.get(timeout=0) is None
    with monkeypatch.context() as m:  # and it gives up at its deadline, not a poll later
        clock = WaitClock(m)
        assert cons.get(timeout=0.2) is None
        assert clock.now - 1000.0 == pytest.approx(0.2, abs=1e-9)


def test_put_on_full_times_out_and_resumes(registry, monkeypatch):
    owner = Ring.create("f", 1 << 14, registry=registry)
    prod, cons = owner.handle("producer").open(), owner.handle("consumer").open()
    chunk = np.zeros(1920, np.float32)
    n = 0
    while prod.put(chunk, seq=n, timeout=0):
        n += 1
    assert n == (1 << 14) // (128 + 7680 + 64)
    t = time.monotonic()
    assert not prod.put(chunk, timeout=0.1)
    assert time.monotonic() - t >= 0.09  # a lower bound, which no load can break
    with monkeypatch.context() as m:  # and it gives up at its deadline, not a poll later
        clock = WaitClock(m)
        assert not prod.put(chunk, timeout=0.1)
        assert clock.now - 1000.0 == pytest.approx(0.1, abs=1e-9)
    assert cons.get(0).seq == 0
    assert prod.put(chunk, seq=n, timeout=0)
    assert [cons.get(0).seq for _ in range(n)] == list(range(1, n + 1))
    for r in (prod, cons, owner):
        r.close()


def test_second_live_endpoint_is_refused(endpoints):
    owner, _, _ = endpoints
    other = owner.handle("producer")
    # pretend another live process (our parent) holds the producer slot
    struct.pack_into("<qQ", owner._mm, 128, os.getppid(), 0)
    with pytest.raises(RuntimeError, match="single-producer"):
        other.open()


# -- across processes ------------------------------------------------------------------------
@pytest.mark.parametrize("spin_us", [0.0, 300.0])
def test_wraparound_random_sizes_spawned_producer(registry, spin_us):
    owner = Ring.create("w", 64 << 10, role="consumer", registry=registry, spin_us=spin_us)
    n, seed = 3000, 1234
    proc = SPAWN.Process(target=_produce_random,
                         args=(owner.handle("producer"), n, seed, spin_us))
    proc.start()
    try:
        rng = np.random.default_rng(seed)
        for i in range(n):
            expect = _random_message(rng, i)
            m = owner.get(timeout=30, copy=bool(i % 2))
            assert m is not None, f"message {i} missing"
            assert (m.seq, m.stream_id, m.aux) == (i, i % 5, -i)
            if expect is None:
                assert m.payload is None
            else:
                assert _bits(m.payload) == _bits(expect), f"payload {i} differs"
            assert m.end == (i == n - 1)
        proc.join(30)
        assert proc.exitcode == 0
        st = owner.stats()
        assert st["msgs_put"] == st["msgs_got"] == n and st["bytes_put"] > 8 * owner.capacity
        # producer closed cleanly and the ring is drained: None before the timeout (ordering:
        # only a wait that missed the closed producer lasts its whole 30 s)
        t = time.monotonic()
        assert owner.get(timeout=30) is None and time.monotonic() - t < 30
        assert not owner.peer_alive()
    finally:
        proc.kill()
        owner.close()


def test_handle_sent_over_connection_to_running_process(registry):
    owner = Ring.create("c", 1 << 16, role="consumer", registry=registry)
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_produce_from_conn, args=(child,))
    proc.start()
    try:
        parent.send(owner.handle("producer"))
        m = owner.get(timeout=30)
        assert m is not None and m.end and np.array_equal(m.payload, np.arange(10))
        parent.send("done")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        proc.kill()
        owner.close()


def test_killed_producer_does_not_hang_consumer(registry):
    owner = Ring.create("k", 1 << 16, role="consumer", registry=registry)
    proc = SPAWN.Process(target=_produce_then_hang, args=(owner.handle("producer"), 3))
    proc.start()
    try:
        assert [owner.get(timeout=30).seq for _ in range(3)] == [0, 1, 2]
        assert owner.peer_alive()
        os.kill(proc.pid, signal.SIGKILL)
        t = time.monotonic()
        assert owner.get(timeout=30) is None
        # None before the timeout (ordering: only a wait that missed the dead producer lasts
        # its whole 30 s)
        assert time.monotonic() - t < 30
        assert not owner.peer_alive()  # even before the zombie is reaped
        proc.join(10)
        assert owner.get(timeout=None) is None  # no timeout at all still returns
    finally:
        proc.kill()
        owner.close()


def test_killed_consumer_does_not_hang_producer(registry):
    owner = Ring.create("kc", 1 << 14, role="producer", registry=registry)
    proc = SPAWN.Process(target=_attach_then_hang, args=(owner.handle("consumer"),))
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while owner.endpoint_pid("consumer") != proc.pid:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        chunk = np.zeros(1920, np.float32)
        while owner.put(chunk, timeout=0):
            pass
        # no timeout at all: only noticing the dead consumer can end this wait
        assert not owner.put(chunk, timeout=None)
        assert not owner.peer_alive()
    finally:
        proc.kill()
        owner.close()


# -- segment hygiene -------------------------------------------------------------------------
def test_segments_are_0600_unique_and_unlinked(registry):
    old = os.umask(0)
    try:
        a = Ring.create("p", 1 << 12, registry=registry)
        b = Ring.create("p", 1 << 12, registry=registry)
    finally:
        os.umask(old)
    assert a.name != b.name and a.name.startswith(f"omni-stream-{os.getpid()}-")
    for r in (a, b):
        assert os.stat(r.path).st_mode & 0o777 == 0o600
    assert _ours(registry.prefix) == sorted([a.name, b.name])
    a.close()
    assert a._seg.mm.closed  # no stray exports kept the mapping alive
    a.unlink()
    assert _ours(registry.prefix) == [b.name]
    with b:  # context manager: close + unlink
        pass
    assert _ours(registry.prefix) == []
    other = SegmentRegistry(handle_signals=False)
    assert other.prefix != registry.prefix
    with other:
        Ring.create("q", 1 << 12, registry=other)
        assert len(_ours(other.prefix)) == 1
    assert _ours(other.prefix) == []


@pytest.mark.parametrize("mode", ["exit", "sigterm", "sigint"])
def test_owner_process_exit_unlinks_segments(mode):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_owner, args=(child, mode))
    proc.start()
    try:
        prefix, paths = parent.recv()
        if mode != "exit":
            assert all(os.path.exists(p) for p in paths)
            os.kill(proc.pid, signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
        proc.join(30)
        # SIGINT chains to Python's handler: KeyboardInterrupt, the child exits with 1
        assert proc.exitcode == {"exit": 0, "sigterm": -signal.SIGTERM, "sigint": 1}[mode]
        assert _ours(prefix) == []
    finally:
        proc.kill()


def test_ignored_sigint_leaves_the_owner_and_its_segments_alone():
    """A process started with SIGINT ignored (a background job) lives on after SIGINT, so its
    segments must too; SIGTERM still unlinks them and kills it."""
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_owner, args=(child, "sigint_ignored"))
    proc.start()
    try:
        prefix, paths = parent.recv()
        os.kill(proc.pid, signal.SIGINT)
        parent.send("still there?")  # answered after any handler for the SIGINT has run
        assert parent.poll(30), "the owner did not answer after SIGINT"
        assert parent.recv() == [True, True]
        assert proc.is_alive() and _ours(prefix) == sorted(os.path.basename(p) for p in paths)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        assert proc.exitcode == -signal.SIGTERM
        assert _ours(prefix) == []
    finally:
        proc.kill()


def test_cleanup_stale_removes_dead_owners_only(registry):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_owner, args=(child, "sigkill"))
    proc.start()
    prefix, paths = parent.recv()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert len(_ours(prefix)) == 2  # SIGKILL: nothing could clean up
    mine = Ring.create("live", 1 << 12, registry=registry)
    # a live pid whose start time does not match the preamble: a recycled pid, so stale
    recycled = os.path.join(SHM, f"omni-stream-{os.getppid()}-feedbeef-x-1")
    fd = os.open(recycled, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, struct.pack("<8sqQ", b"OMNISHM1", os.getppid(), 1) + bytes(40))
    os.close(fd)
    removed = cleanup_stale()
    assert sorted(paths + [recycled]) == sorted(p for p in removed if p in paths + [recycled])
    assert _ours(prefix) == [] and not os.path.exists(recycled)
    assert os.path.exists(mine.path)
    mine.close()


# -- control messages ------------------------------------------------------------------------
def test_control_messages_roundtrip_and_validation():
    msgs = [AddStream(5, PromptSpec("hello", "english", speaker="ryan", stream_text=True),
                      SamplingParams(temperature=0.7, sub_top_k=0), ChunkPolicy(first=2, steady=6),
                      seed=7, max_frames=100, stream_codes=True),
            AddStream(6),
            CancelStream(5, "client gone"), StatsRequest(3),
            StatsReply("talker", 123, 3, {"steps": 10, "ms": 1.5}),
            Shutdown("bye", drain=True), StageError("code2wav", "oom", [1, 2], fatal=True)]
    for m in msgs:
        assert decode(encode(m)) == m
    assert msgs[0].sampling.temperature == 0.7 and msgs[0].chunk.steady == 6
    assert msgs[1].sampling == SamplingParams() and msgs[1].chunk == ChunkPolicy()
    with pytest.raises(ValueError, match="top_p"):
        AddStream(1, sampling=SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_frames"):
        decode(msgspec.msgpack.encode({"type": "add_stream", "stream_id": 1, "max_frames": 0}))
    with pytest.raises(ValueError):
        decode(b"\x81\xa4type\xa4nope")


@pytest.mark.parametrize("body, named", [
    ({"sampling": {"top_p": 0.0}}, r"top_p.*\$\.sampling"),
    ({"sampling": {"temperature": "hot"}}, r"\$\.sampling\.temperature"),
    ({"sampling": {"topp": 1.0}}, r"unknown field `topp`.*\$\.sampling"),
    ({"chunk": {"growth": 3.0}}, r"growth.*\$\.chunk"),
    ({"chunk": {"first": 4, "steady": 2}}, r"first.*\$\.chunk"),
    ({"prompt": {"text": 3}}, r"\$\.prompt\.text"),
    ({"do_sample": False}, r"unknown field `do_sample`"),  # the old flat fields are gone
])
def test_add_stream_decode_names_the_bad_field(body, named):
    with pytest.raises(msgspec.ValidationError, match=named):
        decode(msgspec.msgpack.encode({"type": "add_stream", "stream_id": 1, **body}))


def test_stream_start_travels_as_msgpack_bytes():
    s = StreamStart(ChunkPolicy(first=1, steady=4, growth=1.5), codes_only=True, input_tokens=9)
    payload = s.to_payload()
    assert payload.dtype == np.uint8 and payload.ndim == 1
    assert StreamStart.from_payload(payload) == s
    with pytest.raises(msgspec.ValidationError, match="growth"):
        StreamStart.from_payload(np.frombuffer(msgspec.msgpack.encode(
            {"chunk": {"growth": 9.0}}), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        StreamStart.from_payload(np.zeros(5, dtype=np.int32))


def test_control_channel():
    a, b = ControlChannel.pair(SPAWN)
    assert b.recv(timeout=0.05) is None
    a.send(CancelStream(9))
    assert b.recv(timeout=1) == CancelStream(9)
    a.close()
    with pytest.raises(ChannelClosed):
        b.recv(timeout=1)
    b.close()
