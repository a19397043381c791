"""Tokens and host-side streams.

A :class:`Token` stands for the completion of one issued action. Dependencies between actions
are tokens: a stream does not start a task until every token it depends on has completed. A
failed task marks its token failed and every task depending on it is skipped (its token fails
with :class:`DependencyFailed`), so a failure never leaves a waiter hanging.

:class:`WorkerStream` is a FIFO run by one worker thread (the emulated device's compute, h2d
and d2h streams, and the host's gradient-accumulation stream); :class:`PoolStream` runs tasks on
several threads (the host optimizer).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

__all__ = ["Token", "DoneToken", "JoinToken", "DependencyFailed", "Cancelled", "root_cause", "HostStream", "WorkerStream", "PoolStream", "InlineStream", "single_omp_thread"]


class DependencyFailed(RuntimeError):
    """A task was skipped because a task it waits for failed; ``cause`` is the first real
    error down the chain (the exception of the task that failed, not another skip)."""

    def __init__(self, label: str, cause: BaseException | None = None):
        cause = root_cause(cause) if cause is not None else None
        why = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"skipped: {label} failed{why}")
        self.label = label
        self.cause = cause


class Cancelled(RuntimeError):
    """A task was not run because its step is being abandoned (another action failed, or the
    step was interrupted): the engine stops issuing work and waits for what already runs."""


def root_cause(err: BaseException) -> BaseException:
    """The error a chain of skips started from (``err`` itself when it is not a skip)."""
    while isinstance(err, DependencyFailed) and err.cause is not None:
        err = err.cause
    return err


def skipped(dep: Token) -> DependencyFailed:
    """The error of a task skipped because ``dep`` failed."""
    err = dep.error
    if isinstance(err, DependencyFailed):
        return err
    return DependencyFailed(dep.label, err)


class Token:
    """Completion of one task. ``error`` is set when the task failed or was skipped."""

    __slots__ = ("_event", "error", "label", "reads")

    def __init__(self, label: str = ""):
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.label = label
        self.reads: Token | None = None  # completes when the task no longer reads device memory

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._event.set()

    def wait(self) -> None:
        self._event.wait()

    @property
    def is_done(self) -> bool:
        return self._event.is_set()

    @property
    def reads_done(self) -> Token:
        """The token a slot RELEASE waits for: the task finished reading device memory."""
        return self.reads if self.reads is not None else self

    def __repr__(self) -> str:
        state = "failed" if self.error else ("done" if self.is_done else "pending")
        return f"<Token {self.label} {state}>"


class DoneToken(Token):
    """A token that is already complete."""

    def __init__(self, label: str = "", error: BaseException | None = None):
        super().__init__(label)
        self.set(error)


class JoinToken(Token):
    """Completes when all ``parts`` complete; fails if any fails (a RELEASE is one)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Token], label: str = ""):
        super().__init__(label)
        self.parts = list(parts)

    def wait(self) -> None:
        if not self._event.is_set():
            err = None
            for p in self.parts:
                p.wait()
                if p.error is not None and err is None:
                    err = skipped(p)
            self.set(err)

    @property
    def is_done(self) -> bool:
        return self._event.is_set() or all(p.is_done for p in self.parts)


def wait_deps(deps: Sequence[Token]) -> BaseException | None:
    """Wait for every dependency on the host; return a DependencyFailed for the first failure."""
    err = None
    for d in deps:
        d.wait()
        if d.error is not None and err is None:
            err = skipped(d)
    return err


class HostStream:
    """Tasks run in submission order by ``workers`` daemon threads, each task once its
    dependencies are complete. With one worker it is a strict FIFO (a device stream of the
    emulated backend, the host gradient-accumulation stream); with several, a pool (the host
    optimizer), where a task waiting for its dependencies holds its worker."""

    def __init__(self, name: str, workers: int = 1, setup: Callable[[], None] | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._setup = setup
        self._ready = threading.Barrier(workers + 1) if setup is not None else None
        self._threads = [
            threading.Thread(target=self._loop, name=f"shfx-{name}" + (f"-{i}" if workers > 1 else ""), daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        if self._ready is not None:
            self._ready.wait()  # every worker has run ``setup``
        self._closed = False

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[[], None], deps: Sequence[Token] = (), label: str = "") -> Token:
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        tok = Token(label)
        self._q.put((fn, tuple(deps), tok))
        return tok

    def _loop(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            finally:
                self._ready.wait()
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, deps, tok = item
            err = wait_deps(deps)
            if err is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - surfaced through the token
                    err = e
            tok.set(err)
            # NOTE: drop the task before waiting for the next: an idle thread holding the last
            # closure (tensors with autograd graphs) would free it at interpreter shutdown, when
            # the thread cannot take the GIL any more, and the process aborts.
            del item, fn, deps, tok, err

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the workers after the tasks already queued, and wait for them (a worker
        still running at interpreter shutdown can abort the process)."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._q.put(None)
        if threading.current_thread() not in self._threads:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)


class WorkerStream(HostStream):
    """A FIFO executed in order by one worker thread."""

    def __init__(self, name: str, setup: Callable[[], None] | None = None):
        super().__init__(name, 1, setup)


class InlineStream:
    """A stream run by the thread that submits to it: ``submit`` waits for the dependencies,
    runs the task there and returns its (finished) token. Order is submission order, as for a
    worker stream; a failure fails the token instead of raising, so dependents are skipped.

    The emulated device's compute stream is one: compute then runs on the caller's OpenMP
    thread pool, the only multi-threaded pool in the process (see :func:`single_omp_thread`).
    Overlap is kept because a program issues each copy before the compute that precedes it.
    """

    def __init__(self, name: str):
        self.name = name

    def submit(self, fn: Callable[[], None], deps: Sequence[Token] = (), label: str = "") -> Token:
        err = wait_deps(deps)
        if err is None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced through the token
                err = e
        return DoneToken(label, err)

    def close(self) -> None:
        pass


def single_omp_thread() -> None:
    """Stream setup: this thread's parallel regions run on one thread.

    NOTE: libgomp lets idle OpenMP workers spin between parallel regions only while the process
    has no more OpenMP threads than cores; past that they sleep and every region pays a
    wake-up (``benchmarks/overhead.py``: 2x on tiny stages, ~10% on small ones). Copy and host
    threads need no team of their own. The first ``get_num_threads`` pins this thread's
    settings before the change; the constructing thread restores the process default after."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(1)


class PoolStream(HostStream):
    """Tasks run on ``workers`` threads, each once its dependencies are complete; ``setup``
    runs once in every worker before its first task."""
