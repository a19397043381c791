"""The step time of ``stronghold``'s plan rows, the tiers beyond host RAM included (issue 26).

The planner (:mod:`shfx.cost_model.planner`) says whether a GPT fits; this module says how long
one step of it takes on a hardware profile with the analytic model (nothing runs), for the rows
``shfx plan`` prints for ``stronghold``:

- ``None``: everything in host RAM (``stronghold``);
- ``"nvme"``: shfx's NVMe tier, AdamW m and v on the SSD (``stronghold+nvme``; with
  ``nvme_masters`` the fp32 master too);
- ``"nvme-all"``: parameters, gradients and optimizer states on the SSD, the host holding
  windows (``stronghold+nvme-all``; ``shfx.Offload(params="nvme", gradients="nvme",
  optimizer="nvme", host_budget=...)``);
- ``"nvme-all+act-host"``, ``"nvme-all+act-nvme"``: and the checkpointed boundary activations
  offloaded to host RAM or the SSD (``Offload(activations="host"|"nvme")``).

The step is the longer of two times:

- ``pipeline_s``: :func:`shfx.cost_model.formulas.forward_time_gpt` +
  :func:`~shfx.cost_model.formulas.backward_time_gpt` (the window schedule's closed form, exact
  under the simulator's model with full-duplex links) over the stage times of
  :func:`~shfx.cost_model.formulas.gpt_stage_times`: compute at the profile's matmul rate,
  prefetches and gradient copies over PCIe, host AdamW updates over host memory bandwidth. With
  activation offload a block's (and the head's) FORWARD lasts at least its output's copy to the
  host (the d2h stream is otherwise idle in forward), and a block's backward PREFETCH also
  brings its checkpoint back (the same h2d stream).
- ``ssd_s``: :func:`shfx.cost_model.analytic.ssd_bound_s` of the step's SSD bytes
  (:func:`step_traffic`), the drive's least time for them (reads and writes sharing it by the
  profile's ``ssd_duplex``).

Taking the longer assumes the SSD traffic overlaps the pipeline (reads ahead and writes back
on their own queues, as the tier's programs issue them), so it is a lower bound where they do
not overlap.

What it does not model: per-request SSD latency; the
host memory bandwidth the SSD's DMA and the window copies take from the optimizer; coupled
PCIe directions (``duplex``); pageable copies (everything is assumed pinned).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy as sp

from .analytic import links_of, ssd_bound_s
from .formulas import backward_time_gpt, flops_per_iteration, forward_time_gpt, gpt_stage_times, stage_param_counts
from .hardware import Hardware, get_profile
from .shapes import GPTShape

__all__ = ["TIERS", "StepTraffic", "TierStep", "step_traffic", "tier_step", "PublishedFigure", "LOHAN_175B"]

TIERS = (None, "nvme", "nvme-all", "nvme-all+act-host", "nvme-all+act-nvme")
"""The tiers :func:`tier_step` knows (``None``: everything in host RAM)."""


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one step moves over each link, and the SSD's by what they are.

    Attributes:
        h2d_bytes, d2h_bytes: over PCIe, to and from the device.
        ssd_read_bytes, ssd_write_bytes: from and to the SSD.
        ssd: what -> ``(read, write)`` bytes (``image``, ``master, m, v``, ``gradients``,
            ``activations``).
    """

    h2d_bytes: int
    d2h_bytes: int
    ssd_read_bytes: int
    ssd_write_bytes: int
    ssd: dict = field(default_factory=dict)


def _check_tier(tier: str | None) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {', '.join(map(str, TIERS))}")


def step_traffic(
    family: GPTShape, tier: str | None = None, *, window: int = 2, overlap_updates: bool = True, nvme_masters: bool = False
) -> StepTraffic:  # fmt: skip
    """The bytes one training step of ``family`` (at ``family.layers``) moves with ``tier``.

    ``P_slot``, ``P_grad``, ``P_own``: the parameters a stage's slot holds, sends back as
    gradients and updates (:func:`shfx.cost_model.formulas.stage_param_counts`, summed over the
    head, the blocks and the tail); ``e`` bytes per element on the device (2 in 16-bit, 4 fp32),
    ``A = b s h e`` one boundary activation.

    - PCIe: each stage's prefetch in the forward and again in the backward but for the ``window``
      stages still resident at the turn (the tail and the last blocks), ``e P_slot`` each, to the
      device; its gradients, ``4 P`` for a group cast to fp32 on the device and ``e P`` for the
      tied embedding's (as :func:`~shfx.cost_model.formulas.gpt_stage_times` charges them), from
      it. Activation offload: the inputs the offloaded stages' backwards need, ``8 b s + (l - 1) A``
      (the head's token ids, the first ``l - 1`` blocks' checkpoints), each way.
    - SSD, ``"nvme"``: m and v read and written by each update, ``8 P_own`` each way (``12``
      with ``nvme_masters``).
    - SSD, ``"nvme-all"`` (the programs' ``PR``/``PW``/``SR``/``SW``, :func:`shfx.passes.policies.add_param_tier`):
      each paged group's image (the blocks' and the tail's own, ``P_paged``; the tied head's stays
      in RAM) read twice, for the forward's prefetch and for the backward's prefetch and update,
      and written once after the update, ``2 e P_paged`` and ``e P_paged``; every group's m and
      v (and, in mixed precision, fp32 master: in fp32 the image is the master) read and
      written by its update, ``8 P_own`` (``12``) each way. The gradient lands in the group's
      host-window buffer and is used by the update in the same step (LoHan's active gradient
      offloading); with ``overlap_updates=False`` it is written to the SSD after the backward
      and read back by the update, ``4 P_own`` each way. ``+act-nvme``: the same bytes each way.

    >>> t = step_traffic(GPTShape(layers=2, hidden=64, heads=2, seq=16, vocab=128, precision="bf16"), "nvme-all")
    >>> t.ssd["master, m, v"][0] == 12 * (2 * (12 * 64**2 + 13 * 64) + (128 + 16) * 64 + 2 * 64)
    True
    >>> t.ssd["image"] == (2 * 2 * (2 * (12 * 64**2 + 13 * 64) + 2 * 64), 2 * (2 * (12 * 64**2 + 13 * 64) + 2 * 64))
    True
    """
    _check_tier(tier)
    L, h, s, b, V = family.layers, family.hidden, family.seq, family.batch, family.vocab
    e = family.param_bytes
    counts = stage_param_counts(h, s, V)
    mult = {"head": 1, "block": L, "tail": 1}
    slot = sum(counts[k]["slot"] * c for k, c in mult.items())
    resident = min(window, L + 2)  # (not prefetched again in the backward)
    kept = counts["tail"]["slot"] + min(resident - 1, L) * counts["block"]["slot"] + (counts["head"]["slot"] if resident == L + 2 else 0)
    own = sum(counts[k]["own"] * c for k, c in mult.items())
    # (mixed precision: a group nothing borrows from sends its gradient cast to fp32; the tied
    # embedding's travels in the device dtype: gpt_stage_times' og)
    cast = {k: 0 if (e == 4 or k == "head") else counts[k]["own"] for k in mult}
    grads = sum((4 * cast[k] + e * (counts[k]["grad"] - cast[k])) * c for k, c in mult.items())
    A = b * s * h * e
    acts = 8 * b * s + (L - 1) * A if tier and "+act-" in tier else 0  # (the offloaded inputs: memory_model's)
    ssd: dict[str, tuple[int, int]] = {}
    if tier == "nvme":
        per = 12 if nvme_masters else 8
        ssd["master, m, v" if nvme_masters else "m, v"] = (per * own, per * own)
    elif tier and tier.startswith("nvme-all"):
        paged = sum(counts[k]["own"] * c for k, c in mult.items() if k != "head")  # (the tied head's image stays in RAM)
        ssd["image"] = (2 * e * paged, e * paged)
        ssd["master, m, v" if family.mixed else "m, v"] = (12 * own, 12 * own) if family.mixed else (8 * own, 8 * own)
        if not overlap_updates:
            ssd["gradients"] = (4 * own, 4 * own)
        if tier.endswith("act-nvme"):
            ssd["activations"] = (acts, acts)
    return StepTraffic(
        h2d_bytes=e * (2 * slot - kept) + acts,
        d2h_bytes=grads + acts,
        ssd_read_bytes=sum(r for r, _ in ssd.values()),
        ssd_write_bytes=sum(w for _, w in ssd.values()),
        ssd=ssd,
    )


@dataclass(frozen=True)
class TierStep:
    """One predicted step (:func:`tier_step`).

    Attributes:
        tier: the tier (``None``: everything in host RAM).
        layers, params: the model's size.
        traffic: the bytes it moves (:func:`step_traffic`).
        compute_s: the device's FORWARDs and BACKWARDs (recompute included) at the profile's rate.
        h2d_s, d2h_s: the PCIe bytes alone at the link's one-way rate.
        host_update_s: the host AdamW updates (one worker).
        ssd_s: the SSD's least time for its bytes (:func:`~shfx.cost_model.analytic.ssd_bound_s`).
        pipeline_s: the window schedule's step without the SSD (compute, PCIe, host updates).
        step_s: ``max(pipeline_s, ssd_s)``.
        bottleneck: the resource with the longest busy time (``compute``, ``h2d``, ``d2h``,
            ``host update``, ``ssd``).
    """

    tier: str | None
    layers: int
    params: int
    traffic: StepTraffic
    compute_s: float
    h2d_s: float
    d2h_s: float
    host_update_s: float
    ssd_s: float
    pipeline_s: float
    step_s: float
    bottleneck: str

    @property
    def resources(self) -> dict[str, float]:
        """Busy seconds per resource (each a lower bound on the step)."""
        return {"compute": self.compute_s, "h2d": self.h2d_s, "d2h": self.d2h_s, "host update": self.host_update_s, "ssd": self.ssd_s}

    def tokens_per_s(self, family: GPTShape) -> float:
        return family.batch * family.seq / self.step_s

    def tflops(self, family: GPTShape) -> float:
        """Model TFLOP/s: the step's FLOPs with the blocks' recompute
        (:func:`~shfx.cost_model.formulas.flops_per_iteration`) over its time."""
        return float(flops_per_iteration(self.layers, family.hidden, family.seq, family.batch, family.vocab)) / self.step_s / 1e12

    def describe(self) -> str:
        t = self.traffic
        ssd = f", SSD {t.ssd_read_bytes / 1e12:.2f} TB read + {t.ssd_write_bytes / 1e12:.2f} TB written ({self.ssd_s:.1f} s)" if self.ssd_s else ""
        return (
            f"step {self.step_s:.1f} s (bottleneck {self.bottleneck}): compute {self.compute_s:.1f} s, "
            f"PCIe h2d {self.h2d_s:.1f} s + d2h {self.d2h_s:.1f} s, host updates {self.host_update_s:.1f} s{ssd}"
        )


def tier_step(
    family: GPTShape, hardware: str | Hardware, tier: str | None = None, *, window: int = 2, overlap_updates: bool = True,
    nvme_masters: bool = False,
) -> TierStep:  # fmt: skip
    """The predicted step of ``stronghold`` training ``family`` (at ``family.layers``) with
    ``tier`` on ``hardware`` (see the module docstring).

    >>> st = tier_step(GPTShape(layers=96, hidden=12288, heads=96, seq=2048, batch=4, vocab=50257,
    ...                precision="bf16"), "RTX4090-24GB", "nvme-all+act-host")
    >>> st.bottleneck, st.step_s == max(st.pipeline_s, st.ssd_s)
    ('ssd', True)
    """
    _check_tier(tier)
    hw = get_profile(hardware)
    L = family.layers
    traffic = step_traffic(family, tier, window=window, overlap_updates=overlap_updates, nvme_masters=nvme_masters)
    st = gpt_stage_times(hw, family.hidden, family.seq, family.batch, family.vocab, dtype=family.precision, rollback=family.rollback_default)
    head, block, tail = st["head"], st["block"], st["tail"]
    fwd = dict(head=head, block=block, tail=tail)
    bwd = dict(head=head, block=block, tail=tail)
    if tier and "+act-" in tier:
        A = family.batch * family.seq * family.hidden * family.param_bytes
        out = hw.link_latency_s + A / hw.d2h_bps
        back = hw.link_latency_s + A / hw.h2d_bps
        fwd.update(head=replace(head, f=sp.Max(head.f, out)), block=replace(block, f=sp.Max(block.f, out)))
        bwd.update(block=replace(block, pf=block.pf + back))
    pipeline = float(forward_time_gpt(L, window, fwd["head"], fwd["block"], fwd["tail"]) + backward_time_gpt(L, window, bwd["head"], bwd["block"], bwd["tail"]))
    compute = float(head.f + head.b + L * (block.f + block.b) + tail.b)  # (the tail's forward keeps its graph: no recompute)
    host_update = float(head.u + L * block.u + tail.u)
    ssd = ssd_bound_s(traffic.ssd_read_bytes, traffic.ssd_write_bytes, links_of(hw)) if traffic.ssd else 0.0
    h2d, d2h = traffic.h2d_bytes / hw.h2d_bps, traffic.d2h_bytes / hw.d2h_bps
    busy = {"compute": compute, "h2d": h2d, "d2h": d2h, "host update": host_update, "ssd": ssd}
    return TierStep(
        tier=tier, layers=L, params=family.num_params(), traffic=traffic, compute_s=compute, h2d_s=h2d, d2h_s=d2h,
        host_update_s=host_update, ssd_s=ssd, pipeline_s=pipeline, step_s=max(pipeline, ssd), bottleneck=max(busy, key=busy.get),
    )  # fmt: skip


# ---- published figures to compare with ----------------------------------------------------------


@dataclass(frozen=True)
class PublishedFigure:
    """A system's published throughput for a setup, exactly as its source gives it, and that setup
    as shfx models it. Nothing is guessed: what the sources do not give is None, and what is
    derived from a published number (a step time from a throughput) says so and how.

    Attributes:
        system: who (``"LoHan"``).
        claim, claim_source: a claim in the source's words, and where it is.
        source: where the throughput is (address, file, figure).
        setup: the testbed, as the source gives it.
        family: the model, batch, sequence length and precision it was measured at.
        tflops: its throughput there (in the source's FLOP count).
        other_batches: ``(batch, TFLOP/s)`` at the same setup (``None``: out of memory).
        step_s: its step time when published (None: not published).
        profiles: ``(profile, what it stands for)``: shfx's profiles to predict its setup on.
        note: what of ``family`` is not in the source's own words.
    """

    system: str
    claim: str
    claim_source: str
    source: str
    setup: str
    family: GPTShape
    tflops: float
    other_batches: tuple[tuple[int, float | None], ...] = ()
    step_s: float | None = None
    profiles: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def lines(self) -> list[str]:
        """The published facts, one line each: the claim, then the throughput with its setup."""
        f = self.family
        others = ", ".join(f"{t:g} at batch {b}" if t is not None else f"out of memory at batch {b}" for b, t in self.other_batches)
        step = f"{self.step_s:.1f} s per step" if self.step_s is not None else "step time: not published"
        return [
            f"{self.system} ({self.claim_source}): \"{self.claim}\"",
            f"{self.system} ({self.source}): {self.setup}: {self.tflops:g} TFLOP/s at batch {f.batch} x seq {f.seq}, "
            f"{f.precision}" + (f" ({others})" if others else "") + f"; {step}" + (f" ({self.note})" if self.note else ""),
        ]

    def implied_step_s(self, family: GPTShape | None = None, *, flops: str = "shfx") -> float:
        """The step the published rate would take for ``family`` (default: its own setup), with a
        FLOP count: ``"shfx"``, :func:`~shfx.cost_model.formulas.flops_per_iteration` (the blocks'
        recompute included, as :meth:`TierStep.tflops` counts); ``"6N"``, ``6 N b s`` (none).
        Derived, not published: the source's own FLOP count is not stated.

        >>> round(LOHAN_175B.implied_step_s()), round(LOHAN_175B.implied_step_s(flops="6N"))
        (267, 198)
        """
        f = family or self.family
        if flops == "shfx":
            n = float(flops_per_iteration(f.layers, f.hidden, f.seq, f.batch, f.vocab))
        elif flops == "6N":
            n = 6.0 * f.num_params() * f.batch * f.seq
        else:
            raise ValueError(f"flops must be 'shfx' or '6N', got {flops!r}")
        return n / (self.tflops * 1e12)

    def derived(self) -> str:
        """The step its published rate implies at its own setup, under both FLOP counts."""
        n = self.implied_step_s() * self.tflops * 1e12
        return (
            f"{self.system}'s step, derived (not published): {n / 1e15:.1f} PFLOP per step at its setup (shfx's count, "
            f"96 b s l h^2 (1 + s/6h + V/16lh), recompute included) / {self.tflops:g} TFLOP/s = {self.implied_step_s():.0f} s; "
            f"{self.implied_step_s(flops='6N'):.0f} s with 6 N b s (no recompute); its own FLOP count is not stated"
        )

    def compare(self, step: TierStep, family: GPTShape) -> str:
        """The prediction at ``family`` (another setup than the published one) beside the published
        rate: shfx's step and model TFLOP/s, the step the published rate would take at this size
        and batch (the same FLOP count), and the SSD bandwidth that step would need for the
        predicted bytes (reads and writes one after the other)."""
        at = self.implied_step_s(family.with_layers(step.layers))
        t = step.traffic
        ssd = t.ssd_read_bytes + t.ssd_write_bytes
        need = f", needing {ssd / at / 1e9:.0f} GB/s of SSD bandwidth for this step's {ssd / 1e12:.2f} TB" if ssd else ""
        return (
            f"predicted {step.step_s:.0f} s (bottleneck {step.bottleneck}), {step.tflops(family):.1f} TFLOP/s at batch "
            f"{family.batch} x seq {family.seq}, {family.precision}; {self.system}'s {self.tflops:g} would be a {at:.0f} s step here{need}"
        )

    def at_setup(self, tier: str | None, *, window: int = 2, overlap_updates: bool = True) -> list[str]:
        """shfx's prediction at the published setup (its ``family``) on each of ``profiles``,
        beside the published rate (as a step with shfx's FLOP count)."""
        f, ours = self.family, self.implied_step_s()
        out = []
        for name, what in self.profiles:
            st = tier_step(f, name, tier, window=window, overlap_updates=overlap_updates)
            out.append(
                f"at {self.system}'s setup (batch {f.batch} x seq {f.seq}, {f.precision}) on {name} ({what}): predicted "
                f"{st.step_s:.0f} s (bottleneck {st.bottleneck}), {st.tflops(f):.1f} TFLOP/s vs {self.system}'s {self.tflops:g} "
                f"({ours:.0f} s with the same FLOP count)"
            )
        return out


LOHAN_175B = PublishedFigure(
    system="LoHan",
    claim="the first to fine-tune a 175B model on an RTX 4090 and 256 GB main memory",
    claim_source="arXiv 2403.06504v2, abstract",
    source="github.com/RC4ML/LoHan, the paper's ICDE 2025 artifact, evaluation_data.md, Figure 7(b)",
    setup=(
        "GPT 175B (96 layers, 96 heads, hidden 12288) on one RTX 4090; testbed 2x Xeon Gold 5320, 768 GB DDR4, "
        "12x Intel D7-P5510 3.84 TB SSDs in RAID-0"
    ),
    family=GPTShape(layers=96, hidden=12288, heads=96, seq=1024, batch=16, vocab=50257, precision="fp16"),
    tflops=86.9,
    other_batches=((8, 52.6), (32, None)),
    profiles=(
        ("RTX4090-24GB", "one consumer SSD"),
        ("RTX4090-24GB-12xNVMe", "LoHan's 12 drives at spec-sheet rates, summed: an upper bound"),
    ),
    note=(
        "seq 1024 and fp16: the artifact's main.py defaults, --max_seq_len 1024 and the model .half(), "
        "not read from the paper; its GPT has no LM head"
    ),
)
"""LoHan's published 175B throughput on one RTX 4090, beside which ``shfx plan --model gpt3-175b``
prints its predictions (issue 26). The paper's first version's 175B figure, "87 TFLOPS on 4090"
as a secondary summary quotes it, matches this 86.9 rounded."""
