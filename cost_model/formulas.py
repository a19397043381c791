"""Closed-form formulas (sympy) for a GPT trained with shfx's sliding window.

Everything here is a sympy expression in the model's shape and the hardware's rates, so it can
be printed, differentiated, solved, or evaluated by passing numbers instead of symbols (every
function takes its inputs as arguments that default to the module's symbols).

Symbols: ``W`` window (resident stages), ``l`` transformer layers (blocks), ``h`` hidden, ``a``
heads, ``s`` sequence, ``b`` micro-batch, ``V`` vocabulary; per-stage seconds ``t_f`` (FORWARD),
``t_b`` (BACKWARD with recompute), ``t_pf`` (PREFETCH, host -> device), ``t_og`` (OFFLOAD_GRAD,
device -> host), ``t_u`` (CPU_STEP, host AdamW).

How shfx lays out a GPT (:mod:`shfx.models.gpt`), and so what the formulas assume:

- Stages: a head (``wte`` [V,h] and ``wpe`` [s,h]), ``l`` blocks, a tail (final LayerNorm and the
  tied ``lm_head``, which it *borrows* from the head: its slot holds a copy of ``wte``). All
  parameters fp32 (4 bytes).
- Device: a pool of ``min(W, l+2)`` slots, each as large as the largest stage; the boundary
  activations the forward keeps for the backward (the head's output and each block's output, one
  ``[b,s,h]`` fp32 tensor each, plus the scalar loss); the gradient of one boundary value during
  the backward; the inputs; on a real GPU also the temporaries of the stage being computed (the
  recompute workspace) and the CUDA context. :func:`device_memory_terms` names each term and says
  who counts it (``simulator``, the ``emulated`` device, a real ``gpu``).
- Host: parameters, gradients and AdamW's two moments, 16 bytes per parameter, all pinned; a
  pending buffer for the tied embedding's gradient from the tail; gradient staging buffers when
  gradients accumulate.
- Step: the "stronghold" window schedule (:func:`shfx.passes.schedule.window_actions`), one step from
  a cold start (nothing resident), updates overlapped with the backward, one host optimizer
  worker, full-duplex links (``duplex=1``; see :func:`step_time_gpt` for the coupling), and the
  simulator's execution model (:mod:`shfx.cost_model.simulate`): each stream runs its actions in
  issue order, the backward starts when the forward phase is done.

Step time (derivation, :func:`forward_time` and :func:`backward_time`). Given a schedule, the
simulated step time is the longest path through the action DAG whose edges are the program's
dependencies plus "same stream, issued earlier". For ``n`` identical stages the forward DAG has
three kinds of moves: ``F i -> F i+1`` (``t_f``), ``PF i -> PF i+1`` (``t_pf``, the h2d stream)
and the slot cycle ``F i -> R i -> PF i+W -> F i+W`` (``t_pf + t_f`` for ``W`` stages). A path
of ``k`` cycles and ``n-1-kW`` single steps costs ``k(t_pf+t_f) + (n-1-kW) max(t_f, t_pf)``;
it is linear in ``k``, so the longest uses ``k = 0`` or ``k = floor((n-1)/W)``::

    T_F = t_pf + t_f + max((n-1) max(t_f, t_pf),  K (t_pf+t_f) + (n-1-K W) max(t_f, t_pf))

The backward's cycle is ``B j -> OG j -> R j -> PF j-W -> B j-W`` (``t_og + t_pf + t_b`` for
``W`` stages, the released slot's grads must reach the host before the next stage comes in), its
single steps are ``B`` (``t_b``), ``OG`` (``t_og``, the d2h stream), the host updates ``U``
(``t_u``, one worker) and chained prefetches; it starts with the last stage's backward without
recompute (its forward kept its graph: ``t_b - t_f``) and ends with ``OG 0`` and ``U 0``::

    T_B = (t_b - t_f) + t_og + t_u + max((n-1) r0,  K c + (n-1-K W) r,  c + (n-1-W) r)
    c = t_og + t_pf + t_b,  r0 = max(t_b, t_og, t_u),  r = max(r0, t_pf)

(the last two terms only when ``W <= n-1``). ``T = T_F + T_B`` exactly, for a chain of
identical stages under the simulator's model with full-duplex links. In steady state each stage
costs ``max(t_f, t_pf, (t_f+t_pf)/W)`` forward and ``max(t_b, t_og, t_pf, t_u, c/W)`` backward:
transfers are hidden when ``t_pf <= (W-1) t_f`` and ``t_og + t_pf <= (W-1) t_b``
(:func:`smallest_hiding_window`). The GPT's head and tail are different stages (the head moves
as many bytes as two blocks and computes almost nothing; the tail computes the logits);
:func:`step_time_gpt` enumerates the same path families with their end stages' own costs.

>>> T = step_time(4, 2, 1.0, 3.0, 0.5, 0.5, 0.5)   # the simulator's docstring example
>>> float(T)
16.5
>>> int(smallest_hiding_window(t_f=1.0, t_b=3.0, t_pf=1.5, t_og=1.5))
3
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy as sp

__all__ = [
    "W", "l", "h", "a", "s", "b", "V", "n",
    "t_f", "t_b", "t_pf", "t_og", "t_u",
    "FP32",
    "params_block", "params_head", "params_tail_own", "params_tail_slot", "params_total",
    "stage_param_counts", "slot_bytes", "slot_pool_bytes", "activation_bytes",
    "MemoryTerm", "device_memory_terms", "device_memory", "host_memory_terms", "host_memory",
    "forward_time", "backward_time", "step_time", "step_time_steady",
    "StageTimes", "step_time_gpt", "forward_time_gpt", "backward_time_gpt", "step_time_gpt_hw",
    "step_time_gpt_steady",
    "flops_per_iteration", "gpt_stage_work", "gpt_stage_times", "HW_SYMBOLS",
    "LayersFit", "largest_layers", "HidingWindow", "smallest_hiding_window", "gpt_hiding_window",
    "evaluate",
]

W, l, h, a, s, b, V = sp.symbols("W l h a s b V", positive=True, integer=True)
n = sp.Symbol("n", positive=True, integer=True)
"""Number of stages of a uniform chain (a GPT has ``l + 2``: head, blocks, tail)."""
t_f, t_b, t_pf, t_og, t_u = sp.symbols("t_f t_b t_pf t_og t_u", nonnegative=True)

FP32 = 4
"""Bytes per parameter and per activation element (shfx trains in fp32)."""

_NEG = sp.S.NegativeInfinity


def evaluate(expr, **values) -> float:
    """Substitute ``values`` (by symbol name) and return a float.

    >>> evaluate(params_block(), h=2048)
    50358272.0
    """
    expr = sp.sympify(expr)
    subs = {sym: values[sym.name] for sym in expr.free_symbols if sym.name in values}
    missing = sorted(sym.name for sym in expr.free_symbols if sym.name not in values)
    if missing:
        raise ValueError(f"no value for {', '.join(missing)}")
    return float(expr.xreplace({k: sp.sympify(v) for k, v in subs.items()}))


# ---- parameters -------------------------------------------------------------------------------
def params_block(h=h):
    """Parameters of one GPT block: ``12 h^2 + 13 h`` (QKV, projection, MLP, two LayerNorms, biases).

    >>> params_block(2048)
    50358272
    """
    return 12 * h**2 + 13 * h


def params_head(h=h, s=s, V=V):
    """The head stage owns the token and position embeddings: ``(V + s) h``."""
    return (V + s) * h


def params_tail_own(h=h):
    """The tail owns only the final LayerNorm: ``2 h`` (the lm_head is the tied ``wte``)."""
    return 2 * h


def params_tail_slot(h=h, V=V):
    """What the tail's slot holds: its LayerNorm plus a borrowed copy of ``wte``: ``2h + V h``."""
    return 2 * h + V * h


def params_total(l=l, h=h, s=s, V=V):
    """Trainable parameters: ``l (12h^2+13h) + (V+s) h + 2h`` (embedding tied to the head).

    >>> params_total(48, 2048, 1024, 50304)
    2522320896
    """
    return l * params_block(h) + params_head(h, s, V) + params_tail_own(h)


def stage_param_counts(h=h, s=s, V=V) -> dict:
    """Per stage kind: parameters its slot holds (``slot``), sends back as gradients (``grad``,
    the tail's includes the borrowed embedding) and updates on the host (``own``)."""
    return {
        "head": {"slot": params_head(h, s, V), "grad": params_head(h, s, V), "own": params_head(h, s, V)},
        "block": {"slot": params_block(h), "grad": params_block(h), "own": params_block(h)},
        "tail": {"slot": params_tail_slot(h, V), "grad": params_tail_slot(h, V), "own": params_tail_own(h)},
    }


def slot_bytes(h=h, s=s, V=V):
    """One slot: the largest stage, ``4 max((V+s)h, 12h^2+13h, 2h+Vh)`` bytes.

    For GPT-2 sized vocabularies the head (embeddings) is the largest stage until
    ``12 h^2 + 13 h > (V + s) h``, i.e. ``h > (V + s - 13) / 12`` (4275 for V=50304, s=1024).
    """
    return FP32 * sp.Max(params_head(h, s, V), params_block(h), params_tail_slot(h, V))


def slot_pool_bytes(W=W, l=l, h=h, s=s, V=V, *, case: str = "exact"):
    """The slot pool of the window schedule: each slot sized to the largest stage put into it.

    The schedule puts stage ``i`` into slot ``i mod W`` (a freed slot goes to the stage W
    ahead), so of ``n = l + 2`` stages the head is in slot 0 (with a block when ``W <= l``), the
    tail in slot ``t = (n-1) mod W`` (with block ``t`` unless ``t = 0``), and every other slot
    holds blocks only:

    - ``W >= n``: every stage its own slot, ``head + l blocks + tail`` (``case="all"``);
    - ``t = 0``, the tail shares the head's slot: ``max(slot0, tail) + (W-1) block``;
    - else ``slot0 + max(tail, block) + (W-2) block`` with ``slot0 = max(head, block)`` when
      ``W <= l`` (``case="general"`` always takes this, never less than the exact pool).

    >>> round(float(slot_pool_bytes(4, 48, 2048, 1024, 50304)) / 2**30, 2)  # head + tail + 2 blocks
    1.15
    """
    head = FP32 * params_head(h, s, V)
    block = FP32 * params_block(h)
    tail = FP32 * params_tail_slot(h, V)
    n = l + 2
    if case == "all":
        return head + l * block + tail
    if case == "general":
        return sp.Max(head, block) + sp.Max(tail, block) + (W - 2) * block
    if case != "exact":
        raise ValueError(f"case must be 'exact', 'general' or 'all', got {case!r}")
    slot0 = sp.Piecewise((sp.Max(head, block), W <= l), (head, True))
    return sp.Piecewise(
        (head + l * block + tail, W >= n),
        (sp.Max(slot0, tail) + (W - 1) * block, sp.Eq(sp.Mod(n - 1, W), 0)),
        (slot0 + sp.Max(tail, block) + (W - 2) * block, True),
    )


def activation_bytes(b=b, s=s, h=h):
    """One stage-boundary activation: a ``[b, s, h]`` fp32 tensor, ``4 b s h`` bytes."""
    return FP32 * b * s * h


# ---- memory -----------------------------------------------------------------------------------
COUNTERS = ("simulator", "emulated", "gpu")


@dataclass(frozen=True)
class MemoryTerm:
    """One term of a memory formula.

    Attributes:
        name: short name (``slot_pool``, ``activations``, ...).
        expr: bytes, a sympy expression.
        counted_by: who accounts for it: ``simulator`` (:func:`shfx.cost_model.simulate.simulate`'s
            peak), ``emulated`` (the emulated device's capacity check), ``gpu`` (a real device).
        note: what it is.
    """

    name: str
    expr: sp.Expr
    counted_by: frozenset
    note: str = ""


def device_memory_terms(
    W=W, l=l, h=h, a=a, s=s, b=b, V=V, *, attention_scores: bool = True, logits_copies: int = 3,
    context_bytes=512 * 2**20, pool: str = "exact",
) -> list[MemoryTerm]:
    """The terms of the device's peak, at the end of the tail's backward (all activations still
    held and the first boundary gradient allocated).

    - ``slot_pool``: :func:`slot_pool_bytes` (each slot sized to the largest stage it holds).
    - ``activations``: ``(l + 1) * 4bsh + 4``: the head's and each block's output, plus the loss.
    - ``boundary_grads``: ``4bsh``, the gradient flowing back (at a stage's end its input's and
      output's gradients coexist while its input activation is being freed: the same total).
    - ``output_grad``: ``4``, the gradient of the loss that ``backward()`` hands in (held until
      the tail's backward is done, so it coexists with the tail's input gradient at the peak).
    - ``inputs``: token ids and targets, ``2 * 8 b s`` (int64).
    - ``workspace`` (real GPU only): the temporaries of the stage being recomputed and
      differentiated: a block's activations for its backward, Korthikanti et al.'s
      ``s b h (34 + 5 a s / h)`` bytes for 16-bit, doubled for fp32 (``attention_scores=False``
      drops the ``5 a s / h`` score term, which fused SDPA kernels never materialise), or the
      tail's logits: ``logits_copies * 4 b s V`` (logits, log-softmax, their gradient); the larger.
    - ``cuda_context`` (real GPU only): context, cuBLAS workspace, allocator slack.

    >>> terms = device_memory_terms(4, 48, 2048, 16, 1024, 4, 50304)
    >>> {t.name: round(float(t.expr) / 2**30, 2) for t in terms}  # GiB
    ... # doctest: +NORMALIZE_WHITESPACE
    {'slot_pool': 1.15, 'activations': 1.53, 'boundary_grads': 0.03, 'output_grad': 0.0, 'inputs': 0.0,
     'workspace': 2.3, 'cuda_context': 0.5}
    """
    A = activation_bytes(b, s, h)
    scores = 5 * a * s / h if attention_scores else 0
    block_ws = 2 * s * b * h * (34 + scores)
    tail_ws = logits_copies * FP32 * b * s * V
    return [
        MemoryTerm("slot_pool", slot_pool_bytes(W, l, h, s, V, case=pool), frozenset(COUNTERS),
                   "min(W, l+2) slots, each as large as the largest stage it holds"),
        MemoryTerm("activations", (l + 1) * A + FP32, frozenset(COUNTERS),
                   "stage-boundary outputs kept from forward to backward (head, l blocks) and the loss"),
        MemoryTerm("boundary_grads", A, frozenset(COUNTERS), "gradient of one boundary value in backward"),
        MemoryTerm("output_grad", sp.sympify(FP32), frozenset(COUNTERS), "gradient of the loss handed to backward()"),
        MemoryTerm("inputs", 2 * 8 * b * s, frozenset({"emulated", "gpu"}), "token ids and targets (int64)"),
        MemoryTerm("workspace", sp.Max(block_ws, tail_ws), frozenset({"gpu"}),
                   "temporaries of the stage being computed: a block's recompute or the tail's logits"),
        MemoryTerm("cuda_context", sp.sympify(context_bytes), frozenset({"gpu"}), "CUDA context and allocator slack"),
    ]


def device_memory(W=W, l=l, h=h, a=a, s=s, b=b, V=V, *, counted_by: str = "gpu", **kw):
    """Peak device bytes as counted by ``counted_by`` (``simulator``, ``emulated`` or ``gpu``).

    >>> sp.simplify(device_memory(counted_by="simulator").subs(W, 2).subs(l, 10)
    ...             - (slot_pool_bytes(2, 10) + 12 * activation_bytes() + 4 + 4))
    0
    """
    if counted_by not in COUNTERS:
        raise ValueError(f"counted_by must be one of {COUNTERS}, got {counted_by!r}")
    return sp.Add(*[t.expr for t in device_memory_terms(W, l, h, a, s, b, V, **kw) if counted_by in t.counted_by])


def host_memory_terms(l=l, h=h, s=s, V=V, *, accumulate: bool = False, staging_buffers: int = 2,
                      overhead_bytes=0) -> list[MemoryTerm]:
    """Host bytes: ``16 P`` (fp32 params, grads, AdamW m and v, all pinned), the pending buffer
    for the tied embedding's gradient from the tail (``4 V h``), with ``accumulate`` the staging
    buffers gradients are copied through (``staging_buffers`` x the largest stage's gradient),
    and a fixed ``overhead_bytes`` (Python, torch, the data loader)."""
    P = params_total(l, h, s, V)
    largest_grad = FP32 * sp.Max(params_head(h, s, V), params_block(h), params_tail_slot(h, V))
    return [
        MemoryTerm("params", FP32 * P, frozenset({"host"}), "fp32 master weights"),
        MemoryTerm("grads", FP32 * P, frozenset({"host"}), "fp32 gradient buffer"),
        MemoryTerm("adam_m", FP32 * P, frozenset({"host"}), "AdamW first moment"),
        MemoryTerm("adam_v", FP32 * P, frozenset({"host"}), "AdamW second moment"),
        MemoryTerm("borrowed_grad", FP32 * V * h, frozenset({"host"}), "pending tied-embedding gradient from the tail"),
        MemoryTerm("staging", staging_buffers * largest_grad if accumulate else sp.S.Zero, frozenset({"host"}),
                   "gradient staging buffers (gradient accumulation only)"),
        MemoryTerm("overhead", sp.sympify(overhead_bytes), frozenset({"host"}), "process overhead"),
    ]


def host_memory(l=l, h=h, s=s, V=V, **kw):
    """Host bytes, the sum of :func:`host_memory_terms`: ``16 P + 4 V h (+ staging + overhead)``.

    >>> round(float(host_memory(48, 2048, 1024, 50304)) / 1e9, 2)
    40.77
    """
    return sp.Add(*[t.expr for t in host_memory_terms(l, h, s, V, **kw)])


# ---- step time: a chain of identical stages ----------------------------------------------------
def _floor_div(x, y):
    return sp.floor(sp.sympify(x) / y)


def _max(terms):
    """Max of ``terms`` without sympy's pairwise simplification (slow for long symbolic lists):
    numbers are reduced in Python, symbolic terms are kept unevaluated."""
    terms = [sp.sympify(x) for x in terms]
    terms = [x for x in terms if x is not _NEG]
    if not terms:
        return _NEG
    if all(x.is_number for x in terms):
        return max(terms, key=float)
    return sp.Max(*terms, evaluate=False)


def _when(expr, cond):
    """``expr`` where ``cond`` holds, else minus infinity (a term of a Max that may not exist)."""
    cond = sp.sympify(cond)
    if cond is sp.true:
        return sp.sympify(expr)
    if cond is sp.false:
        return _NEG
    return sp.Piecewise((expr, cond), (_NEG, True))


def forward_time(n=n, W=W, t_f=t_f, t_pf=t_pf):
    """Forward phase of ``n`` identical stages with window ``W``, from a cold start.

    ``t_pf + t_f + max((n-1) m, K (t_pf + t_f) + (n-1-K W) m)``, ``m = max(t_f, t_pf)``,
    ``K = floor((n-1)/W)``: PF 0 cannot be hidden; then either every stage costs ``m`` (compute-
    or link-bound) or every ``W`` stages a slot must go round: forward, release, prefetch.

    >>> float(forward_time(8, 1, 1.0, 0.5))   # W=1: nothing overlaps
    12.0
    >>> float(forward_time(8, 2, 1.0, 0.5))   # W=2 hides the prefetches: t_pf + 8 t_f
    8.5
    """
    m = sp.Max(t_f, t_pf)
    K = _floor_div(n - 1, W)
    return t_pf + t_f + sp.Max((n - 1) * m, K * (t_pf + t_f) + (n - 1 - K * W) * m)


def backward_time(n=n, W=W, t_f=t_f, t_b=t_b, t_pf=t_pf, t_og=t_og, t_u=t_u):
    """Backward phase of ``n`` identical stages: from the last stage's backward (its forward kept
    its graph: ``t_b - t_f``) to the update of stage 0.

    ``(t_b - t_f) + t_og + t_u + max((n-1) r0, K c + (n-1-KW) r, c + (n-1-W) r)`` with the slot
    cycle ``c = t_og + t_pf + t_b``, ``r0 = max(t_b, t_og, t_u)``, ``r = max(r0, t_pf)``, the
    cycle terms only when ``W <= n - 1`` (otherwise nothing is prefetched in backward).

    >>> float(backward_time(4, 2, 1.0, 3.0, 0.5, 0.5, 0.5))
    12.0
    """
    r0 = sp.Max(t_b, t_og, t_u)
    r = sp.Max(r0, t_pf)
    c = t_og + t_pf + t_b
    K = _floor_div(n - 1, W)
    cyc = sp.Max(K * c + (n - 1 - K * W) * r, c + (n - 1 - W) * r)
    return (t_b - t_f) + t_og + t_u + sp.Max((n - 1) * r0, _when(cyc, sp.Le(W, n - 1)))


def step_time(n=n, W=W, t_f=t_f, t_b=t_b, t_pf=t_pf, t_og=t_og, t_u=t_u):
    """One training step of ``n`` identical stages (:func:`forward_time` + :func:`backward_time`).

    Exact for ``simulate(schedule_window(chain(n, ...), W), CostTable([StageCost(t_f, t_b,
    update_s=t_u)] * n, Links(bw, bw)))`` with ``t_pf = t_og = latency + bytes / bw``.

    >>> float(step_time(4, 2, 1.0, 3.0, 0.5, 0.5, 0.5))
    16.5
    """
    return forward_time(n, W, t_f, t_pf) + backward_time(n, W, t_f, t_b, t_pf, t_og, t_u)


def step_time_steady(n=n, W=W, t_f=t_f, t_b=t_b, t_pf=t_pf, t_og=t_og, t_u=t_u):
    """The steady-state approximation: fill plus ``n`` times the per-stage period,

    ``t_pf + t_og + t_u - t_f + n [max(t_f, t_pf, (t_f+t_pf)/W) + max(t_b, t_og, t_pf, t_u, (t_b+t_og+t_pf)/W)]``.

    Equal to :func:`step_time` when compute-bound; otherwise it charges every stage the
    steady-state period, where the exact formula has whole cycles only (``floor``) and no
    prefetch in the last ``W`` stages of the backward: off by ``O(t_pf + t_og)`` per step.

    >>> float(step_time_steady(4, 2, 1.0, 3.0, 0.5, 0.5, 0.5))
    16.5
    """
    fwd = sp.Max(t_f, t_pf, (t_f + t_pf) / W)
    bwd = sp.Max(t_b, t_og, t_pf, t_u, (t_b + t_og + t_pf) / W)
    return t_pf + t_og + t_u - t_f + n * (fwd + bwd)


# ---- step time: a GPT (head, l identical blocks, tail) ----------------------------------------
@dataclass(frozen=True)
class StageTimes:
    """Seconds of one stage's actions: FORWARD, BACKWARD (with recompute), PREFETCH,
    OFFLOAD_GRAD and the host update of the group it owns."""

    f: object
    b: object
    pf: object
    og: object
    u: object

    @classmethod
    def symbols(cls, suffix: str) -> StageTimes:
        fs = sp.symbols(f"t_f{suffix} t_b{suffix} t_pf{suffix} t_og{suffix} t_u{suffix}", nonnegative=True)
        return cls(*fs)

    def scaled_copies(self, factor) -> StageTimes:
        """The same stage with both copies ``factor`` times longer."""
        return StageTimes(self.f, self.b, self.pf * factor, self.og * factor, self.u)


def _kmax(num, W):
    return _floor_div(num, W)


def forward_time_gpt(l=l, W=W, head: StageTimes | None = None, block: StageTimes | None = None,
                     tail: StageTimes | None = None):
    """Forward phase of head + ``l`` identical blocks + tail (``l >= 1``).

    The longest path visits PF of the head, then, per block, F (``t_f``), PF (``t_pf``) or
    nothing (skipped by a slot cycle), with ``k`` slot cycles; the head's F and the tail's PF are
    on it or not (``h``, ``tau``), the last cycle lands on a block or on the tail (``lam``). Every
    combination is a term of the Max, with ``k`` at its smallest and largest feasible values (the
    cost is linear in ``k``)::

        t_pf_head + h t_f_head + tau t_pf_tail + t_f_tail + (k - lam + 1 - h) t_pf
            + (k + 1 - h - tau) t_f + (l - k W + lam - (1 - h)) r,     r in {t_f, t_pf}
    """
    H = head or StageTimes.symbols("_head")
    B = block or StageTimes(t_f, t_b, t_pf, t_og, t_u)
    T = tail or StageTimes.symbols("_tail")
    terms = []
    for hh in (0, 1):
        for tau in (0, 1):
            for lam in ((0, 1) if tau else (0,)):
                forced = 1 - hh
                for rmode in ("f", "p", None):
                    r = {"f": B.f, "p": B.pf, None: 0}[rmode]
                    lo = max(0, hh + tau - 1, lam)
                    if tau and hh:
                        lo = max(lo, 1)  # the tail is reached in PF mode only after a cycle
                    if tau and not lam and hh:
                        lo = max(lo, 1)  # a PF step into the tail needs a PF segment in the blocks
                    if rmode == "p" and hh:
                        lo = max(lo, 1 + lam)  # PF steps in the blocks follow a landing on a block
                    if rmode == "f" and not hh:
                        lo = max(lo, tau)  # an F segment in the blocks needs a cross at a block
                    hi = _kmax(l + lam - forced, W)
                    if rmode is None:  # no single steps: the cycles cover the blocks exactly
                        lo = max(0, hh + tau - 1, lam, 1 if tau and hh else 0)
                        exact = sp.Eq(sp.Mod(l + lam - forced, W), 0)
                    else:
                        exact = sp.true

                    def cost(k, hh=hh, tau=tau, lam=lam, forced=forced, r=r):
                        return (
                            H.pf + hh * H.f + tau * T.pf + T.f
                            + (k - lam + forced) * B.pf
                            + (k + 1 - hh - tau) * B.f
                            + (l - k * W + lam - forced) * r
                        )

                    for k in ((hi,) if rmode is None else (lo, hi)):
                        terms.append(_when(cost(k), sp.And(sp.Le(lo, hi), exact)))
    return _max(terms)


def backward_time_gpt(l=l, W=W, head: StageTimes | None = None, block: StageTimes | None = None,
                      tail: StageTimes | None = None, *, keep_last_graph: bool = True, workers: int = 1):
    """Backward phase of head + ``l`` identical blocks + tail (``l >= 1``).

    Indices run in backward order (tail first). A path visits, per block, B, OG, the prefetch
    issued after it (which brings the stage ``W`` ahead: a cycle ``B -> OG -> PF -> B``
    skips ``W-1`` blocks), or U; at the tail B and maybe OG (``T=1``) and U (``T=2``); at the
    head U and, depending on how the path arrives (by U, OG, B or PF), OG, B and PF. Crosses
    between modes at the blocks cost the new mode's time. The terms of the Max are every
    combination, with the number of cycles ``k`` at its extremes.

    ``workers > 1`` host optimizer workers: each U step costs ``t_u / workers`` (approximate).
    """
    H = head or StageTimes.symbols("_head")
    B = block or StageTimes(t_f, t_b, t_pf, t_og, t_u)
    T = tail or StageTimes.symbols("_tail")
    bt = T.b - T.f if keep_last_graph else T.b
    u_step = B.u / workers
    head_cost = {"u": H.u, "o": H.og + H.u, "b": H.b + H.og + H.u, "q": H.pf + H.b + H.og + H.u}
    rate = {"b": B.b, "o": B.og, "p": B.pf, "u": u_step}
    terms = []
    for Tm in (0, 1, 2):
        for jt in ((0, 1) if Tm == 1 else (0,)):
            tail_cost = bt + (T.og if Tm >= 1 else 0) + (T.u if Tm == 2 else 0)
            nforced = 0 if (Tm == 1 and jt) else 1
            forced_cost = {0: B.b, 1: B.og, 2: u_step}[Tm] if nforced else 0
            for Hm in ("u", "o", "b", "q"):
                if Tm == 2 and Hm != "u":
                    continue
                for lam in ((0, 1) if Hm == "q" else (0,)):
                    for rmode in ("b", "o", "p", "u", None):
                        if rmode == "u" and Hm != "u":
                            continue
                        bo0 = 1 - (Tm >= 1) - (Hm in "bq")  # nBO = k + bo0
                        qb0 = -(Hm == "q")  # nQB = k + qb0
                        nOU = 1 - (Tm == 2) - (Hm in "obq")
                        if nOU < 0:
                            continue
                        lo = max(0, -bo0, -qb0, lam)
                        if Tm == 1 and jt:
                            lo = max(lo, 1)
                        if Hm == "q":
                            lo = max(lo, 1)
                        if Hm == "b" and Tm != 0:
                            lo = max(lo, 1)
                        if Hm == "o" and not (Tm == 1 and not jt):
                            lo = max(lo, 1 - bo0)
                        if rmode == "b" and Tm != 0:
                            lo = max(lo, 1 - qb0)
                        if rmode == "o" and not (Tm == 1 and not jt):
                            lo = max(lo, 1 - bo0)
                        if rmode == "p":
                            lo = max(lo, 1 + lam)
                        hi = 0 if Tm == 2 else _kmax(l + lam - nforced, W)
                        r = rate.get(rmode, 0)
                        exact = sp.true
                        if rmode is None:  # no single steps: the cycles cover the blocks exactly
                            exact = sp.Eq(l - nforced, 0) if Tm == 2 else sp.Eq(sp.Mod(l + lam - nforced, W), 0)

                        def cost(k, tail_cost=tail_cost, Hm=Hm, lam=lam, bo0=bo0, qb0=qb0, nOU=nOU,
                                 forced_cost=forced_cost, nforced=nforced, r=r):
                            return (
                                tail_cost + head_cost[Hm] + forced_cost
                                + (k - lam) * B.pf + (k + bo0) * B.og + (k + qb0) * B.b + nOU * u_step
                                + (l - k * W + lam - nforced) * r
                            )

                        for k in ((hi,) if rmode is None else (lo, hi)):
                            terms.append(_when(cost(k), sp.And(sp.Le(lo, hi), exact)))
    return _max(terms)


def step_time_gpt(l=l, W=W, head: StageTimes | None = None, block: StageTimes | None = None,
                  tail: StageTimes | None = None, *, duplex=1, keep_last_graph: bool = True, workers: int = 1):
    """One step of a GPT (head, ``l`` blocks, tail) with window ``W``: exact under the simulator's
    model for full-duplex links, from per-stage :class:`StageTimes`.

    ``duplex < 1`` (each direction keeps that fraction of its bandwidth while both copy) is
    modelled pessimistically: for ``W >= 2`` every backward copy at the coupled rate (gradient
    copies and prefetches overlap whenever the link matters; with ``W = 1`` they never overlap);
    the simulator's fluid model lies between ``duplex=1`` and this. The forward has no
    device-to-host copies (a GPT mutates no buffers), so it is not affected.

    >>> blk = StageTimes(f=1.0, b=3.0, pf=0.5, og=0.5, u=0.5)
    >>> float(step_time_gpt(2, 2, blk, blk, blk))   # four identical stages: step_time(4, 2, ...)
    16.5
    """
    H = head or StageTimes.symbols("_head")
    B = block or StageTimes(t_f, t_b, t_pf, t_og, t_u)
    T = tail or StageTimes.symbols("_tail")
    fwd = forward_time_gpt(l, W, H, B, T)
    bwd = backward_time_gpt(l, W, H, B, T, keep_last_graph=keep_last_graph, workers=workers)
    if duplex == 1:
        return fwd + bwd
    scaled = [x.scaled_copies(1 / sp.sympify(duplex)) for x in (H, B, T)]
    coupled = backward_time_gpt(l, W, *scaled, keep_last_graph=keep_last_graph, workers=workers)
    # with W = 1 a stage's gradient copy and the next prefetch run one after the other
    return fwd + sp.Piecewise((bwd, sp.Eq(W, 1)), (coupled, True))


def step_time_gpt_steady(l=l, W=W, head: StageTimes | None = None, block: StageTimes | None = None,
                         tail: StageTimes | None = None):
    """The readable form for a GPT: fixed ends plus ``l`` times the per-block period,

    ``T = t_pf,head + max(t_f,head, t_pf) + t_f,tail + (t_b,tail - t_f,tail) + max(t_b,head, t_og) + t_og,head
    + t_u,head + l [max(t_f, t_pf, (t_f+t_pf)/W) + max(t_b, t_og, t_pf, t_u, (t_b+t_og+t_pf)/W)]``.

    The ends: the head's prefetch, then the first block's (the h2d stream is FIFO) before the first
    block can run; the tail's forward and its backward without recompute; after the first
    block's backward, its gradient copy then the head's (the d2h stream is FIFO) and the head's
    update. Equal to :func:`step_time_gpt` when the blocks are compute-bound and the head's and
    tail's copies are hidden (``W >= gpt_hiding_window``); the slope in ``l`` is exact once
    ``l >> W`` in every regime.
    """
    H = head or StageTimes.symbols("_head")
    B = block or StageTimes(t_f, t_b, t_pf, t_og, t_u)
    T = tail or StageTimes.symbols("_tail")
    ends = H.pf + sp.Max(H.f, B.pf) + T.f + (T.b - T.f) + sp.Max(H.b, B.og) + H.og + H.u
    period = sp.Max(B.f, B.pf, (B.f + B.pf) / W) + sp.Max(B.b, B.og, B.pf, B.u, (B.b + B.og + B.pf) / W)
    return ends + l * period


# ---- FLOPs and bytes over a hardware profile ---------------------------------------------------
def flops_per_iteration(l=l, h=h, s=s, b=b, V=V, *, recompute: bool = True):
    """Training FLOPs per iteration (Narayanan et al. 2021):
    ``96 b s l h^2 (1 + s/(6h) + V/(16 l h))`` with full recompute, ``72 ... (1 + s/(6h) + V/(12 l h))``
    without. (shfx recomputes the blocks, not the tail: its forward keeps its graph.)"""
    if recompute:
        return 96 * b * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * b * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def gpt_stage_work(h=h, s=s, b=b, V=V, *, attention_flops: bool = True, elt: int = FP32) -> dict:
    """Per stage kind, one FORWARD's matmul FLOPs and bytes written by other ops, as
    :func:`shfx.cost_model.analytic.stage_work` counts them for :class:`shfx.models.gpt.GPT`:

    - head: no matmuls; ``4(2bsh + sh) + 8s`` bytes (the two lookups, their sum, the positions);
    - block: ``24 b s h^2`` + ``4 b s^2 h`` for attention scores and values
      (``attention_flops=False`` leaves them out); ``4(8bsh + 4bs)`` bytes (LayerNorms, GELU,
      residuals, their statistics);
    - tail: ``2 b s h V`` (the logits); ``4(2bsV + bsh + 2bs + 2)`` bytes.

    ``elt``: bytes per floating-point element (2 for a 16-bit model: the 4 above becomes 2; the
    head's int64 positions stay 8 bytes each).
    """
    attn = 4 * b * s**2 * h if attention_flops else 0
    return {
        "head": (sp.S.Zero, elt * (2 * b * s * h + s * h) + 8 * s),
        "block": (24 * b * s * h**2 + attn, elt * (8 * b * s * h + 4 * b * s)),
        "tail": (2 * b * s * h * V, elt * (2 * b * s * V + b * s * h + 2 * b * s + 2)),
    }


HW_SYMBOLS = sp.symbols("F_rate B_dev lat B_h2d B_d2h B_host", positive=True)
"""Hardware rates for :func:`gpt_stage_times` with ``hw=None``: matmul FLOP/s, device memory
bandwidth, per-copy latency, host->device and device->host bandwidth, host memory bandwidth."""


_ELEMENT_BYTES = {"float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2}


def gpt_stage_times(hw=None, h=h, s=s, b=b, V=V, *, dtype: str = "float32", attention_flops: bool = True,
                    duplex_copies: bool = False, rollback: bool = False) -> dict:
    """:class:`StageTimes` of the head, a block and the tail on a :class:`shfx.cost_model.hardware.Hardware`
    profile (``None``: the symbols :data:`HW_SYMBOLS`), with the analytic model's rules
    (:mod:`shfx.cost_model.analytic`):

    ``t_f = FLOPs / rate + 2 bytes / device_mem_bps``, ``t_b = 3 t_f`` (recompute, then twice the
    work), ``t_pf = latency + e P_slot / h2d``, ``t_og = latency + e P_grad / d2h``,
    ``t_u = 28 P_own / host_mem_bps`` (AdamW reads p, g, m, v, writes p, m, v).

    ``dtype``: the compute dtype: ``"float32"`` (``e = 4`` bytes per element; ``"tf32"``: fp32
    storage at the TF32 matmul rate) or mixed precision, ``"bfloat16"``/``"float16"``: the
    16-bit matmul rate, ``e = 2`` for the copies and the other ops' bytes, and
    ``t_u = 30 P_own / host_mem_bps`` (:func:`shfx.cost_model.costs.host_update_bytes`: the
    working copy's refresh on top of AdamW; the gradient arrives in fp32, cast on the device,
    and ``t_og`` carries its fp32 bytes for a block). ``rollback``: the
    update also pays the step journal's copy of the group,
    :data:`shfx.cost_model.costs.ROLLBACK_COPY_RATIO` x the fp32 update (fp16's default).

    >>> from shfx.cost_model.hardware import get_profile
    >>> fp32 = gpt_stage_times(get_profile("A100-80GB-PCIe4"), 2048, 1024, 4, 50304)["block"]
    >>> bf16 = gpt_stage_times(get_profile("A100-80GB-PCIe4"), 2048, 1024, 4, 50304, dtype="bfloat16")["block"]
    >>> float(bf16.pf / fp32.pf) < 0.51, float(bf16.f / fp32.f) < 0.1
    (True, True)
    """
    from .costs import ROLLBACK_COPY_RATIO, host_update_bytes

    try:
        e = _ELEMENT_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_ELEMENT_BYTES)}, got {dtype!r}") from None
    work = gpt_stage_work(h, s, b, V, attention_flops=attention_flops, elt=e)
    counts = stage_param_counts(h, s, V)
    if hw is None:
        rate, mem, lat, h2d, d2h, host = HW_SYMBOLS
    else:
        rate, mem, lat = sp.Float(hw.matmul_flops(dtype)), sp.Float(hw.device_mem_bps), sp.Float(hw.link_latency_s)
        h2d, d2h, host = sp.Float(hw.h2d_bps), sp.Float(hw.d2h_bps), sp.Float(hw.host_mem_bps)
    upd = 28 if e == 4 else host_update_bytes("bfloat16")
    if rollback:
        upd = upd + sp.Float(ROLLBACK_COPY_RATIO) * 28
    cast = {k: 0 if (e == 4 or k == "head") else counts[k]["own"] for k in ("head", "block", "tail")}
    out = {}
    for kind in ("head", "block", "tail"):
        fl, by = work[kind]
        tf = fl / rate + 2 * by / mem
        pc = counts[kind]
        out[kind] = StageTimes(
            f=tf,
            b=3 * tf,
            pf=lat + e * pc["slot"] / h2d,
            # a 16-bit gradient of a group nothing borrows (a block's, the tail's own) is cast on
            # the device and travels in fp32; the tied head's and the tail's borrowed share
            # travel in the device dtype
            og=lat + (4 * cast[kind] + e * (pc["grad"] - cast[kind])) / d2h,
            u=upd * pc["own"] / host,
        )
    return out


def step_time_gpt_hw(l=l, W=W, hw=None, h=h, s=s, b=b, V=V, *, attention_flops: bool = True, duplex=1,
                     dtype: str = "float32", rollback: bool = False):
    """:func:`step_time_gpt` with the stage times of :func:`gpt_stage_times` (FLOPs and bytes over a
    hardware profile, in ``dtype``, with ``rollback`` copies or not). ``duplex=hw.duplex`` gives
    the pessimistic coupled-link bound.

    >>> from shfx.cost_model.hardware import get_profile
    >>> round(float(step_time_gpt_hw(32, 4, get_profile("V100-32GB-PCIe3"), 2048, 1024, 4, 50304,
    ...                              attention_flops=False)), 3)
    4.676
    """
    st = gpt_stage_times(hw, h, s, b, V, dtype=dtype, attention_flops=attention_flops, rollback=rollback)
    return step_time_gpt(l, W, st["head"], st["block"], st["tail"], duplex=duplex)


# ---- solvers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayersFit:
    """The largest layer count that fits, and why.

    Attributes:
        layers: the largest ``l`` that fits both memories (0: none fits).
        binding: ``"device"`` or ``"host"``, the constraint that stops it.
        by_constraint: the largest ``l`` each constraint alone allows.
        solutions: the real solutions of ``memory(l) = capacity`` from ``sympy.solve``.
    """

    layers: int
    binding: str
    by_constraint: dict
    solutions: dict = field(default_factory=dict)


def _largest_linear(expr, cap, var) -> tuple[int, object]:
    sol = sp.solve(sp.Eq(expr, cap), var)
    if not sol:
        raise ValueError(f"memory {expr} does not depend on {var}")
    root = sol[0]
    return max(-1, int(math.floor(float(root) + 1e-9))), root


def largest_layers(W, h, a, s, b, V, device_bytes, host_bytes, *, counted_by: str = "gpu",
                   device_kw: dict | None = None, host_kw: dict | None = None) -> LayersFit:
    """The largest number of layers whose device peak and host memory fit, with window ``W``.

    Both memories are linear in ``l`` (for ``W <= l + 2`` the pool holds ``W`` slots and depends
    on ``l`` only through which slot the tail shares); each constraint is solved in closed form
    with ``sympy.solve`` and floored (the device one then refined on the exact pool); the smaller
    wins. If the device solution is smaller than ``W - 2`` (the window would exceed the stages),
    it is solved again with every stage resident.

    >>> fit = largest_layers(4, 2048, 16, 1024, 4, 50304, 32 * 2**30, 90 * 2**30)
    >>> fit.binding, fit.layers, fit.by_constraint["device"]
    ('host', 117, 899)
    """
    lv = sp.Symbol("l", real=True)
    kw = dict(device_kw or {})

    def dev(pool: str, layers=lv):
        return device_memory(sp.Integer(W), layers, h, a, s, b, V, counted_by=counted_by, pool=pool, **kw)

    # NOTE: the pool's general case (head and tail in different slots, a block beside each) is
    # never smaller than the exact pool, which depends on (l+1) mod W, so solving with it is
    # safe; evaluating the exact pool then admits at most a few more layers.
    l_dev, root_dev = _largest_linear(dev("general"), device_bytes, lv)
    if l_dev < W - 2:
        l_dev, root_dev = _largest_linear(dev("all"), device_bytes, lv)  # every stage resident
        l_dev = min(l_dev, W - 2)
    else:
        # the exact pool is smaller than the general one by at most a head and a tail slot, and
        # its shared case recurs every W layers: past this many more layers nothing fits
        slack = float(FP32 * (params_head(h, s, V) + params_tail_slot(h, V)) / activation_bytes(b, s, h))
        for cand in range(l_dev + 1, l_dev + int(slack) + 2 * W + 2):
            if float(dev("exact", cand)) <= device_bytes:
                l_dev = cand
    hst = host_memory(lv, h, s, V, **(host_kw or {}))
    l_host, root_host = _largest_linear(hst, host_bytes, lv)
    by = {"device": max(0, l_dev), "host": max(0, l_host)}
    binding = "device" if by["device"] <= by["host"] else "host"
    return LayersFit(by[binding], binding, by, {"device": root_dev, "host": root_host})


@dataclass(frozen=True)
class HidingWindow:
    """The smallest window that hides transfers behind compute.

    Attributes:
        window: ``ceil(1 + max(t_pf/t_f, (t_og+t_pf)/t_b))``.
        forward, backward: the window each phase alone needs.
        binding: ``"forward"`` or ``"backward"``.
        hideable: whether any window can make the step compute-bound (``t_pf <= t_f``,
            ``t_og <= t_b`` and ``t_u <= t_b``: one stage's copy or update longer than its
            compute bounds the steady state whatever the window).
    """

    window: int
    forward: int
    backward: int
    binding: str
    hideable: bool

    def __int__(self) -> int:
        return self.window

    def __index__(self) -> int:
        return self.window


def smallest_hiding_window(t_f=t_f, t_b=t_b, t_pf=t_pf, t_og=t_og, t_u=0.0):
    """The smallest ``W`` with ``t_pf <= (W-1) t_f`` and ``t_og + t_pf <= (W-1) t_b``:
    ``W = ceil(1 + max(t_pf/t_f, (t_og+t_pf)/t_b))`` (a sympy expression for symbols; with numbers
    a :class:`HidingWindow`, which converts to ``int``).

    Forward: stage ``i+W``'s prefetch starts when stage ``i`` releases its slot and must end
    before the ``W-1`` forwards in between do. Backward: a slot is free only after its
    gradients reach the host, then the prefetch of the stage ``W`` below must end within the
    ``W-1`` backwards in between.

    >>> smallest_hiding_window()
    ceiling(Max((t_og + t_pf)/t_b, t_pf/t_f)) + 1
    >>> hw = smallest_hiding_window(0.0337, 0.101, 0.0168, 0.0168)
    >>> int(hw), hw.binding
    (2, 'forward')
    """
    expr = sp.ceiling(1 + sp.Max(sp.sympify(t_pf) / t_f, (sp.sympify(t_og) + t_pf) / t_b))
    if expr.free_symbols:
        return expr
    fw = int(math.ceil(1 + float(t_pf) / float(t_f) - 1e-12))
    bw = int(math.ceil(1 + (float(t_og) + float(t_pf)) / float(t_b) - 1e-12))
    hideable = float(t_pf) <= float(t_f) and float(t_og) <= float(t_b) and float(t_u) <= float(t_b)
    return HidingWindow(max(fw, bw), fw, bw, "forward" if fw >= bw else "backward", hideable)


def gpt_hiding_window(head: StageTimes, block: StageTimes, tail: StageTimes) -> HidingWindow:
    """:func:`smallest_hiding_window` for a GPT, worst case over its stage kinds: the tail's
    prefetch hides behind ``W-1`` block forwards; in backward the tail's gradients (or a
    block's) and the prefetch of a block (or of the head) behind ``W-1`` block backwards.
    (The head's and tail's compute is not counted as cover: conservative.)"""
    f = lambda x: float(x)  # noqa: E731
    t_pf_worst = max(f(block.pf), f(tail.pf))
    og_worst = max(f(block.og), f(tail.og))
    pf_back_worst = max(f(block.pf), f(head.pf))
    fw = int(math.ceil(1 + t_pf_worst / f(block.f) - 1e-12))
    bw = int(math.ceil(1 + (og_worst + pf_back_worst) / f(block.b) - 1e-12))
    hideable = f(block.pf) <= f(block.f) and f(block.og) <= f(block.b) and f(block.u) <= f(block.b)
    return HidingWindow(max(fw, bw), fw, bw, "forward" if fw >= bw else "backward", hideable)
