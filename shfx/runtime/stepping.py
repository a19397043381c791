"""``step()``: applying (or skipping) the optimizer step of one engine.

:class:`StepRunner` is everything ``cm.step()`` does once the backward is done: it issues the
program's step phase (``overlap_update=False``; :meth:`StepRunner._issue_step_phase`), or waits
for the updates the backward started, or issues the program's update actions itself (a retried
step); clipped steps (the gate ``CK0``, :meth:`StepRunner._gated_step`); ZeRO-Offload's
delayed update (the program's step and delayed phases, :meth:`StepRunner._delayed_step`); the
non-finite checks that skip or fail a step; and :meth:`StepRunner._finish_step`, which commits
the step or undoes it and raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from shfx.passes.actions import KINDS, ActionKind
from shfx.passes.meta import get_meta
from shfx.passes.pipeline import Variant
from shfx.passes.program import Program

from ..errors import ActionError, NonFiniteGradient, OutOfDeviceMemory, UsageError
from .clipping import Clipping
from .failures import StepFailures, oom_in, state_note, with_note
from .handlers import ActionHandlers, require_finite
from .host_store import GRAD_NONE, GRAD_VALID
from .streams import Cancelled, DependencyFailed, Token, root_cause

__all__ = ["StepPhase", "StepRunner"]

# the actions of one host group's update, issued by step() only for the groups still to update
_HOST_GROUP_KINDS = (
    ActionKind.CPU_STEP, ActionKind.SSD_READ, ActionKind.SSD_WRITE, ActionKind.GATHER_PARAMS, ActionKind.SNAPSHOT,
    ActionKind.UNSCALE,
)  # fmt: skip


class StepPhase:
    """What the actions ``step()`` issues see of their step (the step and next-forward phases):
    the variant, and each issued node's token (their dependencies on the backward's actions
    are done: those are left out)."""

    def __init__(self, variant: Variant) -> None:
        self.variant = variant
        self.env: dict[fx.Node, Token] = {}
        self.accumulation = None


class StepRunner:
    """``step()``, ``zero_grad()``, clipping's norms and the delayed and deferred updates of one
    engine; the tasks it issues are ``handlers``', a failure is undone through ``failures``.

    What it uses of the engine (:class:`~shfx.runtime.engine.Engine`): ``backend``, ``store``,
    ``optimizer``, ``journal``, ``gradients``, ``clipping``, ``dp``, ``current``, ``loaded``,
    ``pending_updates``, ``deferred``, ``delayed``, ``delayed_update``, ``overlap_update``,
    ``param_keys_by_group``, the step's flags and counters (``check_finite``, ``step_checked``,
    ``clip_coef``, ``skip_nonfinite``, ``scaler``, ``nonfinite_flags``, ``backward_calls``,
    ``skipped_steps``, ``last_step_skipped``), and its methods ``issue`` (a phase's nodes),
    ``expose_grads``, ``end_step_clock`` and ``drop_step_clock``."""

    def __init__(self, engine: Any, handlers: ActionHandlers, failures: StepFailures) -> None:
        self.engine = engine
        self.handlers = handlers
        self.failures = failures

    # ---- the step: issue or wait for the updates, then commit or undo ----------------------------
    def step(self, program: Program | None = None) -> bool:
        """Apply the optimizer: wait for updates started during backward, or run them now.

        Returns False when the step was skipped (``skip_nonfinite`` and a gradient holds inf or
        NaN): no group is updated, the gradients stay. A failed or interrupted step is rolled
        back (``rollback=True``) and the gradients stay, so calling ``step()`` again applies
        it; with ``rollback=False`` the error says which groups were updated, and calling
        ``step()`` again applies only the others."""
        eng = self.engine
        if eng.optimizer is None:
            raise UsageError("step() needs an optimizer: pass optimizer=shfx.optim.AdamW(...) to shfx.compile")
        if eng.delayed_update:
            self._delayed_step()
            return True
        v = eng.current
        if v is not None and v.train.updates_in_step:
            skipped = self._issue_step_phase(v)
            return skipped if skipped is not None else self._finish_step()
        if eng.clipping.clip is not None or eng.clipping.clipped is not None:
            return self._clipped_step()
        if not eng.pending_updates and v is not None:
            # the backward issued no update (a retried step: those of a failed one not applied
            # yet; or the backward that completed the step did not run them): the program's
            # update actions of the groups still to update, issued now
            skipped = self._issue_step_phase(v, retry=True)
            if skipped is not None:
                return skipped
        return self._finish_step()

    def _issue_step_phase(self, v: Variant, retry: bool = False) -> bool | None:
        """Issue the step phase of a program whose updates run in ``step()`` (``overlap_update=
        False``: :data:`~shfx.passes.features.UPDATES_IN_STEP`): the gate ``CK0`` (waited for:
        with clipping the total norm and coefficient), or the finite check of every gradient, then
        the updates of the groups holding a gradient and not applied yet (a retried step), their
        unscales, copies, SSD transfers and all-gathers, and the refresh of the persistent stages.
        With ``retry`` (a program whose updates run in the backward, which issued none: a retried
        step), the program's update actions instead, for the same groups (no gate: clipped steps
        are :meth:`_clipped_step`'s). Their tokens go to ``pending_updates`` for
        :meth:`_finish_step`; returns False for a skipped step, None otherwise."""
        eng = self.engine
        program = v.train
        clipping = not retry and (eng.clipping.clip is not None or eng.clipping.clipped is not None)
        if clipping:
            self._wait_norms()
        eng.pending_updates.clear()
        eng.last_step_skipped = False
        done = eng.journal.applied  # a retried step: the updates that ran before it failed
        dev = v.device_groups
        host = {gi for gi, g in enumerate(eng.store.groups) if g.trainable_bytes and gi not in dev
                and eng.store.grad_state[gi] == GRAD_VALID and ("host", gi) not in done}  # fmt: skip
        device = {gi for gi in dev if eng.gradients.device_state.get(gi, GRAD_NONE) == GRAD_VALID and ("device", gi) not in done}
        for gi in sorted(device):
            if eng.loaded is not v or v.owner_of[gi] not in program.persistent:
                raise UsageError(
                    f"group {gi} is updated on the device while its stage is resident, and it is not now: "
                    "its gradient is gone with the slot. Run the step again from the forward."
                )
        phase = StepPhase(v)
        if retry:
            nodes = [n for n in program.nodes if KINDS[get_meta(n).kind].update and get_meta(n).phase != "step"]
        else:
            nodes = program.phase_nodes("step")
        gate = [n for n in nodes if get_meta(n).kind in (ActionKind.NORM_REDUCE, ActionKind.CHECK)]
        if clipping:
            skipped = self._pass_gate(phase, program, gate)
            if skipped is not None:
                return skipped
        elif eng.check_finite:
            reduce = [n for n in gate if get_meta(n).kind == ActionKind.NORM_REDUCE]
            if reduce:  # data parallel: every rank's finite check, agreed (NR0)
                bad = self._agreed_nonfinite(phase, program, reduce)
            else:
                dev_slots = [(gi, program.persistent.index(v.owner_of[gi])) for gi in sorted(device)]
                bad = self._first_nonfinite(v, sorted(host), dev_slots)
            if bad is not None:
                if eng.skip_nonfinite:
                    return self._skip_step()  # every gradient is known: nothing has run
                raise self._nonfinite_error(bad, [], [])
        wanted = []
        for n in nodes:
            m = get_meta(n)
            if m.kind in (ActionKind.CHECK, ActionKind.GRAD_NORM) or (m.kind == ActionKind.NORM_REDUCE and m.phase == "step"):
                continue  # (the gate, passed above; an overlapped step's verdict NR0 is issued again with a retry)
            if m.kind == ActionKind.DEVICE_STEP and m.stage not in device:
                continue
            if m.kind in _HOST_GROUP_KINDS and m.stage not in host:
                continue
            wanted.append(n)
        eng.step_checked = False
        try:
            issued = eng.issue(phase, program, wanted, cold=False, skip_updates=False)
        finally:
            eng.step_checked = None
            eng.clip_coef = None
        eng.pending_updates = [(str(get_meta(n).action), tok) for n, tok in issued]
        return None

    def _pass_gate(self, phase: StepPhase, program: Program, gate: list[fx.Node]) -> bool | None:
        """Issue the step's gate (``NR0``, ``CK0``) and wait for it (a failure raises naming it);
        then the total norm decides: a skipped step returns False (``skip_nonfinite``) or raises,
        otherwise the clip coefficient is set for the clipped updates and None is returned."""
        eng = self.engine
        self._issue_gate(phase, program, gate)
        eng.pending_updates.clear()
        max_norm, total = eng.clipping.gate
        eng.clipping.gate = None
        skipped = self._begin_clipped(total)
        if skipped is not None:
            return skipped
        eng.clip_coef = Clipping.coefficient(max_norm, total)
        return None

    def _issue_gate(self, phase: StepPhase, program: Program, gate: list[fx.Node]) -> None:
        """Issue ``gate`` (``NR0``, ``CK0`` or both) and wait for it; a failure raises naming it.
        Their tokens do not stay in ``pending_updates`` (what the backward left there does)."""
        eng = self.engine
        issued = eng.issue(phase, program, gate, cold=False, skip_updates=False)
        mine = {id(tok) for _, tok in issued}
        eng.pending_updates[:] = [(label, tok) for label, tok in eng.pending_updates if id(tok) not in mine]
        for _, tok in issued:
            tok.wait()
        self._raise_gate_failure(issued)

    def _agreed_nonfinite(self, phase: StepPhase, program: Program, reduce: list[fx.Node]) -> NonFiniteGradient | None:
        """Data parallel, a step not clipped: ``NR0`` agrees every rank's finite check (before
        any update); the error of the first rank's first non-finite gradient, or None."""
        eng = self.engine
        eng.clipping.nonfinite = None
        self._issue_gate(phase, program, reduce)
        bad, eng.clipping.nonfinite = eng.clipping.nonfinite or [], None
        if not bad:
            return None
        rank, group = bad[0]
        return NonFiniteGradient(
            f"the gradient of {self.handlers.whose(group, 'host')} holds inf or NaN in the shard of rank {rank} of "
            f"{eng.dp.ranks} (every rank's check agreed by NR0: all ranks skip or fail this step)", group,
        )  # fmt: skip

    def _raise_gate_failure(self, issued: list[tuple[fx.Node, Token]]) -> None:
        """A failed ``NR0``/``CK0``: nothing was applied, the gradients stay; raise naming it."""
        eng = self.engine
        failed = [(str(get_meta(n).action), tok) for n, tok in issued if tok.error is not None]
        if not failed:
            return
        label, tok = failed[0]
        err = root_cause(tok.error)
        eng.clipping.grad_norms.clear()
        eng.drop_step_clock()
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        what = "gradient norms' (or finite checks') reduction across ranks" if label.startswith("NR") else "gate (total gradient norm)"
        e = ActionError(f"the step's {what} {label} failed: {type(err).__name__}: {err}", label)
        raise with_note(e, state_note("step", [], [], gradients="kept")) from err

    def _finish_step(self) -> bool:
        """Wait for the step's updates (``pending_updates``), then commit, or undo and raise."""
        eng = self.engine
        pending, eng.pending_updates = eng.pending_updates, []
        interrupt: BaseException | None = None
        try:
            with self.failures.deferred_interrupt(abandon=eng.journal.enabled):
                for _, tok in pending:
                    tok.wait()
            if self.failures.interrupted:
                raise KeyboardInterrupt
        except BaseException as e:  # an interrupt while waiting
            if eng.journal.enabled:  # skip what has not started, then undo the rest (below)
                self.failures.quiesce([t for _, t in pending])
            else:  # the updates cannot be undone: let them all finish, then raise
                for _, tok in pending:
                    tok.wait()
                if all(tok.error is None for _, tok in pending):
                    eng.journal.commit()
                    eng.backward_calls = 0
                    eng.end_step_clock()
                    raise with_note(e, "The interrupt came during cm.step(); shfx finished its updates first: the "
                                     "step is applied and the state is consistent.") from None
            interrupt = e
        causes = [(label, root_cause(tok.error)) for label, tok in pending if tok.error is not None]
        causes += self._device_nonfinite()
        nonfinite = [(label, e) for label, e in causes if isinstance(e, NonFiniteGradient)]
        real = [(label, e) for label, e in causes if not isinstance(e, (NonFiniteGradient, Cancelled, DependencyFailed))]
        agreed, gathered = False, []
        verdict = next((tok for label, tok in pending if label == "NR0"), None)
        if verdict is not None and interrupt is None:  # data parallel, rollback, the overlap: every rank's outcome
            agreed, gathered, nonfinite, real = self._agreed_outcome(verdict, pending, nonfinite, real)
        if interrupt is None:
            interrupt = next((e for _, e in real if isinstance(e, (KeyboardInterrupt, SystemExit))), None)
        if interrupt is not None or real:
            restored, applied = self.failures.undo_step(agreed=agreed, gathered=gathered)
            retry = self._gradients_survive()
            if not retry:
                self.failures.clear_grads()
            eng.drop_step_clock()
            note = state_note("step", restored, applied, gradients="kept" if retry else "cleared", unagreed=self.failures.unagreed)
            if interrupt is not None:
                raise with_note(interrupt, note)
            label, err = real[0]
            if isinstance(err, OutOfDeviceMemory):
                e = oom_in(err, f"the optimizer update {label}")
            else:
                what = {
                    "DU": "device optimizer update", "SR": "SSD read of optimizer states",
                    "SW": "SSD write of optimizer states", "AG": "data-parallel all-gather of the updated weights",
                    "PF": "refresh of a persistent stage's weights", "SN": "rollback copy before the optimizer update",
                    "US": "unscale of the fp16 gradient before the optimizer update",
                }  # fmt: skip
                e = ActionError(f"{what.get(label[:2], 'host optimizer update')} {label} failed: {type(err).__name__}: {err}", label)
            raise with_note(e, note) from err
        if nonfinite:
            if not eng.skip_nonfinite:
                restored, applied = self.failures.undo_step(agreed=agreed, gathered=gathered)
                raise self._nonfinite_error(nonfinite[0][1], restored, applied)
            if eng.journal.enabled:
                self.failures.undo_step(agreed=agreed, gathered=gathered)
            elif eng.journal.applied:  # pragma: no cover - refused at compile (skip_nonfinite needs rollback)
                raise AssertionError("a non-finite step was partly applied without rollback")
            return self._skip_step()
        eng.journal.commit()
        eng.backward_calls = 0
        eng.end_step_clock()
        if eng.scaler is not None:
            eng.scaler.update(False)
        return True

    def _agreed_outcome(self, verdict: Token, pending: list, nonfinite: list, real: list) -> tuple[bool, list[int], list, list]:
        """An overlapped step with rollback under data parallel, its verdict ``NR0`` done
        (:meth:`~shfx.runtime.clipping.Clipping.agree_outcome`): whether every rank agreed the
        outcome (``NR0`` ran, and no rank's all-gather failed), the groups all-gathered this step
        (the same on every rank: an undo rebuilds their images), and the step's non-finite
        gradients and failures, every rank's: a rank that saw no inf in its own shard, or whose
        own updates ran, undoes the step all the same, and says which rank's shard or update."""
        eng = self.engine
        outcome, eng.clipping.outcome = eng.clipping.outcome, None
        if verdict.error is not None or outcome is None or outcome["lost"]:
            return False, [], nonfinite, real
        gathered = sorted(int(label[2:]) for label, tok in pending if label.startswith("AG") and tok.error is None)
        n = eng.dp.ranks
        if outcome["failed"]:
            rank, g = outcome["failed"][0]
            if not real:  # another rank's update failed: every rank undoes the step and raises
                err = RuntimeError(
                    f"the optimizer update of {self.handlers.whose(g, 'host')} failed on rank {rank} of {n} (see that rank's "
                    "error); every rank's outcome was agreed by NR0, so every rank undoes the step"
                )
                real = [(f"U{g}", err)]
        elif outcome["nonfinite"]:
            rank, g = outcome["nonfinite"][0]
            nonfinite = [(f"U{g}", NonFiniteGradient(
                f"the gradient of {self.handlers.whose(g, 'host')} holds inf or NaN in the shard of rank {rank} of {n} "
                "(every rank's outcome agreed by NR0: all ranks undo this step)", g,
            ))]  # fmt: skip
        return True, gathered, nonfinite, real

    # ---- ZeRO-Offload's delayed update (shfx.runtime.delayed) ------------------------------------
    def _delayed_step(self) -> None:
        """DPU, from the program (the delayed-update pass, ``program.updates_delayed``): wait for
        the previous step's updates, run the step phase (the refresh of the persistent slots
        with the weights they wrote), then start the delayed phase (this step's updates of the
        groups holding a gradient, with their unscales, copies and SSD transfers) and return
        while they run: ``delayed`` holds their tokens, which the next step's gradient copies
        and anything reading the weights wait for."""
        eng = self.engine
        ran = self._finish_delayed_updates()
        eng.journal.commit()
        v = eng.current
        if v is not None:
            program = v.train
            if not program.updates_delayed:
                raise UsageError(
                    f"the model was compiled with a delayed update, but its program {program.name!r} has no delayed phase "
                    "(a policy's program must come from the delayed-update pass: shfx.passes.features.DELAYED_UPDATE)"
                )
            if ran and eng.loaded is v:
                self._refresh(v)
            host = {gi for gi, g in enumerate(eng.store.groups)
                    if g.trainable_bytes and gi not in v.device_groups and eng.store.grad_state[gi] == GRAD_VALID}  # fmt: skip
            nodes = [n for n in program.phase_nodes("delayed") if get_meta(n).stage in host or get_meta(n).kind not in _HOST_GROUP_KINDS]
            issued = eng.issue(StepPhase(v), program, nodes, cold=False, skip_updates=False)
            eng.pending_updates.clear()
            for n, tok in issued:
                m = get_meta(n)
                if m.kind == ActionKind.CPU_STEP:  # what a gradient copy into the group waits for
                    eng.delayed.running[m.stage] = tok
                else:
                    eng.delayed.others.append(tok)
        eng.backward_calls = 0
        eng.end_step_clock()

    def _finish_delayed_updates(self) -> bool:
        """Wait for the delayed updates; returns whether any ran. A failed one is undone (the
        journal) and raised, saying so; the slots are then reloaded before the next step."""
        eng = self.engine
        try:
            return eng.delayed.finish()
        except ActionError as e:
            eng.loaded = None
            restored, applied = self.failures.undo_step()
            raise with_note(e, state_note("delayed update", restored, applied, gradients="kept")) from e.__cause__

    def _refresh(self, v: Variant) -> None:
        """The program's step phase: the refresh of the persistent slots with the host weights
        the delayed updates wrote; waited for (a failure leaves the slots to reload)."""
        eng = self.engine
        program = v.train
        issued = eng.issue(StepPhase(v), program, program.phase_nodes("step"), cold=False, skip_updates=False)
        eng.pending_updates.clear()
        for _, tok in issued:
            tok.wait()
        errors = [root_cause(tok.error) for _, tok in issued if tok.error is not None]
        if errors:
            eng.loaded = None
            raise errors[0]

    def wait_delayed(self) -> None:
        """Wait for the delayed updates to reach the host weights (state_dict), leaving the
        device on the weights before them until the next step() refreshes it."""
        eng = self.engine
        try:
            eng.delayed.wait()
        except ActionError as e:
            eng.delayed.clear()
            eng.loaded = None
            restored, applied = self.failures.undo_step()
            raise with_note(e, state_note("delayed update", restored, applied, gradients="kept")) from e.__cause__

    def finish_delayed(self, refresh: bool = True) -> None:
        """Wait for the delayed updates; with ``refresh``, copy the updated weights into the
        persistent slots (the program's step phase; otherwise they reload before the next step)."""
        eng = self.engine
        if not self._finish_delayed_updates():
            return
        v = eng.loaded
        if v is None:
            return
        if not refresh or not v.train.updates_delayed:
            eng.loaded = None
            return
        self._refresh(v)

    # ---- exact global-norm gradient clipping (shfx.runtime.clipping) -----------------------------
    def _gated_step(self, v: Variant) -> bool:
        """step() of a program with a step phase (exact clipping, updates overlapped): the
        program's step phase (``NR0``, the gate ``CK0``) is issued and waited for; then its
        next-forward phase (every clipped ``U``, with their ``SR``/``SW``/``AG``) is started and
        step() returns: the next forward's prefetches wait for the updates of the groups they
        read (``eng.deferred``), and anything reading the weights first waits for them all."""
        eng = self.engine
        self.await_deferred()
        self._wait_norms()
        eng.pending_updates.clear()
        program = v.train
        phase = StepPhase(v)
        skipped = self._pass_gate(phase, program, program.phase_nodes("step"))
        if skipped is not None:
            return skipped
        eng.backward_calls = 0
        if eng.scaler is not None:
            eng.scaler.update(False)
        tail = eng.issue(phase, program, program.phase_nodes("next-forward"), cold=False, skip_updates=False)
        eng.pending_updates.clear()
        for n, tok in tail:
            m = get_meta(n)
            # what a prefetch of the group waits for (and, for a DU, the forward of its persistent stage)
            if m.kind in (ActionKind.CPU_STEP, ActionKind.GATHER_PARAMS, ActionKind.DEVICE_STEP):
                eng.deferred.running[m.stage] = tok
            else:
                eng.deferred.others.append(tok)
        eng.end_step_clock()
        return True

    def _clipped_step(self) -> bool:
        """step() with clipping and the updates overlapped: the program's gate and deferred
        updates (:meth:`_gated_step`). (With ``overlap_update=False`` the updates-in-step program
        clips in its step phase: :meth:`_issue_step_phase`.) A program without the gate cannot
        clip: the configuration refuses it at compile time, and ``cm.clip_grad_norm_()`` after a
        backward that started its updates; before any forward there is nothing to update."""
        eng = self.engine
        v = eng.current
        if v is None:
            return self._finish_step()
        if not v.train.phase_nodes("step"):
            raise UsageError(
                f"step() with clipping, but program {v.train.name!r} has no gate (CK0) to clip at: its updates are not "
                "deferred behind the total norm. Compile with max_grad_norm=... (the exact-clipping pass) or "
                "overlap_update=False (the updates-in-step pass)"
            )
        return self._gated_step(v)

    def _begin_clipped(self, total: torch.Tensor) -> bool | None:
        """The common start of a clipped step once its total norm is known: the step's records
        reset; a non-finite total skips the step (``skip_nonfinite``: returns False) or fails it."""
        eng = self.engine
        clipping = eng.clipping
        eng.pending_updates.clear()
        clipping.clipped = None
        clipping.grad_norms.clear()
        clipping.last_grad_norm = total
        eng.last_step_skipped = False
        if not bool(torch.isfinite(total)):
            if eng.skip_nonfinite:
                return self._skip_step()
            if eng.check_finite:
                groups = self.handlers.clip_groups()
                err = NonFiniteGradient(f"the total gradient norm is {float(total)}", groups[0] if groups else -1)
                raise self._nonfinite_error(err, [], [])
        return None

    def await_deferred(self) -> None:
        """Wait for the clipped updates the last ``step()`` started (anything reading the weights
        between steps: ``state_dict``, ``sync``, an inference forward, ``close``, the next
        backward). A failed one rolls the step back (``rollback=True``) and drops the gradients
        (they were scaled), and raises saying so."""
        eng = self.engine
        if not eng.deferred:
            return
        pending = [(f"U{g}", tok) for g, tok in eng.deferred.running.items()]
        pending += [(tok.label or "?", tok) for tok in eng.deferred.others]
        eng.deferred.clear()
        for _, tok in pending:
            tok.wait()
        failed = [(label, tok) for label, tok in pending if tok.error is not None]
        if not failed:
            eng.journal.commit()
            return
        # the first failure that is not another's (an all-gather after a failed update)
        label, tok = next(((lb, t) for lb, t in failed if not isinstance(t.error, DependencyFailed)), failed[0])
        err = root_cause(tok.error)
        restored, applied = self.failures.undo_step()
        self.failures.clear_grads()
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        label = tok.label or label
        what = {"SR": "SSD read of optimizer states", "SW": "SSD write of optimizer states",
                "AG": "data-parallel all-gather of the updated weights"}.get(label[:2], "host optimizer update")  # fmt: skip
        e = ActionError(f"{what} {label} (clipped, started by step()) failed: {type(err).__name__}: {err}", label)
        raise with_note(e, state_note("step", restored, applied, gradients="cleared", unagreed=self.failures.unagreed)) from err

    def _wait_norms(self) -> None:
        """Wait for the GRAD_NORMs the backward started; a failure drops the step's gradients."""
        eng = self.engine
        for _, tok in eng.pending_updates:
            tok.wait()
        failed = [(label, tok) for label, tok in eng.pending_updates if tok.error is not None]
        if failed:
            eng.pending_updates.clear()
            eng.clipping.grad_norms.clear()
            label, tok = failed[0]
            err = root_cause(tok.error)
            self.failures.clear_grads()
            eng.drop_step_clock()
            e = ActionError(f"gradient norm {label} failed: {type(err).__name__}: {err}", label)
            raise with_note(e, state_note("step", [], [], gradients="cleared")) from err

    def total_grad_norm(self, norm_type: float) -> torch.Tensor:
        """The norm of every host gradient of the step, as ``torch.nn.utils.clip_grad_norm_``
        computes it over the model's parameters: waits for the GRAD_NORMs the backward started
        and computes the others now."""
        eng = self.engine
        self._wait_norms()
        return eng.clipping.total(self.handlers.clip_groups(), norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``cm.clip_grad_norm_``: the total norm of the step's gradients; ``step()`` scales them by
        ``min(max_norm / (total + 1e-6), 1)`` before its updates (as eager's clip, then step)."""
        eng = self.engine
        if eng.optimizer is None:
            raise UsageError("clip_grad_norm_() needs an optimizer: pass optimizer=shfx.optim.AdamW(...) to shfx.compile")
        if eng.dp is not None:
            return self._clip_across_ranks(float(max_norm), float(norm_type))
        total = self.total_grad_norm(float(norm_type))
        eng.clipping.clipped = (float(max_norm), total)
        return total

    def _clip_across_ranks(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """``cm.clip_grad_norm_`` under data parallel: this rank's shards' per-parameter norms,
        then the program's step gate issued now (``NR0``: the split parameters normed whole and
        one SUM all-reduce of the per-parameter norms; ``CK0``: the total), so every rank returns
        the same total, the norm of the reduced gradients as ``torch.nn.utils.clip_grad_norm_``
        computes it under DDP; ``step()`` then clips by it (its ``NR0`` agrees the finite check
        only). Every rank must call it, as every rank calls a collective."""
        eng = self.engine
        v = eng.current
        gate = [] if v is None else [
            n for n in v.train.phase_nodes("step") if get_meta(n).kind in (ActionKind.NORM_REDUCE, ActionKind.CHECK)
        ]  # fmt: skip
        if not any(get_meta(n).kind == ActionKind.NORM_REDUCE for n in gate):
            raise UsageError(
                "clip_grad_norm_() under data_parallel reduces the gradient norms across ranks through the program's step "
                f"gate (NR0, CK0), and {'no program ran yet' if v is None else repr(v.train.name) + ' has none'}: compile "
                "with overlap_update=False (updates in step()) or max_grad_norm=... (call it after loss.backward())"
            )
        self._wait_norms()
        clipping = eng.clipping
        clipping.grad_norms.clear()  # (a second call: those were reduced already)
        for gi in self.handlers.clip_groups():
            clipping.record(gi, norm_type)
        clipping.clipped = None
        clipping.requested = (max_norm, norm_type)
        try:
            self._issue_gate(StepPhase(v), v.train, gate)
        finally:
            clipping.requested = None
        gated, clipping.gate = clipping.gate, None
        clipping.clipped = gated
        return gated[1]

    # ---- non-finite gradients: skip (skip_nonfinite, fp16) or fail the step ----------------------
    def _first_nonfinite(
        self, v: Variant | None, groups: list[int], dev_groups: list[tuple[int, int]]
    ) -> NonFiniteGradient | None:
        """The error of the first gradient a step() would apply that holds inf or NaN, or None
        (checked before any update)."""
        eng = self.engine
        try:
            for gi in groups:
                require_finite(eng.store.grad(gi), gi, self.handlers.whose(gi, "host"))
            for gi, slot in dev_groups:
                require_finite(self.handlers.device_grad32(v, gi, slot), gi, self.handlers.whose(gi, "device"))
        except NonFiniteGradient as e:
            return e
        return None

    def _device_nonfinite(self) -> list[tuple[str, NonFiniteGradient]]:
        """The device-updated groups whose gradient held inf or NaN this step (their update was
        a no-op on the device, so it is not counted as applied): one host read for all flags."""
        eng = self.engine
        flags, eng.nonfinite_flags = eng.nonfinite_flags, {}
        if not flags:
            return []
        groups = sorted(flags)
        bad = torch.stack([flags[g] for g in groups]).cpu().tolist()
        out = []
        for g, b in zip(groups, bad):
            if b:
                eng.journal.applied.discard(("device", g))
                out.append((f"DU{g}", NonFiniteGradient(f"the gradient of {self.handlers.whose(g, 'device')} holds inf or NaN", g)))
        return out

    def _nonfinite_error(self, err: NonFiniteGradient, restored: list[int], applied: list[int]) -> NonFiniteGradient:
        """The error of a step whose gradient holds inf or NaN (``skip_nonfinite`` off): the step
        is dropped, the gradients stay for inspection."""
        eng = self.engine
        eng.journal.commit()
        eng.backward_calls = 0
        eng.drop_step_clock()
        if applied:
            state = (
                f"The updates of parameter groups {applied} had already run during backward (rollback is off: "
                "shfx.compile(rollback=True) makes a step all-or-nothing), so those groups are updated and the others "
                "are not; reload the last checkpoint to go on exactly."
            )
        else:
            state = "The step was not applied: " + (
                f"the updates that had run (parameter groups {restored}) were rolled back, so " if restored else ""
            ) + "the weights and optimizer states are exactly as before it."
        msg = (
            f"{err} after backward(): {state} The gradients are kept for inspection (.grad); call cm.zero_grad() "
            "and go on with the next batch, or lower the learning rate. To skip such steps instead of raising, "
            "compile with skip_nonfinite=True (or precision='fp16', which skips overflowing steps)."
        )
        return NonFiniteGradient(msg, err.group)

    def _skip_step(self) -> bool:
        """The step is not applied (a non-finite gradient); the gradients stay for the user."""
        eng = self.engine
        eng.journal.commit()
        eng.skipped_steps += 1
        eng.last_step_skipped = True
        if eng.scaler is not None:  # an overflow: back the scale off
            eng.scaler.update(True)
        eng.backward_calls = 0
        eng.end_step_clock()
        return False

    def _gradients_survive(self) -> bool:
        """Whether the step's gradients are all still where step() reads them: not when a group
        updated on the device lost its gradient with a transient slot."""
        eng = self.engine
        v = eng.current
        if v is None:
            return True
        return all(v.owner_of[g] in v.train.persistent for g in v.device_groups)

    # ---- between steps ---------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        eng = self.engine
        if eng.pending_updates:
            raise UsageError(
                "zero_grad() was called between backward() and step() while the update started by backward() is "
                "pending; call cm.step() first (or compile with overlap_update=False)"
            )
        if not set_to_none:
            self.await_deferred()  # zeroing the host gradients: the clipped updates read them
        eng.clipping.clipped = None
        eng.clipping.grad_norms.clear()
        if not eng.delayed and not eng.deferred:
            eng.journal.commit()  # a failed step's records: the user drops that step
        st = eng.store
        if not set_to_none:
            self.finish_delayed()  # zeroing the host gradients: the delayed updates read them
        for g in range(len(st.groups)):
            if set_to_none:
                st.grad_state[g] = GRAD_NONE
            elif g in st.paged:  # (the parameter tier: no gradient is kept between steps)
                st.grad_state[g] = GRAD_NONE
            elif st.grad_state[g] == GRAD_VALID or st.groups[g].trainable_bytes:
                st.grad(g).zero_()
                st.grad_state[g] = GRAD_VALID
        for g, keys in eng.param_keys_by_group.items():
            for _, p in keys:
                if set_to_none:
                    p.grad = None
        eng.gradients.reset_device()
        if not set_to_none:
            eng.expose_grads()
