"""The compile pipeline: a module, example inputs and options in, the compiled artefact out.

::

    nn.Module + example inputs
      │ capture          shfx.passes.capture.capture_model: torch.export training IR, one FX graph
      │ partition        shfx.passes.partition.partition_stages: stages, host groups, slot layouts
      │ retarget         shfx.passes.retarget.retarget_device (only for a device other than the CPU)
      │ choose           "auto" options of the policy resolved by the caller's chooser (the tuner)
      │ lower            shfx.passes.policies.lower_policy: the train program
      │ derive           shfx.passes.schedule: the inference program and the cold backward
      ▼ verify           shfx.passes.verify.verify_program on each program (or after every pass)
    Variant

``shfx.compile`` (one :class:`Variant` per input signature), the profiler (probe programs of
the same stages), the planner's ``memory_for_model`` and ``shfx.compare`` all build through
here. :func:`compile_variant` runs everything; :func:`with_policy` re-lowers an existing
variant's stages with another policy (no new capture).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .capture import Captured, DynamicDim, InputSignature, capture_model, capture_model_dynamic
from .layout import Group, dtype_name, precision_dtype
from .ledger import HostOptimizerStates, Ledger, host_terms, pool_sizes, replay
from .pinned import PinnedPlan
from .lowering import check_window, checked_stages
from .partition import StageGraph, partition_stages
from .policies import Policy, Stronghold, add_param_tier, least_image_window, resolve_policy
from .actions import ActionKind
from .meta import get_meta
from .program import Program, ScheduleError
from .features import feature_passes, run_passes
from .schedule import cold_backward_program, eval_program
from .stages import StageSpec
from .verify import verify_program

__all__ = ["PipelineOptions", "Variant", "compile_variant", "with_policy", "build_programs", "probe_policy", "probe_variant"]

Chooser = Callable[[Captured, StageGraph, Policy], "Policy | tuple[Policy, dict]"]


@dataclass(frozen=True)
class PipelineOptions:
    """What the pipeline needs to know, validated once.

    Attributes:
        policy: a :class:`~shfx.passes.policies.Policy` (its ``"auto"`` fields are resolved by
            a chooser), a registered name, or a function ``(stage_specs, window) -> Program``;
            after validation always a Policy (:func:`~shfx.passes.policies.resolve_policy`).
        window: the window, for a policy that has one (an int, or ``"auto"``: the tuner's).
        blocks, num_stages: how to partition (:func:`~shfx.passes.partition.partition_stages`).
        verify: check every program's invariants before it runs.
        verify_each_pass: check after every pass (the stage specs after partitioning, each
            program as soon as it is built), so a broken invariant names the pass.
        device: the device the stage graphs run on (``"cuda:0"``); None: the CPU (also the
            emulated device).
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` (mixed precision: the model is captured
            as its 16-bit copy, the device holds 16-bit parameters and gradients, the host the
            fp32 master weights; :func:`shfx.passes.layout.precision_dtype`).
        fp32_norms: in mixed precision, keep LayerNorm/RMSNorm parameters in fp32 on the device
            (:func:`shfx.passes.capture.cast_for_device`).
        plan_only: the programs are built to plan, simulate and compare, not to run (the
            planner, ``shfx compare``). (The NVMe tier runs since issue 12 part 3: it is no
            longer refused here; ``shfx.compile`` needs ``offload=shfx.Offload(...)`` for it.)
        ranks: data parallel: the processes running the programs, each with its own batch
            (:func:`~shfx.passes.schedule.data_parallel_program`); 1: none.
        updates_in_step: the updates run in ``step()`` (``overlap_update=False``): the
            updates-in-step feature pass (:data:`~shfx.passes.features.UPDATES_IN_STEP`).
        clip_in_step: with it, exact clipping there (``max_grad_norm`` with
            ``overlap_update=False``: ``GN`` during the backward, the gate in ``step()``).
        rollback: the step journal's copies before each host update (``SN g``), so a step can
            be undone: the rollback feature pass (:data:`~shfx.passes.features.ROLLBACK`).
        loss_scaling: fp16: each host gradient checked and unscaled by its own action (``US g``):
            the loss-scaling feature pass (:data:`~shfx.passes.features.LOSS_SCALING`).
        param_tier: ``Offload(params="nvme")``: the images, masters and gradients of the NVMe
            tier's groups on the SSD too (:func:`~shfx.passes.policies.add_param_tier`), with
            ``image_window`` host buffers for the images (None: the fewest the order needs, plus one;
            ``"auto"``: the tuner's choice, returned by the chooser).
        activations: activation offload (``Offload(activations=...)``): ``"device"`` (none),
            ``"host"`` (every eligible stage), ``"nvme"`` (every eligible stage, on the SSD) or a
            tuple of the stages chosen: the activation-offload feature pass
            (:data:`~shfx.passes.features.ACTIVATION_OFFLOAD`).
        activation_window: with ``activations="nvme"``, the host buffers the activations pass
            through (None: :data:`shfx.passes.activations.ACTIVATION_WINDOW`).
        optimizer: the host optimizer (:class:`shfx.optim.HostOptimizer`; not compared): the
            stage specs' ``ssd_state_bytes`` are sized by its states (``host_states``), what the
            NVMe tier's SSD reads and writes move (None: AdamW's m and v).
    """

    policy: Any = "stronghold"
    window: int | str | None = None
    blocks: Any = None
    num_stages: int | None = None
    verify: bool = True
    verify_each_pass: bool = False
    device: str | None = None
    precision: str = "fp32"
    fp32_norms: bool = False
    plan_only: bool = False
    ranks: int = 1
    updates_in_step: bool = False
    clip_in_step: bool = False
    rollback: bool = False
    loss_scaling: bool = False
    activations: Any = "device"
    activation_window: int | None = None
    param_tier: bool = False
    image_window: int | str | None = None
    optimizer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", dtype_name(precision_dtype(self.precision)))
        if isinstance(self.window, str) and self.window != "auto":
            raise ValueError(f"window must be an int >= 1 or 'auto', got {self.window!r}")
        if self.window is not None and self.window != "auto":
            check_window(self.window, 1 << 30)
        object.__setattr__(self, "policy", resolve_policy(self.policy, self.window))
        if self.num_stages is not None and (isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be an int >= 1 (data-parallel processes), got {self.ranks!r}")
        for name in ("verify", "verify_each_pass", "fp32_norms", "plan_only", "updates_in_step", "clip_in_step", "rollback", "loss_scaling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class Variant:
    """Everything compiled for one input signature: the capture, the stages and the programs.

    Attributes:
        signature: the input signature it was captured for.
        captured: the capture (FX graph, parameters, buffers, output structure).
        graph: the partitioned model.
        policy: the policy the programs were lowered from (its ``"auto"`` fields chosen), or the
            user's function.
        train, eval, cold: the training step, the inference forward and the cold backward.
        passes: the passes that built it, in order (provenance).
    """

    signature: InputSignature | None
    captured: Captured | None
    graph: StageGraph
    policy: Any
    train: Program
    eval: Program
    cold: Program
    passes: tuple[str, ...] = field(default=())
    journaled: bool = False  # (rollback: the step journal copies before each update, device ones too)

    @property
    def programs(self) -> tuple[Program, Program, Program]:
        return (self.train, self.eval, self.cold)

    @functools.cached_property
    def device_groups(self) -> frozenset[int]:
        """Groups updated on the device by this variant's programs."""
        return frozenset(self.train.device_groups())

    @functools.cached_property
    def owner_of(self) -> dict[int, int]:
        """Group -> the stage that owns it (its update's stage)."""
        return {st.spec.update_group: st.index for st in self.graph.stages if st.spec.update_group is not None}

    @functools.cached_property
    def grad_buffer_sizes(self) -> list[int]:
        """Bytes of each slot's device gradient buffer (:func:`shfx.passes.ledger.pool_sizes`)."""
        return list(pool_sizes(self.programs)[1])

    @functools.cached_property
    def slot_sizes(self) -> list[int]:
        """Bytes per slot that any of the variant's programs needs (:func:`shfx.passes.ledger.pool_sizes`)."""
        return list(pool_sizes(self.programs)[0])

    def ledger(
        self, grad_accum_steps: int = 1, rollback: bool | None = None, rank: int = 0, optimizer: HostOptimizerStates | None = None,
        pinned: PinnedPlan | None = None,
    ) -> Ledger:
        """The memory ledger of one training step (:func:`shfx.passes.ledger.replay`): the setup
        for all three programs, then the train program; under data parallel, of rank ``rank``
        (its host shards). ``optimizer``: the host optimizer's states (default AdamW's; a
        compiled model's: ``cm.optimizer.host_states(variant.graph.groups)``). ``rollback``:
        count the step journal's copies (default: whether this variant was compiled with
        rollback, :attr:`journaled`: a device update copies inside its own action, so its
        program has no ``SN`` that says so). ``pinned``: the pinned pool's plan (a compiled
        model's: ``cm.backend.pinned.plan``), for the ``"pinned"`` tier."""
        return replay(
            self.train, programs=self.programs, group_bytes=[g.host_master_bytes for g in self.graph.groups],
            grad_accum_steps=grad_accum_steps, rollback=self.journaled if rollback is None else rollback, working_bytes=[g.working_bytes for g in self.graph.groups],
            rank=rank, optimizer=optimizer, pinned=pinned,
        )  # fmt: skip

    def staging_buffers(self, grad_accum_steps: int = 1) -> int:
        """Host staging buffers the ledger counts for this variant in one process (the runtime
        allocates them up front: ``HostStore.ensure_staging``); under data parallel the local
        gradients' buffers are counted and allocated apart (0 here)."""
        if self.train.ranks > 1:
            return 0
        terms = host_terms(
            self.train.stages, set().union(*(p.device_groups() for p in self.programs)),
            group_bytes=[g.host_master_bytes for g in self.graph.groups], grad_accum_steps=grad_accum_steps,
            working_bytes=[g.working_bytes for g in self.graph.groups], **self.train.tier,
        )  # fmt: skip
        return sum(1 for c in terms if c.term == "gradient staging (pinned)")


def build_programs(
    specs: Sequence[StageSpec], policy: Policy, *, verify: bool = True, ranks: int = 1, updates_in_step: bool = False,
    clip_in_step: bool = False, rollback: bool = False, loss_scaling: bool = False, activations: Any = "device",
    activation_window: int | None = None, param_tier: bool = False,
    image_window: int | None = None, masters: bool = False,
) -> tuple[Program, Program, Program]:  # fmt: skip
    """The train program of ``policy`` for ``specs`` (run by ``ranks`` data-parallel processes:
    :func:`~shfx.passes.schedule.data_parallel_program`) and its derived inference and
    cold-backward programs, each verified (``verify``)."""
    # the feature passes after the policy's lowering (shfx.passes.features): each checks what it
    # requires and ensures (exact clipping is the policy's deferred update: the same pass)
    train = policy.program(specs)
    if param_tier:  # (Offload(params="nvme"): before the features, which keep its actions)
        train = add_param_tier(train, image_window, masters=masters)
    # (ZeRO-Offload's delayed update runs its updates during the next step: nothing to move into step())
    in_step = updates_in_step and not (train.updates_outside or train.updates_delayed)
    passes = feature_passes(
        ranks=ranks, updates_in_step=in_step, clip=clip_in_step and in_step, rollback=rollback, loss_scaling=loss_scaling,
        activations=activations, activation_window=activation_window or 0,
    )  # fmt: skip
    train = run_passes(train, passes, verify=verify_program if verify else None)
    if verify:
        verify_program(train, "train")
    ev, cold = eval_program(train), cold_backward_program(train)
    if verify:
        verify_program(ev, "eval")
        verify_program(cold, "backward")
    return train, ev, cold


def size_optimizer_states(graph: StageGraph, optimizer: Any) -> None:
    """Each owner's ``StageSpec.ssd_state_bytes``: the bytes of its group's states under
    ``optimizer`` (its ``host_states``: per-element states times the state bytes, plus the
    states that are not per element), what an SSD read or write of the NVMe tier moves."""
    states = optimizer.host_states(graph.groups)
    for i, st in enumerate(graph.stages):
        g = st.spec.update_group
        if g is not None:
            nbytes = states.per_element * st.spec.state_bytes + states.whole_bytes(g)
            graph.stages[i] = dataclasses.replace(st, spec=dataclasses.replace(st.spec, ssd_state_bytes=nbytes))


def _check_specs(specs: Sequence[StageSpec]) -> None:
    """After partitioning: stages indexed 0..n-1, producers earlier, every trainable group
    updated by exactly one stage."""
    checked_stages(specs)
    owners: dict[int, int] = {}
    for s in specs:
        if s.update_group is not None:
            if s.update_group in owners:
                raise ScheduleError(f"group {s.update_group} is updated by stages {owners[s.update_group]} and {s.index}")
            owners[s.update_group] = s.index
    for s in specs:
        for g in s.grad_groups:
            if g not in owners:
                raise ScheduleError(f"stage {s.index} ({s.name!r}) sends gradients to group {g}, which no stage updates")


def feature_options(program: Program) -> dict[str, bool]:
    """The feature passes a train program was built with, as :func:`build_programs`'s options
    (``updates_in_step``, ``clip_in_step``, ``rollback``, ``loss_scaling``): read from the program
    itself, so another policy (the profiler's probe, the planner, the tuner's candidates) gets
    the same features."""
    kinds = {get_meta(n).kind for n in program.nodes}
    return {
        "updates_in_step": program.updates_in_step,
        "clip_in_step": program.updates_in_step and ActionKind.GRAD_NORM in kinds,
        "rollback": ActionKind.SNAPSHOT in kinds,
        "loss_scaling": ActionKind.UNSCALE in kinds,
        "activations": (
            "nvme" if ActionKind.ACTIVATION_WRITE in kinds else "host" if ActionKind.OFFLOAD_ACTIVATIONS in kinds else "device"
        ),
        "activation_window": program.activation_window or None,
        "param_tier": bool(program.ssd_images),
        "image_window": program.image_window or None,
        "masters": bool(program.ssd_images) and program.ssd_masters,
    }


def candidate_passes(program: Program) -> list:
    """The feature passes (one rank) that made ``program`` out of its policy's lowering, for
    the tuner to run on each candidate policy before timing it (it then prices the program that
    will run: updates in ``step()``, the journal's copies, fp16's unscales)."""
    o = feature_options(program)
    return feature_passes(
        updates_in_step=o["updates_in_step"], clip=o["clip_in_step"], rollback=o["rollback"], loss_scaling=o["loss_scaling"],
        activations=o["activations"], activation_window=o["activation_window"] or 0,
    )  # fmt: skip


def with_policy(
    variant: Variant, policy: Policy | str, *, verify: bool = True, ranks: int | None = None, image_window: Any = "same"
) -> Variant:
    """The same stages lowered with another policy (a probe program for the profiler, another
    policy for the planner): no new capture. ``ranks``: data-parallel processes (None: the
    variant's own). ``image_window``: the parameter tier's image buffers (default the variant's)."""
    pol = resolve_policy(policy)
    ranks = variant.train.ranks if ranks is None else ranks
    opts = feature_options(variant.train)
    if image_window != "same":
        opts["image_window"] = image_window
    train, ev, cold = build_programs(variant.graph.specs, pol, verify=verify, ranks=ranks, **opts)
    done = tuple(p for p in variant.passes if p in ("capture", "capture-dynamic", "partition", "retarget"))
    return dataclasses.replace(variant, policy=pol, train=train, eval=ev, cold=cold, passes=done + ("lower", "derive"))


def probe_policy(policy: Any, param_tier: bool) -> Policy:
    """The policy of the profiler's probe programs (one stage on the device at a time) for a
    training with ``policy``: ``Stronghold(window=1)``; with the parameter tier the same groups
    on the SSD as ``policy``'s (its ``resident_first``) and the NVMe tier with one host-window
    buffer: the least host memory any training of the tier holds, so the profile needs none the
    training does not."""
    if not param_tier:
        return Stronghold(window=1)
    k = getattr(policy, "resident_first", 0)
    return Stronghold(window=1, resident_first=k if isinstance(k, int) else 0, nvme=True, host_window=1)


def probe_variant(variant: Variant, window: int = 1, *, ranks: int | None = 1, verify: bool = True) -> Variant:
    """``variant``'s stages under :func:`probe_policy` with ``window`` (the profiler's probes:
    1, and 2 for its pipelined compute step), with the same features; with the parameter tier
    the fewest image buffers the probe's order needs
    (:func:`~shfx.passes.policies.least_image_window`)."""
    tier = bool(variant.train.ssd_images)
    pol = probe_policy(variant.policy, tier).replace(window=window)
    if not tier:
        return with_policy(variant, pol, verify=verify, ranks=ranks)
    return with_policy(variant, pol, verify=verify, ranks=ranks, image_window=least_image_window(pol.program(variant.graph.specs)))


def compile_variant(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None,
    options: PipelineOptions,
    *,
    groups: Sequence[Group] | None = None,
    choose: Chooser | None = None,
    dynamic: Sequence[DynamicDim] | None = None,
) -> Variant:
    """Run the pipeline (see the module docstring) on ``module(*args, **kwargs)``.

    ``groups``: the host layout of an earlier capture of the same model (its tensors keep their
    owners). ``choose(captured, graph, policy)`` returns the policy with its ``"auto"`` fields
    chosen (the tuner, which needs the model on a device), or ``(policy, options)`` with build
    options it chose too (the parameter tier's ``image_window`` when ``"auto"``); without it an
    ``"auto"`` policy is an error.

    ``dynamic``: capture these dimensions dynamic (:func:`~shfx.passes.capture.capture_model_dynamic`:
    one graph for every size in their ranges, byte counts at the largest); it raises
    :class:`~shfx.passes.capture.DynamicCaptureError` when torch.export cannot keep them dynamic."""
    passes: list[str] = []
    working = precision_dtype(options.precision)
    wd = None if working == torch.float32 else working
    if dynamic:
        captured = capture_model_dynamic(module, args, kwargs or {}, dynamic, working_dtype=wd, fp32_norms=options.fp32_norms)
        passes.append("capture-dynamic")
    else:
        captured = capture_model(module, args, kwargs or {}, working_dtype=wd, fp32_norms=options.fp32_norms)
        passes.append("capture")
    graph = partition_stages(captured, blocks=options.blocks, num_stages=options.num_stages, groups=groups, model=module)
    passes.append("partition")
    if options.optimizer is not None:
        size_optimizer_states(graph, options.optimizer)
    if options.verify_each_pass:
        _check_specs(graph.specs)
    if options.device is not None and torch.device(options.device).type != "cpu":
        from .retarget import retarget_device

        for st in graph.stages:
            st.gm = retarget_device(st.gm, options.device)
        passes.append("retarget")
    policy = options.policy
    if policy.auto or options.image_window == "auto":
        if choose is None:
            auto = list(policy.auto) + (["image_window"] if options.image_window == "auto" else [])
            raise ScheduleError(f"{policy!r} leaves {', '.join(auto)} to the tuner, and no chooser was given")
        chosen = choose(captured, graph, policy)
        if isinstance(chosen, tuple):  # (the policy and the build options the tuner chose: the tier's image_window)
            policy, extra = chosen
            options = dataclasses.replace(options, **extra)
        else:
            policy = chosen
        passes.append("choose")
    verify = options.verify or options.verify_each_pass
    train, ev, cold = build_programs(
        graph.specs, policy, verify=verify, ranks=options.ranks, updates_in_step=options.updates_in_step,
        clip_in_step=options.clip_in_step, rollback=options.rollback, loss_scaling=options.loss_scaling,
        activations=options.activations, activation_window=options.activation_window, param_tier=options.param_tier, image_window=options.image_window, masters=options.param_tier and working != torch.float32,
    )  # fmt: skip
    passes += ["lower", "derive"] + (["verify"] if verify else [])
    return Variant(captured.signature, captured, graph, policy, train, ev, cold, tuple(passes), journaled=options.rollback)
