"""The partition pass: split a captured graph into stages.

``partition_stages(captured, model)`` labels every node with a stage and extracts one
GraphModule per stage, a pure function ``f(*params, *buffers, *inputs) -> (*outputs)``
(buffers the forward mutates are updated in place; the runtime hands a stage copies of them
when it recomputes). Stages are:

- **blocks** (default): the repeated blocks of one or several lists, auto-detected
  (:func:`find_block_lists`: the ModuleList/Sequential of same-type modules holding the most
  parameters, and every other one not nested in it with at least a quarter of its parameters,
  together at least half of the model's: T5's ``encoder.block`` and ``decoder.block``), or named
  with ``blocks="transformer.h"`` or ``blocks=["encoder.block", "decoder.block"]``. Everything
  before the first block is the *head* stage, everything after the last the *tail*, the code
  between two lists a *between* stage; code between blocks of one list joins the block before
  it. The lists must run one after the other.
- **by bytes** (fallback, or ``blocks=False``): ``num_stages`` stages (default up to 8) of about
  equal parameter bytes - for models without repeated blocks, e.g. a CNN with skip
  connections. Cuts go between modules: the top-level ones, and inside a module that holds more
  than its share, between its children (recursively); the largest stage is made as small as
  the modules allow. Asked for more stages than there are pieces holding bytes, it says so.

Stages without parameters or buffers are merged into a neighbour. A tensor used by several
stages (a tied embedding and head) is owned by the first and borrowed by the others.

``partition_stages`` runs these sub-passes in order, each a function of the capture and what
the earlier ones returned: :func:`label_stages`, :func:`merge_tensorless_stages`,
:func:`assign_owners`, :func:`check_mutated_buffers`, :func:`mark_differentiable`,
:func:`collect_boundary_values`, :func:`check_stage_inputs_unmodified`, :func:`build_stages`,
:func:`assign_update_groups`, :func:`collect_user_inputs` and :func:`add_memory_facts`.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import Captured, Placeholder
from .layout import FP32, Group, SlotPlan, TensorInfo, copy_dtypes, device_cast_groups, plan_groups, plan_slot
from .stages import StageSpec, Value
from .units import format_bytes

__all__ = [
    "Stage", "StageGraph", "ValueInfo", "PartitionError", "partition_stages", "find_blocks", "find_block_lists",
    "block_lists", "BlockList",
]


class PartitionError(ValueError):
    """The model cannot be split as asked; the message names the module or node and a fix."""


@dataclass(frozen=True)
class ValueInfo:
    """A tensor that crosses a stage boundary (or a user input/output)."""

    name: str
    producer: int  # stage index; -1 for a user input
    consumers: tuple[int, ...]  # stages reading it (besides the producer)
    differentiable: bool
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    input_index: int = -1  # position among the user's tensor inputs when producer == -1


@dataclass
class Stage:
    """One stage: its graph and everything the runtime needs to run it from a slot."""

    index: int
    name: str
    gm: fx.GraphModule
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    mutated_buffers: tuple[str, ...]
    trainable: tuple[str, ...]
    slot: SlotPlan
    spec: StageSpec
    num_ops: int


@dataclass
class StageGraph:
    """The partitioned model: stages, the values between them, and the host layout."""

    stages: list[Stage]
    values: dict[str, ValueInfo]
    inputs: list[str]  # value name of each user tensor input
    outputs: list[str]  # value name of each output tensor
    groups: list[Group]
    tensors: dict[str, TensorInfo]
    owner: dict[str, int]
    method: str  # "blocks:<path>[,<path>...]" or "bytes"
    notes: tuple[str, ...] = ()  # why the stages differ from what was asked (also warned at partition)

    @property
    def specs(self) -> list[StageSpec]:
        return [s.spec for s in self.stages]

    @property
    def slot_bytes(self) -> int:
        return max(s.slot.nbytes for s in self.stages)

    def describe(self) -> str:
        rows = [
            f"{len(self.stages)} stages ({self.method}); slot size {format_bytes(self.slot_bytes)}",
            f"  {'#':>3}  {'name':<24} {'ops':>5} {'params':>7} {'prefetch':>11} {'grads':>11} {'act out':>11}",
        ]
        for s in self.stages:
            out_bytes = sum(self.values[v].nbytes for v in s.outputs)
            rows.append(
                f"  {s.index:>3}  {s.name[:24]:<24} {s.num_ops:>5} {len(s.params):>7} {format_bytes(s.spec.prefetch_bytes):>11} "
                f"{format_bytes(s.spec.grad_bytes):>11} {format_bytes(out_bytes):>11}"
            )
        rows += [f"  note: {n}" for n in self.notes]
        return "\n".join(rows)


# ---- block detection ---------------------------------------------------------------------


def _numel(m: nn.Module) -> int:
    seen: set[int] = set()
    n = 0
    for p in m.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


@dataclass(frozen=True)
class BlockList:
    """A candidate list of repeated blocks: a ModuleList/Sequential of at least two modules of
    one type (``path`` "" is the model itself)."""

    path: str
    numel: int  # parameters it holds
    length: int
    block_type: str

    def describe(self, total: int) -> str:
        share = f", {100 * self.numel / total:.0f}% of the parameters" if total else ""
        return f"{self.path or '<the model>'} ({self.length} x {self.block_type}{share})"


def block_lists(model: nn.Module) -> list[BlockList]:
    """Every ModuleList/Sequential of at least two same-type modules in ``model``, largest
    (parameters, then length) first."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        types = {type(c) for c in mod.children()}
        if len(types) != 1:
            continue
        out.append(BlockList(name, _numel(mod), len(mod), next(iter(types)).__name__))
    return sorted(out, key=lambda c: (-c.numel, -c.length, c.path))


def _nested(a: str, b: str) -> bool:
    """True when one of the module paths ``a``, ``b`` is inside (or is) the other."""
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


# NOTE: a second list counts as repeated blocks only when it is of the same order of size as the
# largest (an encoder and a decoder); a ModuleList of norms or adapters next to the blocks does not.
_MIN_SECONDARY_FRACTION = 0.25


def find_block_lists(model: nn.Module, min_fraction: float = 0.5) -> list[str]:
    """The paths of the lists of repeated blocks to stage, in no particular order (the
    partition orders them as they run): the largest ModuleList/Sequential of same-type modules,
    and every other one not nested in a chosen list (or holding one) with at least a quarter of
    its parameters (T5's ``encoder.block`` and ``decoder.block``). Empty when the lists chosen
    hold less than ``min_fraction`` of the model's parameters.

    >>> import torch.nn as nn
    >>> class EncDec(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.enc = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    ...         self.dec = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    >>> sorted(find_block_lists(EncDec()))
    ['dec', 'enc']
    """
    total = _numel(model)
    cands = block_lists(model)
    if not cands or total == 0:
        return []
    chosen = [cands[0]]
    for c in cands[1:]:
        if c.numel >= _MIN_SECONDARY_FRACTION * chosen[0].numel and not any(_nested(c.path, d.path) for d in chosen):
            chosen.append(c)
    if sum(c.numel for c in chosen) < min_fraction * total:
        return []
    return [c.path for c in chosen]


def find_blocks(model: nn.Module, min_fraction: float = 0.5) -> str | None:
    """The path of the ModuleList/Sequential of same-type modules with the most parameters,
    if it holds at least ``min_fraction`` of the model's; else None (one list; see
    :func:`find_block_lists` for all of them)."""
    total = _numel(model)
    cands = block_lists(model)
    if not cands or total == 0 or cands[0].numel < min_fraction * total:
        return None
    return cands[0].path


def _wrong_blocks(model: nn.Module, what: str, why: str) -> PartitionError:
    total = _numel(model)
    cands = block_lists(model)
    found = "; ".join(c.describe(total) for c in cands[:12]) or "none"
    example = f" (blocks={[c.path for c in cands[:2]]!r})" if len(cands) > 1 else ""
    return PartitionError(
        f"blocks={what}: {why}. Lists of repeated blocks (ModuleList/Sequential of same-type modules) "
        f"in {type(model).__name__}: {found}. Name one or several of them{example}, pass blocks=None to "
        "detect them, or blocks=False to split by parameter bytes."
    )


def _resolve_one(model: nn.Module, b: Any, what: str) -> str:
    if isinstance(b, nn.Module):
        for name, mod in model.named_modules():
            if mod is b:
                return name
        raise _wrong_blocks(model, what, f"the module {type(b).__name__} is not part of the model")
    if isinstance(b, str):
        try:
            mod = model.get_submodule(b)
        except AttributeError:
            raise _wrong_blocks(model, what, f"the model has no submodule {b!r}") from None
        if len(list(mod.children())) < 1:
            raise _wrong_blocks(model, what, f"{b!r} is a {type(mod).__name__} with no child modules to make stages of")
        return b
    raise PartitionError(
        f"blocks= must be a module path (str), the container module, a list of those, None (auto) or False, "
        f"got {what}"
    )


def _resolve_blocks(model: nn.Module, blocks: Any) -> list[str]:
    """The container paths ``blocks=`` names (or detects, for None); empty for False."""
    if blocks is None:
        return find_block_lists(model)
    if blocks is False:
        return []
    if isinstance(blocks, (list, tuple)):
        if not blocks:
            raise PartitionError(
                "blocks=[] names no module: pass the paths of the repeated blocks, None to detect them, "
                "or False to split by parameter bytes"
            )
        paths = [_resolve_one(model, b, repr(blocks)) for b in blocks]
        for i, a in enumerate(paths):
            for b in paths[i + 1 :]:
                if _nested(a, b):
                    raise _wrong_blocks(
                        model, repr(blocks), f"{a!r} and {b!r} " + ("are the same module" if a == b else "are nested")
                    )
        return paths
    return [_resolve_one(model, blocks, repr(blocks))]


# ---- node labelling ------------------------------------------------------------------------


def _module_paths(node: fx.Node, prefix: str) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for v in stack.values():
        path = v[0] if isinstance(v, tuple) else str(v)
        if path.startswith(prefix):
            out.append(path[len(prefix) :])
        elif path + "." == prefix:
            out.append("")
    return out


def _block_of(node: fx.Node, prefix: str, containers: Sequence[str]) -> tuple[int, str] | None:
    """(which container, which block of it) ``node`` runs in, or None outside every block."""
    for p in _module_paths(node, prefix):
        for ci, container in enumerate(containers):
            head = container + "." if container else ""  # "": the model itself is the container (a Sequential)
            if p and p.startswith(head):
                return ci, p[len(head) :].split(".")[0]
    return None


def _is_root_level(node: fx.Node, prefix: str) -> bool:
    """True for operations written in the model's own forward, outside any submodule."""
    return all(p == "" for p in _module_paths(node, prefix))


def _label_blocks(
    nodes: list[fx.Node], prefix: str, containers: Sequence[str]
) -> tuple[dict[fx.Node, int], list[str]]:
    """Stages by repeated blocks of one or several lists (see :func:`label_stages`): the head,
    each list's blocks, a *between* stage before each list after the first, and the tail."""
    where = [_block_of(n, prefix, containers) for n in nodes]
    positions = [i for i, b in enumerate(where) if b is not None]
    if not positions:
        names = ", ".join(repr(c) for c in containers)
        raise PartitionError(
            f"no operation of the graph runs inside {names}; pass blocks= with the path of the "
            "repeated blocks (e.g. blocks='transformer.h'), or blocks=False to split by parameter bytes"
        )
    missing = [c for ci, c in enumerate(containers) if not any(b is not None and b[0] == ci for b in where)]
    if missing:
        raise PartitionError(
            f"no operation of the graph runs inside {', '.join(repr(c) for c in missing)} (named in blocks=); "
            "name only lists of blocks the forward runs, or blocks=False to split by parameter bytes"
        )
    # stages in the order the blocks first run; a between stage where the list changes
    names = ["head"]
    stage_of_block: dict[tuple[int, str], int] = {}
    between_before: dict[int, int] = {}  # container -> its between stage (lists after the first)
    lists_seen: list[int] = []
    for b in where:
        if b is None or b in stage_of_block:
            continue
        if lists_seen and b[0] != lists_seen[-1]:
            if b[0] in lists_seen:
                raise PartitionError(
                    f"the blocks of {_list_name(containers, b[0])!r} do not run one after another: block "
                    f"{_block_name(containers, b)} first runs after blocks of another list. shfx needs each list's "
                    "blocks to run in order, one list after the other; name one list in blocks=, or blocks=False."
                )
            between_before[b[0]] = len(names)
            names.append("between")
        if not lists_seen or lists_seen[-1] != b[0]:
            lists_seen.append(b[0])
        stage_of_block[b] = len(names)
        names.append(_block_name(containers, b))
    tail = len(names)
    names.append("tail")
    if len(between_before) > 1:
        for k, s in enumerate(sorted(between_before.values())):
            names[s] = f"between{k + 1}"
    # for each non-block position: the block before it and the block after it
    prev_block: list[tuple[int, str] | None] = []
    last = None
    for b in where:
        last = b if b is not None else last
        prev_block.append(last)
    next_block: list[tuple[int, str] | None] = [None] * len(where)
    nxt = None
    for i in range(len(where) - 1, -1, -1):
        nxt = where[i] if where[i] is not None else nxt
        next_block[i] = nxt
    labels: dict[fx.Node, int] = {}
    cur = 0
    for n, b, before, after in zip(nodes, where, prev_block, next_block):
        if b is not None:
            s = stage_of_block[b]
            if s < cur:
                raise PartitionError(
                    f"operation {n.name!r} of block {_block_name(containers, b)} runs after block {names[cur]}: "
                    f"shfx needs each block to run once, in order. Pass blocks= naming other modules, "
                    "or blocks=False to split by parameter bytes."
                )
            cur = s
        elif before is None:
            s = 0
        elif after is None or after[0] != before[0]:
            # NOTE: after the last block of a list, code of the model's own forward (not inside
            # a module) continues whatever it reads, e.g. the residual add of a loop
            # ``h = block(x); h += x``; modules (a final norm, the next list's embedding, the head)
            # and what follows form the between stage before the next list, or the tail.
            end = tail if after is None else between_before[after[0]]
            read = [labels[a] for a in n.all_input_nodes if a in labels]
            s = max(read) if _is_root_level(n, prefix) and read and max(read) < end else end
        else:
            s = cur
        labels[n] = s
    return labels, names


def _list_name(containers: Sequence[str], ci: int) -> str:
    return containers[ci] or "<the model>"


def _block_name(containers: Sequence[str], b: tuple[int, str]) -> str:
    return f"{containers[b[0]]}.{b[1]}" if containers[b[0]] else b[1]


def _unit_of(paths: Sequence[str], expanded: set[str]) -> str | None:
    """The module a node counts under in the byte split: the outermost module on its stack
    that is not expanded into its children. None for the model's own code, and for an expanded
    module's own code outside its children: such a node stays in the stage it falls in."""
    for p in paths:
        if p not in expanded:
            return p
    return None


def _uncuttable(captured: Captured, nodes: Sequence[fx.Node]) -> list[bool]:
    """For each position ``i``, whether a stage must not start at ``nodes[i]``: a node at or
    after ``i`` writes in place to a value computed before it, a buffer the forward mutates is
    read on both sides, or a value that is not a tensor would cross (the checks that
    :func:`check_stage_inputs_unmodified`, :func:`check_mutated_buffers` and
    :func:`collect_boundary_values` make on any partition)."""
    ph_info = _placeholder_info(captured)
    pos = {n: i for i, n in enumerate(nodes)}
    delta = [0] * (len(nodes) + 1)

    def forbid(a: int, b: int) -> None:  # no stage may start at a + 1 .. b
        if b > a:
            delta[a + 1] += 1
            delta[b + 1] -= 1

    reads: dict[str, list[int]] = {}
    for j, n in enumerate(nodes):
        for w in _written_args(n):
            base = _alias_base(w)
            if base in pos:
                forbid(pos[base], j)
        for a in _inputs_of(n):
            if a.op == "placeholder" and ph_info[a.name].key in captured.mutated_buffers:
                reads.setdefault(ph_info[a.name].key, []).append(j)
        users = [pos[u] for u in n.users if u in pos]
        if users and not isinstance(n.meta.get("val"), torch.Tensor):
            forbid(j, max(users))
    for js in reads.values():
        forbid(min(js), max(js))
    out: list[bool] = []
    acc = 0
    for i in range(len(nodes)):
        acc += delta[i]
        out.append(acc > 0)
    return out


@dataclass(frozen=True)
class _Piece:
    """A run of nodes between two places the byte split may cut."""

    start: int  # position of its first node
    nbytes: int  # parameter, buffer and constant bytes it is the first to read
    units: tuple[str, ...]  # the modules it runs, in order


def _pieces(
    nodes: Sequence[fx.Node], units: Sequence[str | None], uncuttable: Sequence[bool], first_use_bytes: dict[fx.Node, int]
) -> list[_Piece]:
    """Cut wherever the unit changes and a stage may start, into pieces."""
    starts = [0]
    prev = None
    for i, u in enumerate(units):
        if u is not None:
            if prev is not None and u != prev and not uncuttable[i]:
                starts.append(i)
            prev = u
    out = []
    for a, b in zip(starts, starts[1:] + [len(nodes)]):
        mods: list[str] = []
        for u in units[a:b]:
            if u is not None and (not mods or mods[-1] != u):
                mods.append(u)
        out.append(_Piece(a, sum(first_use_bytes.get(n, 0) for n in nodes[a:b]), tuple(mods)))
    return out


def _balanced_cuts(sizes: Sequence[int], k: int) -> list[int]:
    """Split ``sizes`` (each > 0) into ``k <= len(sizes)`` contiguous parts: the largest part
    as small as possible, then the sum of the parts' squares as small as possible (the parts
    as even as the largest allows). Returns the index where each part after the first starts.

    >>> _balanced_cuts([1, 1, 1, 1, 8], 3)
    [2, 4]
    """
    m = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)

    def parts_needed(limit: int) -> int:
        parts, acc = 1, 0
        for x in sizes:
            if acc + x > limit:
                parts, acc = parts + 1, 0
            acc += x
        return parts

    lo, hi = max(sizes), prefix[-1]
    while lo < hi:  # the smallest largest part
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if parts_needed(mid) <= k else (mid + 1, hi)
    limit = lo
    inf = float("inf")
    # best[c][j]: least sum of squares of j pieces in c parts, each at most ``limit``
    best = [[inf] * (m + 1) for _ in range(k + 1)]
    back = [[0] * (m + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for c in range(1, k + 1):
        for j in range(c, m - (k - c) + 1):
            for i in range(j - 1, c - 2, -1):
                part = prefix[j] - prefix[i]
                if part > limit:
                    break
                cand = best[c - 1][i] + part * part
                if cand < best[c][j]:
                    best[c][j], back[c][j] = cand, i
    cuts = []
    j = m
    for c in range(k, 1, -1):
        j = back[c][j]
        cuts.append(j)
    return cuts[::-1]


_DEFAULT_BYTE_STAGES = 8


def _label_bytes(
    captured: Captured, nodes: list[fx.Node], num_stages: int | None
) -> tuple[dict[fx.Node, int], list[str]]:
    """Stages of about equal parameter bytes, ``num_stages`` of them (default: up to 8).

    Cuts go between modules: first the top-level ones; a module holding more than its share
    (``1/num_stages`` of the bytes), or any module holding bytes while there are fewer pieces
    than stages asked, is split between its children, recursively. Then the pieces are
    grouped into stages, the largest stage as small as possible. Asked for more stages than
    there are pieces holding bytes, it says why.
    """
    prefix = captured.module_prefix
    first_use_bytes = _first_use_bytes(captured, nodes)
    paths = [[p for p in _module_paths(n, prefix) if p] for n in nodes]
    uncuttable = _uncuttable(captured, nodes)
    total = sum(first_use_bytes.values())
    want = num_stages if num_stages is not None else _DEFAULT_BYTE_STAGES
    expanded: set[str] = set()
    while True:
        units = [_unit_of(ps, expanded) for ps in paths]
        unit_bytes: dict[str, int] = {}
        divisible: set[str] = set()
        for n, ps, u in zip(nodes, paths, units):
            if u is not None:
                unit_bytes[u] = unit_bytes.get(u, 0) + first_use_bytes.get(n, 0)
                if ps[-1] != u:
                    divisible.add(u)
        pieces = _pieces(nodes, units, uncuttable, first_use_bytes)
        big = {u for u in divisible if unit_bytes[u] > total / want}
        if not big and sum(1 for p in pieces if p.nbytes) < want:
            holding = [u for u in divisible if unit_bytes[u]]
            big = {max(holding, key=lambda u: unit_bytes[u])} if holding else set()
        if not big:
            break
        expanded |= big
    # pieces without bytes join the piece before them (the first, the one after it)
    merged: list[_Piece] = []
    for p in pieces:
        if merged and (not p.nbytes or not merged[-1].nbytes):
            last = merged.pop()
            mods = last.units + p.units[1:] if last.units and p.units and last.units[-1] == p.units[0] else last.units + p.units
            merged.append(_Piece(last.start, last.nbytes + p.nbytes, mods))
        else:
            merged.append(p)
    holding = [p for p in merged if p.nbytes]
    if num_stages is not None and max(1, len(holding)) < num_stages:
        largest = max(holding, key=lambda p: p.nbytes) if holding else None
        detail = (
            f"; the largest, {_piece_name(largest)}, holds {format_bytes(largest.nbytes)} of {format_bytes(total)}"
            if largest
            else ""
        )
        raise PartitionError(
            f"num_stages={num_stages}: {captured.model_name} splits by parameter bytes into at most {len(holding)} "
            f"stages. The split cuts between modules (going down into submodules as far as needed) and never "
            f"inside one, and {len(holding)} pieces hold parameters or buffers{detail}. Use num_stages<={len(holding)}, "
            "or blocks= naming the repeated blocks."
        )
    k = max(1, min(want, len(holding)))
    cuts = _balanced_cuts([p.nbytes for p in merged], k) if k > 1 else []
    starts = [0] + [merged[c].start for c in cuts]
    labels: dict[fx.Node, int] = {}
    s = 0
    bounds = set(starts[1:])
    for i, n in enumerate(nodes):
        if i in bounds:
            s += 1
        labels[n] = s
    names = []
    for c0, c1 in zip([0] + cuts, cuts + [len(merged)]):
        mods = [u for p in merged[c0:c1] for u in p.units]
        start = merged[c0].start
        names.append(mods[0] if mods and mods[0] == mods[-1] else (f"{mods[0]}..{mods[-1]}" if mods else f"ops{start}"))
    return labels, names


def _piece_name(p: _Piece) -> str:
    if not p.units:
        return f"the code at node {p.start}"
    return p.units[0] if len(set(p.units)) == 1 else f"{p.units[0]}..{p.units[-1]}"


# ---- helpers over the FX graph ------------------------------------------------------------


def _inputs_of(n: fx.Node) -> list[fx.Node]:
    return list(n.all_input_nodes)


def _written_args(n: fx.Node) -> list[fx.Node]:
    """Argument nodes an op writes to in place (from its schema)."""
    t = n.target
    schema = getattr(t, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _alias_base(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and getattr(n.target, "is_view", False) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _storage_base(n: fx.Node) -> fx.Node:
    """The node whose memory ``n`` is: through views and through in-place ops, which return
    the tensor they write (``add_``, ``copy_``)."""
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node):
        schema = getattr(n.target, "_schema", None)
        aliases_first = (
            schema is not None
            and schema.returns
            and schema.returns[0].alias_info is not None
            and schema.arguments
            and schema.arguments[0].alias_info is not None
        )
        if not (getattr(n.target, "is_view", False) or aliases_first):
            break
        n = n.args[0]
    return n


def _is_float_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)


_NONDIFF_TARGETS = {torch.ops.aten.detach.default}
_OPERATIONS = ("call_function", "get_attr", "call_module", "call_method")


def _placeholder_info(captured: Captured) -> dict[str, Placeholder]:
    return {p.name: p for p in captured.placeholders}


def _keys_of(stage_nodes: Sequence[fx.Node], ph_info: dict[str, Placeholder]) -> list[str]:
    """The parameter, buffer and constant keys ``stage_nodes`` read, in first-use order."""
    out: list[str] = []
    for n in stage_nodes:
        for a in _inputs_of(n):
            if a.op == "placeholder" and ph_info[a.name].kind != "input":
                k = ph_info[a.name].key
                if k not in out:
                    out.append(k)
    return out


# ---- sub-passes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageLabels:
    """The stage of every operation node, and the stages' names.

    ``nodes`` are the captured graph's operation nodes (neither placeholders nor the output) in
    graph order; ``stage_of`` maps each to a stage in ``range(len(names))``.
    """

    nodes: tuple[fx.Node, ...]
    stage_of: dict[fx.Node, int] = field(hash=False)
    names: tuple[str, ...]
    method: str  # "blocks:<path>[,<path>...]" or "bytes"
    notes: tuple[str, ...] = ()  # why the stages are not what was asked (see StageGraph.notes)

    def members(self) -> list[list[fx.Node]]:
        """The operation nodes of each stage, in graph order (empty for an empty stage)."""
        out: list[list[fx.Node]] = [[] for _ in self.names]
        for n in self.nodes:
            out[self.stage_of[n]].append(n)
        return out


def _require_labels(labels: StageLabels, sub_pass: str) -> None:
    """Check that every operation node has a stage among the labelled ones."""
    for n in labels.nodes:
        s = labels.stage_of.get(n)
        if s is None or not 0 <= s < len(labels.names):
            raise PartitionError(
                f"{sub_pass}: node {n.name!r} has stage {s}, not one of the {len(labels.names)} labelled "
                "stages; pass the StageLabels that label_stages (and merge_tensorless_stages) returned"
            )


def _first_use_bytes(captured: Captured, nodes: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Bytes of the parameters, buffers and constants each node is the first to read."""
    ph_info = _placeholder_info(captured)
    tensor_obj = {**captured.params, **captured.buffers, **captured.constants}
    first_use_bytes: dict[fx.Node, int] = {}
    seen_keys: set[str] = set()
    for n in nodes:
        for a in _inputs_of(n):
            if a.op == "placeholder" and ph_info[a.name].kind != "input":
                key = ph_info[a.name].key
                if key not in seen_keys:
                    seen_keys.add(key)
                    t = tensor_obj[key]
                    first_use_bytes[n] = first_use_bytes.get(n, 0) + t.numel() * t.element_size()
    return first_use_bytes


def label_stages(
    captured: Captured,
    *,
    blocks: Any = None,
    num_stages: int | None = None,
    model: nn.Module | None = None,
) -> StageLabels:
    """Given a capture, return the stage of each operation node, by blocks or by bytes.

    With blocks (``blocks`` a path or the container module, a list of those, or None to detect
    every list in ``model``), the stages are the head, one per block of each list (a between
    stage before each list after the first) and the tail; otherwise cuts between
    modules balance parameter bytes over ``num_stages`` stages (see the module docstring and
    :func:`_label_bytes`). Then each ``getitem`` joins the stage of the tuple it reads and each
    ``get_attr`` (a higher-order op's body) the first stage that uses it. Stages may be empty
    or read no tensors; :func:`merge_tensorless_stages` folds them away.
    """
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise PartitionError(f"num_stages must be an int >= 1 (or None: up to 8 by parameter bytes), got {num_stages!r}")
    ph_info = _placeholder_info(captured)
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder" and n.name not in ph_info:
            raise PartitionError(
                f"label_stages: graph placeholder {n.name!r} is not in captured.placeholders; "
                "pass the Captured that capture_model returned for this graph"
            )
    nodes = [n for n in captured.gm.graph.nodes if n.op in _OPERATIONS]
    prefix = captured.module_prefix
    if model is not None:
        containers = _resolve_blocks(model, blocks)
    elif isinstance(blocks, str):
        containers = [blocks]
    elif isinstance(blocks, (list, tuple)) and all(isinstance(b, str) for b in blocks):
        containers = list(blocks)
    else:
        containers = []
    notes: list[str] = []
    if containers:
        try:
            labels, names = _label_blocks(nodes, prefix, containers)
        except PartitionError as e:
            if blocks is not None or len(containers) == 1:
                raise
            # NOTE: detected lists that do not run one after the other (a list of per-layer
            # adapters interleaved with the blocks): the largest list alone, as before.
            notes.append(
                f"blocks: the lists {', '.join(repr(c) for c in containers)} were detected, but {e} "
                f"Staged by {containers[0]!r} alone."
            )
            containers = containers[:1]
            labels, names = _label_blocks(nodes, prefix, containers)
        first_run = {c: names.index(next(n for n in names if _in_list(n, c))) for c in containers}
        containers = sorted(containers, key=first_run.__getitem__)
        method = "blocks:" + ",".join(containers)
        if num_stages is not None:
            notes.append(
                f"num_stages={num_stages} is not used when staging by repeated blocks ({', '.join(repr(c) for c in containers)}): "
                f"a stage per block, plus the code before, between and after them. Pass blocks=False to split "
                f"into num_stages stages by parameter bytes"
            )
    else:
        if blocks is None and num_stages is None and model is not None and len(list(model.children())) == 0:
            num_stages = 1
        labels, names = _label_bytes(captured, nodes, num_stages)
        method = "bytes"

    # getitem follows its source; get_attr (HOP bodies) follows its first user
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in labels:
            labels[n] = labels[n.args[0]]
    for n in nodes:
        if n.op == "get_attr" and n.users:
            labels[n] = min(labels[u] for u in n.users if u in labels)
    return StageLabels(tuple(nodes), labels, tuple(names), method, tuple(notes))


def _in_list(stage_name: str, container: str) -> bool:
    return stage_name not in ("head", "tail") and not stage_name.startswith("between") and (
        container == "" or stage_name.startswith(container + ".")
    )


def merge_tensorless_stages(captured: Captured, labels: StageLabels) -> StageLabels:
    """Given stage labels, return them with empty stages dropped and every stage that reads
    no parameter, buffer or constant merged into the next stage that does (into the last one
    before it when none follows); merged names are joined with ``+``.

    When no stage reads a tensor, everything merges into the first non-empty stage.
    """
    _require_labels(labels, "merge_tensorless_stages")
    ph_info = _placeholder_info(captured)
    members = labels.members()
    keep = [i for i, m in enumerate(members) if m]
    with_tensors = [i for i in keep if _keys_of(members[i], ph_info)] or keep[:1]
    remap: dict[int, int] = {}
    for i in keep:
        if i in with_tensors:
            remap[i] = i
        else:
            later = [j for j in with_tensors if j > i]
            remap[i] = later[0] if later else max(j for j in with_tensors if j < i)
    final = sorted(set(remap.values()))
    new_index = {old: new for new, old in enumerate(final)}
    merged_names: dict[int, list[str]] = {}
    for i in keep:
        merged_names.setdefault(new_index[remap[i]], []).append(labels.names[i])
    stage_of = {n: new_index[remap[labels.stage_of[n]]] for n in labels.nodes}
    names = tuple("+".join(merged_names[i]) for i in range(len(final)))
    return StageLabels(labels.nodes, stage_of, names, labels.method, labels.notes)


@dataclass(frozen=True)
class Ownership:
    """The host tensors each stage reads, and the host group that owns each."""

    tensors: dict[str, TensorInfo] = field(hash=False)  # every parameter, buffer and constant
    stage_keys: tuple[tuple[str, ...], ...]  # per stage, the keys it reads in first-use order
    groups: tuple[Group, ...]
    owner: dict[str, int] = field(hash=False)  # key -> index of the group that holds it


def assign_owners(captured: Captured, labels: StageLabels, groups: Sequence[Group] | None = None) -> Ownership:
    """Given merged stage labels, return the tensors each stage reads and the owner of each.

    Without ``groups``, a tensor is owned by the first stage that reads it (a tied weight by
    the earliest of its users) and one host group per stage is planned from what it owns.
    With ``groups`` (an earlier capture's layout), owners come from them, and a tensor that
    none of them holds is an error.
    """
    _require_labels(labels, "assign_owners")
    if groups is not None:
        for i, grp in enumerate(groups):
            if grp.index != i:
                raise PartitionError(
                    f"assign_owners: groups[{i}] has index {grp.index}; pass the groups of an earlier "
                    "StageGraph unchanged"
                )
    ph_info = _placeholder_info(captured)
    stage_keys = tuple(tuple(_keys_of(m, ph_info)) for m in labels.members())
    tensor_obj = {**captured.params, **captured.buffers, **captured.constants}
    tensors: dict[str, TensorInfo] = {}
    for p in captured.placeholders:
        if p.kind == "input":
            continue
        tensors[p.key] = TensorInfo.of(
            p.key, p.kind, tensor_obj[p.key], trainable=p.key in captured.trainable,
            mutable=p.key in captured.mutated_buffers, device_dtype=captured.device_dtypes.get(p.key),
        )  # fmt: skip
    if groups is None:
        owned: list[list[TensorInfo]] = [[] for _ in stage_keys]
        owner: dict[str, int] = {}
        for s, ks in enumerate(stage_keys):
            for k in ks:
                if k not in owner:
                    owner[k] = s
                    owned[s].append(tensors[k])
        wd = captured.working_dtype
        groups = plan_groups(owned, copy_dtypes(wd) if wd is not None else FP32)
    else:
        owner = {k: g.index for g in groups for k in g.keys}
        for ks in stage_keys:
            for k in ks:
                if k not in owner:
                    raise PartitionError(
                        f"{k!r} is used by this capture but was not used when the model was first captured; "
                        "shfx lays out host memory once per compiled model. Compile again (shfx.compile) for this use."
                    )
    return Ownership(tensors, stage_keys, tuple(groups), owner)


def check_mutated_buffers(captured: Captured, labels: StageLabels) -> None:
    """Given merged stage labels, check that every buffer the forward updates in place is
    read by one stage only (the stage copies it back to the host after its forward)."""
    _require_labels(labels, "check_mutated_buffers")
    ph_info = _placeholder_info(captured)
    mutated_by: dict[str, int] = {}
    for s, m in enumerate(labels.members()):
        for n in m:
            for a in _inputs_of(n):
                if a.op == "placeholder" and ph_info[a.name].key in captured.mutated_buffers:
                    k = ph_info[a.name].key
                    if mutated_by.setdefault(k, s) != s:
                        raise PartitionError(
                            f"buffer {k!r} is updated in place by the forward and used by stages "
                            f"{labels.names[mutated_by[k]]!r} and {labels.names[s]!r}; a mutated buffer must stay "
                            "in one stage. Pass blocks= so both uses fall into one stage."
                        )


def mark_differentiable(captured: Captured) -> dict[fx.Node, bool]:
    """Given a capture, return for each node (all but the output) whether its value needs a
    gradient: it is a floating-point tensor, or a tuple of results, computed from a trainable
    parameter or an input that requires grad, neither through ``detach`` nor inside a
    ``torch.no_grad()`` region; a ``getitem`` inherits the flag of the tuple it reads."""
    ph_info = _placeholder_info(captured)
    input_grad = {i: leaf[3] for i, leaf in enumerate(l for l in captured.signature.leaves if l[0] == "T")}
    for p in captured.placeholders:
        if p.kind == "input" and p.index not in input_grad:
            raise PartitionError(
                f"mark_differentiable: input placeholder {p.name!r} has index {p.index}, but captured.signature "
                f"has {len(input_grad)} tensor inputs; pass the Captured that capture_model returned"
            )
    needs_grad: dict[fx.Node, bool] = {}
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder":
            p = ph_info[n.name]
            needs_grad[n] = (p.kind == "param" and p.key in captured.trainable) or (p.kind == "input" and input_grad.get(p.index, False))
        elif n.op == "output":
            continue
        else:
            val = n.meta.get("val")
            src = any(needs_grad.get(a, False) for a in _inputs_of(n))
            if n.target in _NONDIFF_TARGETS:
                src = False
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "wrap_with_set_grad_enabled" and n.args and n.args[0] is False:
                src = False
            if n.op == "call_function" and n.target is operator.getitem:
                src = needs_grad.get(n.args[0], False)
            needs_grad[n] = bool(src) and (_is_float_tensor(val) or isinstance(val, (tuple, list)))
    return needs_grad


def collect_boundary_values(
    captured: Captured, labels: StageLabels, needs_grad: dict[fx.Node, bool]
) -> dict[str, ValueInfo]:
    """Given merged stage labels and :func:`mark_differentiable`'s flags, return a ValueInfo
    for every value a stage reads from another stage, every user input a stage reads and
    every output (in order of first use, outputs last), keyed by node name.

    Refuses an output that is a parameter or buffer itself and a value crossing stages that
    is not a tensor.
    """
    _require_labels(labels, "collect_boundary_values")
    ph_info = _placeholder_info(captured)
    stage_of = labels.stage_of
    consumers: dict[fx.Node, set[int]] = {}
    for s, m in enumerate(labels.members()):
        for n in m:
            for a in _inputs_of(n):
                if a.op == "placeholder":
                    if ph_info[a.name].kind == "input":
                        consumers.setdefault(a, set()).add(s)
                elif stage_of[a] != s:
                    if stage_of[a] > s:  # pragma: no cover - labels are monotone in graph order
                        raise PartitionError(f"node {n.name!r} in stage {s} reads {a.name!r} from a later stage")
                    consumers.setdefault(a, set()).add(s)
    for o in captured.outputs:
        if o.op == "placeholder" and ph_info[o.name].kind != "input":
            raise PartitionError(
                f"{captured.model_name} returns the {ph_info[o.name].kind} {ph_info[o.name].key!r} itself; shfx keeps "
                "parameters and buffers on the host. Return a copy (e.g. weight.clone()) or read it from the model."
            )
        consumers.setdefault(o, set())

    values: dict[str, ValueInfo] = {}
    for v, cons in consumers.items():
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise PartitionError(
                f"value {v.name!r} crosses from stage {stage_of.get(v, -1)} to {sorted(cons)} but is not a tensor "
                f"({type(val).__name__}); choose other stage boundaries with blocks="
            )
        producer = -1 if v.op == "placeholder" else stage_of[v]
        values[v.name] = ValueInfo(
            name=v.name,
            producer=producer,
            consumers=tuple(sorted(c for c in cons if c != producer)),
            differentiable=bool(needs_grad.get(v, False)) and _is_float_tensor(val),
            nbytes=val.numel() * val.element_size(),
            shape=tuple(val.shape),
            dtype=val.dtype,
            input_index=ph_info[v.name].index if v.op == "placeholder" else -1,
        )
    return values


def check_stage_inputs_unmodified(captured: Captured, labels: StageLabels) -> None:
    """Given merged stage labels, check that no stage writes in place to a value it reads
    from a user input or another stage (a stage is recomputed from its inputs)."""
    _require_labels(labels, "check_stage_inputs_unmodified")
    ph_info = _placeholder_info(captured)
    for s, m in enumerate(labels.members()):
        for n in m:
            for w in _written_args(n):
                base = _alias_base(w)
                if base.op == "placeholder" and ph_info[base.name].kind == "input" or (
                    base.op != "placeholder" and labels.stage_of.get(base, s) != s
                ):
                    raise PartitionError(
                        f"stage {labels.names[s]!r} modifies its input {base.name!r} in place ({n.name}: {n.target}); "
                        "shfx recomputes stages from their inputs, so they must not change. Make the operation "
                        "out of place (x = x + y rather than x += y)."
                    )


def _stage_module(
    captured: Captured,
    s: int,
    members: Sequence[fx.Node],
    keys: Sequence[str],
    ins: Sequence[str],
    outs: Sequence[str],
    by_name: dict[str, fx.Node],
) -> fx.GraphModule:
    """Stage ``s``'s graph ``f(*keys, *ins) -> outs``: its nodes copied from the capture."""
    g = fx.Graph()
    key_ph = {k: g.placeholder(_safe(k)) for k in keys}
    env: dict[fx.Node, fx.Node] = {}
    for v in ins:
        env[by_name[v]] = g.placeholder("in_" + v)
    for p in captured.placeholders:
        if p.kind != "input" and p.key in key_ph:
            env[by_name[p.name]] = key_ph[p.key]
    for n in members:
        env[n] = g.node_copy(n, lambda a: env[a])
    kinds = {p.name: p.kind for p in captured.placeholders}
    results = []
    for o in outs:
        r = env[by_name[o]]
        base = _storage_base(by_name[o])
        if base.op == "placeholder" and kinds[base.name] != "input":
            # NOTE: an output that is a parameter or buffer, or a view or in-place result of one
            # (``b.cnt.add_(1)`` in the parent's loop, read by the next stage), would hand the
            # next stage memory of this stage's slot, which the next prefetch overwrites: it
            # leaves as a copy, as the value was when this stage ran.
            r = g.call_function(torch.ops.aten.clone.default, (r,))
            r.meta = {"val": by_name[o].meta.get("val")}
        results.append(r)
    g.output(tuple(results))
    return fx.GraphModule(captured.gm, g, class_name=f"Stage{s}")


def build_stages(
    captured: Captured, labels: StageLabels, ownership: Ownership, values: dict[str, ValueInfo]
) -> list[Stage]:
    """Given merged stage labels, :func:`assign_owners`' ownership and
    :func:`collect_boundary_values`' values, return the stages: each one's GraphModule
    ``f(*params, *buffers, *inputs) -> (*outputs)``, slot plan and StageSpec.

    A stage updates its own group when it owns trainable parameters in it;
    :func:`assign_update_groups` places the groups left over.
    """
    _require_labels(labels, "build_stages")
    if len(ownership.stage_keys) != len(labels.names):
        raise PartitionError(
            f"build_stages: the ownership covers {len(ownership.stage_keys)} stages but the labels have "
            f"{len(labels.names)}; pass the Ownership that assign_owners returned for these labels"
        )
    ph_info = _placeholder_info(captured)
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    out_values = {o.name for o in captured.outputs}
    groups, owner, stage_keys = ownership.groups, ownership.owner, ownership.stage_keys
    stages: list[Stage] = []
    members = list(labels.members())
    # every stage's tensors and slot first: which groups' gradients are cast on the device
    # depends on every slot's copies
    tensors = []  # per stage: (params, buffers, mutated buffers, trainable params)
    for keys in stage_keys[: len(members)]:
        params = tuple(k for k in keys if ownership.tensors[k].kind == "param")
        bufs = tuple(k for k in keys if ownership.tensors[k].kind != "param")
        tensors.append((params, bufs, tuple(k for k in bufs if k in captured.mutated_buffers),
                        tuple(k for k in params if k in captured.trainable)))  # fmt: skip
    slots = [plan_slot(s, stage_keys[s], mut, tr, groups, owner) for s, (_, _, mut, tr) in enumerate(tensors)]
    cast = device_cast_groups(groups, slots)
    for s, m in enumerate(members):
        name = labels.names[s]
        params, bufs, mutated, trainable = tensors[s]
        ins: list[str] = []
        for n in m:
            for a in _inputs_of(n):
                if (a.op == "placeholder" and ph_info[a.name].kind == "input") or (
                    a.op != "placeholder" and labels.stage_of[a] != s
                ):
                    if a.name not in values:
                        raise PartitionError(
                            f"build_stages: stage {name!r} reads {a.name!r}, which has no ValueInfo; pass the "
                            "values that collect_boundary_values returned for these labels"
                        )
                    if a.name not in ins:
                        ins.append(a.name)
        outs = [n.name for n in m if n.name in values and (values[n.name].consumers or n.name in out_values)]
        slot = slots[s]
        owns_update = s < len(groups) and groups[s].trainable_bytes > 0 and owner_stage_is(groups, s, owner, stage_keys)
        update_group = s if owns_update else None
        spec = StageSpec(
            index=s,
            name=name,
            producers=frozenset(values[v].producer for v in ins if values[v].producer >= 0),
            prefetch_bytes=SlotPlan.total(slot.prefetch),
            grad_bytes=SlotPlan.total(slot.grads),
            buffer_out_bytes=SlotPlan.total(slot.buffers_out),
            grad_groups=frozenset(c.group for c in slot.grads),
            update_group=update_group,
            activation_bytes=sum(values[v].nbytes for v in outs),
            slot_bytes=slot.nbytes,
            update_bytes=groups[update_group].master_bytes if update_group is not None else 0,
            image_bytes=groups[update_group].nbytes if update_group is not None else 0,
            device_master_bytes=_device_master_bytes(groups, update_group),
            grad_group_bytes=tuple(sorted(_sum_by_group(slot.grads).items())),
            grad_wire_bytes=tuple(sorted((c.group, groups[c.group].grad_bytes) for c in slot.grads if c.group in cast)),
        )
        stages.append(
            Stage(
                index=s,
                name=name,
                gm=_stage_module(captured, s, m, params + bufs, ins, outs, by_name),
                params=params,
                buffers=bufs,
                inputs=tuple(ins),
                outputs=tuple(outs),
                mutated_buffers=mutated,
                trainable=trainable,
                slot=slot,
                spec=spec,
                num_ops=sum(1 for n in m if n.op == "call_function"),
            )
        )
    return stages


def assign_update_groups(stages: Sequence[Stage], groups: Sequence[Group]) -> list[Stage]:
    """Given the built stages, return them with every group that has trainable bytes but no
    updating stage given to the first stage that sends it gradients, if that stage updates
    no group yet (a group whose owner stage does not read it, as with reused groups)."""
    for i, st in enumerate(stages):
        if st.index != i:
            raise PartitionError(f"assign_update_groups: stage {st.name!r} has index {st.index} but is at position {i}")
    out = list(stages)
    claimed = {st.spec.update_group for st in stages if st.spec.update_group is not None}
    for grp in groups:
        if grp.trainable_bytes and grp.index not in claimed:
            users = [st for st in out if grp.index in st.spec.grad_groups]
            if users and users[0].spec.update_group is None:
                st = users[0]
                out[st.index] = replace(st, spec=replace(
                    st.spec, update_group=grp.index, update_bytes=grp.master_bytes, image_bytes=grp.nbytes,
                    device_master_bytes=_device_master_bytes(groups, grp.index),
                ))  # fmt: skip
    return out


def _device_master_bytes(groups: Sequence[Group], g: int | None) -> int:
    """The fp32 master a device update of group ``g`` keeps on the device (mixed precision)."""
    return groups[g].master_bytes if g is not None and groups[g].dtypes.mixed else 0


def collect_user_inputs(captured: Captured, values: dict[str, ValueInfo]) -> tuple[list[str], dict[str, ValueInfo]]:
    """Given the boundary values, return the value name of each user tensor input (by
    position) and the values with a ValueInfo added for each input no stage reads."""
    inputs = [p for p in captured.placeholders if p.kind == "input"]
    if sorted(p.index for p in inputs) != list(range(len(inputs))):
        raise PartitionError(
            f"collect_user_inputs: the input placeholders' indices {sorted(p.index for p in inputs)} are not "
            f"0..{len(inputs) - 1}; pass the Captured that capture_model returned"
        )
    by_name = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    input_names = [""] * len(inputs)
    values = dict(values)
    for p in inputs:
        input_names[p.index] = p.name
        if p.name not in values:
            val = by_name[p.name].meta.get("val")
            values[p.name] = ValueInfo(
                p.name, -1, (), False, val.numel() * val.element_size(), tuple(val.shape), val.dtype, p.index
            )
    return input_names, values


def partition_stages(
    captured: Captured,
    *,
    blocks: Any = None,
    num_stages: int | None = None,
    groups: Sequence[Group] | None = None,
    model: nn.Module | None = None,
) -> StageGraph:
    """Split ``captured`` into stages (see the module docstring).

    ``groups`` is the host layout of an earlier capture of the same model; when given, tensors
    keep their owners from it (the host store is shared by every capture) and slots borrow
    what does not match. ``model`` is needed for block detection.

    The sub-passes run in this order; each raises :class:`PartitionError` naming the node or
    stage at fault.
    """
    labels = label_stages(captured, blocks=blocks, num_stages=num_stages, model=model)
    asked = labels.names
    labels = merge_tensorless_stages(captured, labels)
    notes = list(labels.notes)
    if labels.method == "bytes" and num_stages is not None and len(labels.names) < num_stages:
        gone = [n for n in asked if n not in labels.names and not any(n in m.split("+") for m in labels.names)]
        merged = [m for m in labels.names if "+" in m]
        notes.append(
            f"num_stages={num_stages}: {captured.model_name} gives {len(labels.names)} stages, not {num_stages}: "
            f"a stage that reads no parameter, buffer or constant joins a neighbour "
            f"({', '.join(merged) or ', '.join(gone) or 'empty stages'}). Pass num_stages<={len(labels.names)} to "
            "say so, or blocks= naming the repeated blocks"
        )
    for note in notes:
        warnings.warn(note + ".", stacklevel=2)
    ownership = assign_owners(captured, labels, groups)
    check_mutated_buffers(captured, labels)
    needs_grad = mark_differentiable(captured)
    values = collect_boundary_values(captured, labels, needs_grad)
    check_stage_inputs_unmodified(captured, labels)
    stages = build_stages(captured, labels, ownership, values)
    stages = assign_update_groups(stages, ownership.groups)
    inputs, values = collect_user_inputs(captured, values)
    stages = add_memory_facts(stages, values, inputs, [o.name for o in captured.outputs], ownership)
    return StageGraph(
        stages=stages,
        values=values,
        inputs=inputs,
        outputs=[o.name for o in captured.outputs],
        groups=list(ownership.groups),
        tensors=ownership.tensors,
        owner=ownership.owner,
        method=labels.method,
        notes=tuple(notes),
    )


def add_memory_facts(
    stages: Sequence[Stage], values: dict[str, ValueInfo], inputs: Sequence[str], outputs: Sequence[str], ownership: Ownership
) -> list[Stage]:
    """Given the built stages, the boundary values, the model's inputs and outputs and the
    ownership of tensors, return the stages with what the memory ledger (:mod:`shfx.passes.ledger`)
    replays in their specs: the values each stage reads and produces, the model's inputs (on
    stage 0), the bytes of the buffers its forward mutates, the bytes of one optimizer state of
    the group it updates, and the trainable tensors it borrows from other groups."""
    outs = set(outputs)

    def value(name: str) -> Value:
        v = values[name]
        return Value(name, v.nbytes, v.producer, tuple(v.consumers), v.differentiable, name in outs)

    groups, tensors, owner = ownership.groups, ownership.tensors, ownership.owner
    result = []
    for st in stages:
        sp = st.spec
        own = sp.update_group
        spec = replace(
            sp,
            inputs=tuple(value(v) for v in st.inputs),
            outputs=tuple(value(v) for v in st.outputs),
            model_inputs=tuple(value(v) for v in inputs) if st.index == 0 else (),
            recompute_buffer_bytes=sum(tensors[k].nbytes for k in st.mutated_buffers),
            state_bytes=groups[own].state_bytes if own is not None else 0,
            borrowed_grads=tuple((k, owner[k], tensors[k].nbytes) for k in st.trainable if owner[k] != own),
        )
        result.append(replace(st, spec=spec))
    return result


def owner_stage_is(groups: Sequence[Group], s: int, owner: dict[str, int], stage_keys: Sequence[Sequence[str]]) -> bool:
    """True when stage ``s`` uses group ``s``'s tensors (so it can own the group's update)."""
    return any(owner.get(k) == s for k in stage_keys[s])


def _sum_by_group(copies) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in copies:
        out[c.group] = out.get(c.group, 0) + c.nbytes
    return out


def _safe(key: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in key)
    return out if out and not out[0].isdigit() else "t_" + out
