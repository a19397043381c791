"""What a failed or interrupted phase leaves behind, and the errors that say so.

:class:`StepFailures` is the engine's side of docs/usage.md's "When something fails": it finds
the root cause of a phase's failure (:meth:`StepFailures.failure`), defers Ctrl-C while a phase
runs (:meth:`StepFailures.deferred_interrupt`), abandons a step (waits for what runs, rolls the
journal back, drops the gradients) and words what is left (:func:`state_note`, :func:`with_note`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch.fx as fx

from shfx.passes.meta import get_meta
from shfx.passes.program import Program

from ..errors import ActionError, OutOfDeviceMemory
from .context import StepContext
from .host_store import GRAD_NONE
from .streams import Cancelled, DependencyFailed, Token, root_cause

__all__ = ["StepFailures", "oom_in", "state_note", "with_note"]


def state_note(phase: str, restored: list[int], applied: list[int], gradients: str, unagreed: bool = False) -> str:
    """What a failed or interrupted step left behind, and how to go on. ``unagreed``: data
    parallel with rollback, but the ranks could not agree the undo (a collective failed: a rank
    was lost, or failed outside its updates)."""
    if unagreed:
        return (
            f"The {phase} failed under data parallel without every rank agreeing to undo it (a collective failed: "
            "another rank died, failed outside its optimizer updates, or stopped answering; see its error)"
            + (f", after the updates of parameter groups {applied} had run on this rank" if applied else "")
            + ": the ranks' weights and optimizer states may differ. Restart the job from the last checkpoint."
        )
    if applied:
        return (
            f"The {phase} failed after the updates of parameter groups {applied} had run, and rollback is off "
            "(shfx.compile(rollback=False)): those groups are updated and the others are not, so the training "
            "state is inconsistent. Reload the last checkpoint (model and optimizer state) to go on exactly; "
            + ("calling cm.step() again applies only the updates that did not run." if gradients == "kept" else "")
        ).rstrip("; ")
    state = (
        f"The step was not applied: the updates that had run (parameter groups {restored}) were rolled back, "
        if restored
        else "The step was not applied: no update had run, "
    ) + "so the weights and optimizer states are exactly as before it"
    if gradients == "kept":
        return state + "; the gradients are kept: call cm.step() again to apply the step, or cm.zero_grad() to drop it."
    return state + ", and the gradients of this step were cleared (as by zero_grad()): run the step again from its first forward."


def with_note(err: BaseException, note: str) -> BaseException:
    """``err`` with ``note`` added: to the message of shfx's errors, as a note (shown under the
    traceback) on others, such as ``KeyboardInterrupt``, which keep their type."""
    if isinstance(err, OutOfDeviceMemory):
        e = OutOfDeviceMemory(
            f"{err}\n\n{note}", needed_bytes=err.needed_bytes, used_bytes=err.used_bytes,
            capacity_bytes=err.capacity_bytes, what=err.what,
        )  # fmt: skip
        e.__cause__ = err.__cause__
        return e
    if isinstance(err, ActionError):
        msg = str(err)
        head, sep, program = msg.partition("\n\n")
        e = ActionError(f"{head}\n\n{note}{sep}{program}", err.action)
        e.__cause__ = err.__cause__
        return e
    err.add_note(note)
    return err


def oom_in(err: OutOfDeviceMemory, where: str) -> OutOfDeviceMemory:
    """The same out-of-memory error, saying where in the step it happened."""
    return OutOfDeviceMemory(
        f"{err} This happened in {where}.",
        needed_bytes=err.needed_bytes,
        used_bytes=err.used_bytes,
        capacity_bytes=err.capacity_bytes,
        what=err.what,
    )


class StepFailures:
    """Waiting out, undoing and reporting a failed or interrupted step of one engine.

    ``interrupted`` is set while a phase runs under :meth:`deferred_interrupt` and Ctrl-C came.
    What it uses of the engine (:class:`~shfx.runtime.engine.Engine`): ``backend``, ``store``,
    ``pool``, ``ssd``, ``dp``, ``journal``, ``gradients``, ``param_keys_by_group``, ``cancel``,
    ``holder``, ``pending_updates``, ``backward_calls``, ``loaded``, and its methods
    ``sync_to_host``, ``expose_grads``, ``end_step_clock`` and ``drop_step_clock``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.interrupted = False  # Ctrl-C came while a phase ran (see deferred_interrupt)
        self.unagreed = False  # the last undo_step: data parallel, the ranks could not agree it (not undone)

    def failure(self, program: Program, issued: list[tuple[fx.Node, Token]]) -> BaseException | None:
        """The error to raise for a phase whose tasks have all finished, or None: the root
        cause (the first failure that is neither a skip nor a cancellation) wrapped in an
        :class:`ActionError` naming the action and showing the program, an
        :class:`OutOfDeviceMemory` saying where, or a ``KeyboardInterrupt`` as it is."""
        failed = [(n, t) for n, t in issued if t.error is not None]
        if not failed:
            return None
        causes = [(n, root_cause(t.error)) for n, t in failed]
        node, err = next(
            ((n, e) for n, e in causes if not isinstance(e, (DependencyFailed, Cancelled))), causes[0]
        )  # fmt: skip
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return err
        action = str(get_meta(node).action)
        if isinstance(err, OutOfDeviceMemory):
            e = oom_in(err, f"action {action} of program {program.name!r}")
        else:
            e = ActionError(
                f"action {action} of program {program.name!r} failed: {type(err).__name__}: {err}\n\n"
                f"{program.format(mark=node)}",
                action,
            )
        e.__cause__ = err
        return e

    @contextlib.contextmanager
    def deferred_interrupt(self, abandon: bool) -> Iterator[None]:
        """Ctrl-C while a phase runs sets ``interrupted`` instead of raising in whatever the
        main thread runs then (an action running inline, a wait): the phase then ends cleanly
        and raises ``KeyboardInterrupt`` itself. With ``abandon`` the tasks not started yet are
        skipped at once; without, the phase runs to its end (its updates cannot be undone). A
        second Ctrl-C raises at once. Only where Python's default SIGINT handler is installed,
        in the main thread (a user's own handler is left alone)."""
        eng = self.engine
        self.interrupted = False
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            if abandon:
                eng.cancel.set()

        prev = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, prev)
            eng.cancel.clear()

    def quiesce(self, tokens: Sequence[Token]) -> None:
        """Abandon a step: tasks not started yet are skipped (:class:`Cancelled`), and every
        task of ``tokens`` has finished when this returns (nothing left running against the
        slots or the host store)."""
        eng = self.engine
        eng.cancel.set()
        try:
            for t in tokens:
                t.wait()
        finally:
            eng.cancel.clear()

    def fail_cleanup(self, ctx: StepContext) -> None:
        eng = self.engine
        if eng.holder is ctx:
            eng.holder = None
        ctx.release_all()
        if eng.ssd is not None and eng.ssd.images is not None:
            eng.ssd.reset_images()  # (the parameter tier: the forward's image buffers, read or not, free again)
        if eng.dp is not None:  # (after the quiesce: the local gradients whose RS never ran)
            if ctx.accumulation is not None:
                ctx.accumulation.local.clear()
            eng.dp.reclaim()

    def undo_step(self, agreed: bool = False, gathered: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """Roll back the current step's updates (the journal's copies) when rollback is on;
        returns (groups restored, groups updated and left applied).

        Data parallel: only a step every rank undoes (``agreed``: the verdict ``NR0`` of an
        overlapped step) is rolled back; each rank restores its own shards from its copies,
        then the image of every group all-gathered this step (``gathered``, the same on every
        rank), which the all-gather overwrote with the other ranks' updated shards, is rebuilt
        with one all-gather of the restored shards per group (:meth:`~shfx.runtime.data_parallel.
        DataParallelRuntime.restore_images`). A failure the ranks did not agree on (a lost rank)
        is not undone (``unagreed`` is set: the note says to restart from a checkpoint)."""
        eng = self.engine
        self.unagreed = False
        if eng.ssd is not None:
            eng.ssd.reset()  # a group read for an update that did not finish goes back to the SSD
            if eng.ssd.images is not None:
                eng.ssd.reset_images()  # (the parameter tier: an updated image back, every image buffer free)
        if eng.journal.enabled and eng.dp is not None and not agreed and eng.journal.updated_groups():
            self.unagreed = True
            return [], eng.journal.updated_groups()
        if eng.journal.enabled:
            restored = eng.journal.rollback(eng.pool.region if eng.pool is not None else None)
            if eng.dp is not None and eng.store.sharded and gathered:
                eng.dp.restore_images(sorted(gathered))
                restored = sorted(set(restored) | set(gathered))
            if restored:
                # the persistent slots may hold updated weights (a refresh after the host update,
                # a tied copy of a device-updated group): write the device-updated groups (restored
                # in their slots) back to the host, and reload every persistent stage from there
                eng.sync_to_host()
                eng.loaded = None
            return restored, []
        return [], eng.journal.updated_groups()

    def clear_grads(self) -> None:
        """Drop every gradient (as ``zero_grad()``): a failed backward's are incomplete."""
        eng = self.engine
        for g in range(len(eng.store.groups)):
            eng.store.grad_state[g] = GRAD_NONE
        for keys in eng.param_keys_by_group.values():
            for _, p in keys:
                p.grad = None
        eng.gradients.reset_device()
        eng.backward_calls = 0

    def abandon_backward(self, ctx: StepContext, program: Program, issued: list[tuple[fx.Node, Token]], err: BaseException) -> BaseException:
        """A backward failed or was interrupted: wait for what runs, undo the updates it started,
        drop its gradients, free its context; returns the error to raise, saying so."""
        eng = self.engine
        tokens = [t for _, t in issued] + [t for _, t in eng.pending_updates]
        self.quiesce(tokens)
        eng.pending_updates.clear()
        failure = self.failure(program, issued)
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or failure is None:
            failure = err
        restored, applied = self.undo_step()
        self.clear_grads()
        eng.drop_step_clock()
        self.fail_cleanup(ctx)
        return with_note(failure, state_note("backward", restored, applied, gradients="cleared", unagreed=self.unagreed))

    def finish_interrupted(
        self, ctx: StepContext, program: Program, issued: list[tuple[fx.Node, Token]], interrupt: BaseException
    ) -> BaseException:
        """Ctrl-C came during a backward whose updates had started, without rollback: finish the
        backward and its updates (the step is then applied, as by ``step()``) and return the
        interrupt to raise, saying so. A failure meanwhile abandons the step as usual."""
        eng = self.engine
        try:
            for _, t in issued:
                t.wait()
        except BaseException as e:  # a second interrupt: stop now
            return self.abandon_backward(ctx, program, issued, e)
        failure = self.failure(program, issued)
        if failure is not None:
            return self.abandon_backward(ctx, program, issued, failure)
        with eng.backend.during("end"):
            ctx.release_all()
        eng.expose_grads()
        eng.pending_updates.clear()
        eng.journal.commit()
        eng.backward_calls = 0
        eng.end_step_clock()
        return with_note(
            interrupt,
            "The interrupt came during backward() after its optimizer updates had started (they cannot be undone "
            "with rollback off), so shfx finished the backward and the updates first: the step is applied, as by "
            "cm.step(), and the state is consistent. Call cm.zero_grad() and go on with the next batch.",
        )
