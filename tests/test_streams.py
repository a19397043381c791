"""Tokens and host streams: ordering, dependency failure propagation, no hangs."""

from __future__ import annotations

import threading
import time

from shfx.runtime.streams import DependencyFailed, DoneToken, JoinToken, PoolStream, WorkerStream


def test_worker_stream_is_fifo():
    s = WorkerStream("t")
    out = []
    toks = [s.submit(lambda i=i: out.append(i), label=f"a{i}") for i in range(50)]
    toks[-1].wait()
    assert out == list(range(50))
    s.close()


def test_cross_stream_dependency_orders_work():
    a, b = WorkerStream("a"), WorkerStream("b")
    out = []
    t1 = a.submit(lambda: (time.sleep(0.05), out.append("slow")), label="slow")
    t2 = b.submit(lambda: out.append("after"), [t1], label="after")
    t2.wait()
    assert out == ["slow", "after"]
    a.close()
    b.close()


def test_failure_skips_dependents_and_never_hangs():
    s, t = WorkerStream("s"), WorkerStream("t")
    ran = []

    def boom():
        raise ValueError("x")

    bad = s.submit(boom, label="bad")
    dep = t.submit(lambda: ran.append(1), [bad], label="dep")
    dep2 = s.submit(lambda: ran.append(2), [dep], label="dep2")
    free = s.submit(lambda: ran.append(3), label="free")
    for tok in (bad, dep, dep2, free):
        tok.wait()
    assert isinstance(bad.error, ValueError)
    assert isinstance(dep.error, DependencyFailed) and dep.error.label == "bad"
    assert isinstance(dep2.error, DependencyFailed) and dep2.error.label == "bad"
    assert ran == [3]
    s.close()
    t.close()


def test_join_token():
    s = WorkerStream("s")
    t1 = s.submit(lambda: None, label="a")
    j = JoinToken([t1, DoneToken("b")], "R")
    j.wait()
    assert j.is_done and j.error is None
    jf = JoinToken([DoneToken("x", ValueError())], "R")
    jf.wait()
    assert isinstance(jf.error, DependencyFailed)
    s.close()


def test_pool_stream_runs_in_parallel():
    p = PoolStream("p", workers=3)
    barrier = threading.Barrier(3, timeout=10)
    toks = [p.submit(barrier.wait, label=str(i)) for i in range(3)]
    for t in toks:
        t.wait()
    assert all(t.error is None for t in toks)  # all three were running at once
    p.close()


def test_reads_done_defaults_to_itself():
    t = DoneToken("x")
    assert t.reads_done is t
    u = DoneToken("y")
    t.reads = u
    assert t.reads_done is u
