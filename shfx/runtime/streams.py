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
from typing import Any

__all__ = [
    "Token", "DoneToken", "JoinToken", "Settled", "DeviceToken", "DependencyFailed", "Cancelled", "root_cause", "HostStream",
    "WorkerStream", "PoolStream", "InlineStream", "DeviceStream", "current_device_stream", "single_omp_thread",
]  # fmt: skip


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

    def wait_launched(self) -> None:
        """Wait until the task's work is issued and its error (if any) known: for host work,
        until it is done; a :class:`DeviceToken` is launched before its device work is done."""
        self.wait()

    @property
    def is_launched(self) -> bool:
        return self.is_done

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

    def wait_launched(self) -> None:
        for p in self.parts:
            p.wait_launched()

    @property
    def is_launched(self) -> bool:
        return self._event.is_set() or all(p.is_launched for p in self.parts)


class Settled(Token):
    """Completes when ``part`` completes, failed or not (never failed itself): a dependency on
    a task having *run*, whatever its outcome. Data parallel with rollback: a rank's all-gather
    and the step's verdict ``NR0`` run after its update even when the update failed, so every
    rank still reaches every collective, and the verdict reads ``part.error``."""

    __slots__ = ("part",)

    def __init__(self, part: Token):
        super().__init__(part.label)
        self.part = part

    def wait(self) -> None:
        if not self._event.is_set():
            self.part.wait()
            self.set(None)

    @property
    def is_done(self) -> bool:
        return self._event.is_set() or self.part.is_done


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


# ---- device streams: CUDA's execution model ------------------------------------------------------
_current = threading.local()


def current_device_stream() -> DeviceStream | None:
    """The device stream whose task the calling thread is launching (None outside one)."""
    return getattr(_current, "stream", None)


def _is_issuer() -> bool:
    """The calling thread is not one of shfx's stream threads (it is the user's, issuing)."""
    return not threading.current_thread().name.startswith("shfx-")


class DeviceToken(Token):
    """Completion of device work, in two steps as on CUDA: *launched* once its task ran on the
    issuing side (its work is enqueued on the stream, and an error in the task is known), and
    *done* once the device finished the work (``marker``: the stream's completion record, a
    CUDA event). ``wait()`` waits for both: from the issuing thread (not one of shfx's stream
    threads) it is a host synchronization, counted in ``stream.host_syncs``."""

    __slots__ = ("_launched", "marker", "stream")

    def __init__(self, label: str, stream: DeviceStream):
        super().__init__(label)
        self._launched = threading.Event()
        self.marker: object | None = None
        self.stream = stream

    def set_launched(self, error: BaseException | None = None, marker: object | None = None) -> None:
        self.error = error
        self.marker = marker if error is None else None
        self._launched.set()
        if self.marker is None:  # failed, or nothing left on the device
            self._event.set()

    def set(self, error: BaseException | None = None) -> None:  # (a failure before launch)
        self.set_launched(error, None)

    def wait_launched(self) -> None:
        self._launched.wait()

    @property
    def is_launched(self) -> bool:
        return self._launched.is_set()

    def wait(self) -> None:
        if _is_issuer():
            # NOTE: counted whether or not the work is done yet: on a GPU this is a host
            # synchronization, and the emulated device's compute is done as soon as launched
            self.stream.host_syncs += 1
        self._launched.wait()
        if not self._event.is_set():
            self.stream.wait_marker(self.marker)
            self._event.set()

    def device_wait(self) -> None:
        """Wait for the device work from another stream's launch (the emulated device's compute,
        which runs where it is launched): not counted as a host synchronization."""
        self._launched.wait()
        if not self._event.is_set():
            self.stream.wait_marker(self.marker)
            self._event.set()

    @property
    def is_done(self) -> bool:
        if self._event.is_set():
            return True
        if self._launched.is_set() and self.stream.marker_done(self.marker):
            self._event.set()
            return True
        return False


def _ready(tok: Token) -> bool:
    """A device task depending on ``tok`` can be launched: device work launched, host work done."""
    if isinstance(tok, JoinToken):
        return tok.is_done or all(_ready(p) for p in tok.parts)
    return tok.is_launched if isinstance(tok, DeviceToken) else tok.is_done


def _wait_ready(tok: Token) -> None:
    if isinstance(tok, JoinToken):
        for p in tok.parts:
            _wait_ready(p)
    elif isinstance(tok, DeviceToken):
        tok.wait_launched()
    else:
        tok.wait()


def _dep_error(tok: Token) -> BaseException | None:
    if isinstance(tok, JoinToken) and not tok._event.is_set():
        return next((skipped(p) for p in tok.parts if _dep_error(p) is not None), None)
    return skipped(tok) if tok.error is not None else None


def _device_parts(tok: Token) -> list[DeviceToken]:
    if isinstance(tok, JoinToken):
        return [d for p in tok.parts for d in _device_parts(p)]
    return [tok] if isinstance(tok, DeviceToken) and tok.marker is not None else []


class DeviceStream:
    """A device stream with CUDA's execution model, shared by the CUDA backend and the emulated
    device's CUDA-like mode: ``submit(fn, deps)`` *launches* ``fn`` (runs its Python, which
    enqueues work on the stream), after making the stream wait on the device for every
    dependency that is device work; the token's marker records the stream's completion.

    A dependency that is host work not yet done (an update on the host optimizer, a gradient
    accumulation), or device work not yet launched, never blocks the issuing thread: the task
    and every later task of this stream go to the stream's own launcher thread, which waits for
    them on the host and launches in order. So a host dependency holds up only this stream's
    later work, as a stream wait would on the device, and the issuing thread goes on launching
    the other streams' work. ``deferred`` counts such launches, ``host_syncs`` the host waits
    for this stream's device work from the issuing thread.

    Subclasses implement ``_capture`` (the launch context, taken on the issuing thread),
    ``_wait_on``, ``_run``, ``_record``, ``stamp``, ``wait_marker`` and ``marker_done``."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._backlog = 0
        self._launcher: WorkerStream | None = None
        self.deferred = 0
        self.host_syncs = 0

    def submit(self, fn: Callable[[], None], deps: Sequence[Token] = (), label: str = "") -> Token:
        tok = DeviceToken(label, self)
        ctx = self._capture()
        deps = tuple(deps)
        with self._lock:
            inline = self._backlog == 0 and all(_ready(d) for d in deps)
            if not inline:
                self._backlog += 1
                self.deferred += 1
                if self._launcher is None:
                    self._launcher = WorkerStream(f"{self.name}-launch", setup=single_omp_thread)
        if inline:
            self._launch(fn, deps, tok, ctx)
        else:
            self._launcher.submit(lambda: self._deferred_launch(fn, deps, tok, ctx), (), label)
        return tok

    def _deferred_launch(self, fn: Callable[[], None], deps: tuple[Token, ...], tok: DeviceToken, ctx: Any) -> None:
        try:
            for d in deps:
                _wait_ready(d)
            self._launch(fn, deps, tok, ctx)
        finally:
            with self._lock:
                self._backlog -= 1

    def _launch(self, fn: Callable[[], None], deps: tuple[Token, ...], tok: DeviceToken, ctx: Any) -> None:
        err = next((e for d in deps if (e := _dep_error(d)) is not None), None)
        marker = None
        if err is None:
            prev = getattr(_current, "stream", None)
            _current.stream = self
            try:
                for d in deps:
                    for p in _device_parts(d):
                        if p.stream is not self:
                            self._wait_on(p, ctx)
                self._run(fn, ctx)
                marker = self._record(ctx)
            except BaseException as e:  # noqa: BLE001 - surfaced through the token
                err = e
            finally:
                _current.stream = prev
        tok.set_launched(err, marker)

    # ---- to implement ---------------------------------------------------------------------------
    def _capture(self) -> Any:
        return None

    def _wait_on(self, dep: DeviceToken, ctx: Any) -> None:
        raise NotImplementedError

    def _run(self, fn: Callable[[], None], ctx: Any) -> None:
        fn()

    def _record(self, ctx: Any) -> object | None:
        raise NotImplementedError

    def stamp(self) -> Any:
        """A time stamp recorded on the stream at this point of the launch (when the device
        reaches it, not when the host launches it); resolved by :meth:`stamp_time`."""
        raise NotImplementedError

    def wait_marker(self, marker: Any) -> None:
        raise NotImplementedError

    def marker_done(self, marker: Any) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        if self._launcher is not None:
            self._launcher.close()
