"""Give captured attention back the kernel eager PyTorch runs: causal masks that only exist
because the model was exported.

Hugging Face models (``attn_implementation="sdpa"``, the default) decide at run time whether
to build an attention mask: eagerly, with no padding (``attention_mask`` absent or all ones)
and ``q_len == kv_len``, ``masking_utils._ignore_causal_mask_sdpa`` drops the mask and
``sdpa_attention_forward`` calls ``scaled_dot_product_attention(q, k, v, is_causal=True)``,
with ``enable_gqa=True`` instead of ``repeat_kv`` where keys and values have fewer heads. Under
``torch.export`` it never drops the mask (``is_torchdynamo_exporting()``), so the captured
graph calls SDPA with an explicit, expanded causal mask ``[B, 1, S, S]`` built from
``arange`` and comparisons, and with keys and values repeated to the query's heads. Another
kernel then runs: on a GPU an explicit mask rules out the flash kernel; on the CPU the mask
itself changes no bit (SDPA with the causal mask equals ``is_causal=True``, forward and
backward, bool and additive masks), but the repeated keys and values sum their gradients in
another order than ``enable_gqa`` (a GQA Llama's bf16 weights differ from the eager recipe's
after one step).

:func:`restore_causal_attention` rewrites each ``aten.scaled_dot_product_attention`` node whose
mask is *provably* the lower-triangular causal mask of its query/key length:

- the mask's subgraph is evaluated: it may read only constants (the graph's lifted tensor
  constants, scalars) and the sizes of other tensors (``sym_size``); a user input (a padding
  ``attention_mask``), a parameter or a buffer anywhere in it, a random op, or a higher-order
  op leave the node as it is;
- the value must equal the causal pattern (bool: ``tril``; additive: 0 on and below the
  diagonal, ``-inf`` or the dtype's most negative finite value above it), broadcast to the
  attention's shape, with ``q_len == kv_len`` (torch's ``is_causal`` is top-left aligned, a
  cache's causal mask bottom-right: they agree only on a square); with dynamic dimensions, at
  the captured sizes and at a second size of each dynamic dimension;
- then the node becomes ``is_causal=True, attn_mask=None`` (a length-1 query: no mask,
  ``is_causal=False``, as Hugging Face calls it), dropout and scale unchanged; and, where the
  keys and values are Hugging Face's ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``
  traced from the ``transformers`` package) with equal head dims <= 256, the node reads the
  unrepeated keys and values with ``enable_gqa=True``, as ``use_gqa_in_sdpa`` chooses without
  a mask. The mask's computation, left without users, is removed.

Only SDPA calls traced from the ``transformers`` package are rewritten (``sources``): there
eager would have made the causal call itself. A model that passes a hand-built causal mask
eagerly (``torch.ones(S, S).tril()``) runs the masked kernel eagerly, so shfx keeps its mask
(on the CPU the two are bitwise the same; on a GPU they are different kernels, and the recipe
is the user's). ``restore_causal_attention(gm, sources=None)`` rewrites any provably causal
mask (what the tests use to check the mask analysis on hand-written masks).

Not rewritten, by design: a mask that depends on a user input. That is the same recipe as eager
when the input masks something, but when it is all ones eager Hugging Face drops the mask by
looking at its *values* (``padding_mask.all()``), which a capture cannot know for later calls:
there shfx keeps the mask (on the CPU bitwise the same for equal head counts; GQA models differ
as above). Pass no ``attention_mask`` for unpadded batches.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "restore_causal_attention", "restore_causal_attention_in_export", "causal_pattern_of", "pin_attention_grad_mode",
    "sdpa_as_trained", "training_forward", "requires_grad_in_training",
]  # fmt: skip

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SYM_SIZE = torch.ops.aten.sym_size.int
_GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa: head dims the fused kernels take
_MAX_ELEMENTS = 1 << 28  # masks evaluated up to this many elements (a [8, 1, 4096, 4096] mask is 2**27)


class _NotConstant(Exception):
    """The mask depends on something other than constants and sizes."""


def restore_causal_attention_in_export(ep: Any, sources: tuple[str, ...] | None = ("transformers",)) -> list[str]:
    """:func:`restore_causal_attention` on ``ep.graph_module`` (a ``torch.export.ExportedProgram``),
    with its lifted tensor constants as the only tensors a mask may read."""
    gm = ep.graph_module
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {}
    for node, spec in zip(phs, ep.graph_signature.input_specs):
        if spec.kind.name == "CONSTANT_TENSOR" and spec.target in ep.constants:
            constants[node.name] = ep.constants[spec.target]
    return restore_causal_attention(gm, constants, sources)


def restore_causal_attention(
    gm: fx.GraphModule, constants: Mapping[str, torch.Tensor] | None = None, sources: tuple[str, ...] | None = ("transformers",)
) -> list[str]:
    """Rewrite the SDPA nodes of ``gm`` whose mask is provably causal (module docstring).

    ``constants``: placeholder name -> its value, for placeholders that are constants (every
    other placeholder is a user input, parameter or buffer, whose values a mask must not read).
    ``sources``: rewrite only SDPA calls traced from these packages (None: any).
    Returns the names of the rewritten nodes."""
    constants = dict(constants or {})
    g = gm.graph
    verdicts: dict[tuple, bool] = {}
    rewritten: list[str] = []
    dead: set[fx.Node] = set()
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        q, k, v, mask, dropout_p, is_causal = _sdpa_args(node)
        if mask is None or is_causal or not isinstance(mask, fx.Node):
            continue
        if sources is not None and not any(_traced_from(node, pkg) for pkg in sources):
            continue  # the model's own masked call: eager runs it masked too
        key = (mask, str(_shape(q)[-2:]), str(_shape(k)[-2:]))
        if key not in verdicts:
            verdicts[key] = _is_causal_mask(mask, q, k, constants)
        if not verdicts[key]:
            continue
        dead.update(_ancestors(mask, constants) or ())
        q_len = _shape(q)[-2]
        kwargs = dict(node.kwargs)
        kwargs.pop("attn_mask", None)
        kwargs.pop("dropout_p", None)
        kwargs.pop("is_causal", None)
        if not (isinstance(q_len, int) and q_len == 1):
            k0, v0, gqa = _unrepeated_kv(q, k, v)
            if gqa:
                dead.update(_repeat_chain(k) + _repeat_chain(v))
                k, v = k0, v0
                kwargs["enable_gqa"] = True
        causal = not (isinstance(q_len, int) and q_len == 1)
        node.args = (q, k, v, None, dropout_p, causal)
        node.kwargs = kwargs
        rewritten.append(node.name)
    if rewritten:
        _drop_unused(g, dead)
        g.lint()
        gm.recompile()
    return rewritten


def causal_pattern_of(q_len: int, kv_len: int) -> torch.Tensor:
    """The boolean causal pattern torch's ``is_causal=True`` applies (top-left aligned)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril()


def _sdpa_args(node: fx.Node) -> tuple:
    a = list(node.args) + [None] * (6 - len(node.args))
    q, k, v = a[0], a[1], a[2]
    mask = a[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout_p = a[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    is_causal = a[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return q, k, v, mask, dropout_p, is_causal


def _shape(n: Any) -> tuple:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _symbols(values: list) -> dict:
    """The sympy symbols behind the SymInts in ``values`` -> (their example value, a second
    value in their range), and the shape environment."""
    out: dict = {}
    for s in values:
        if isinstance(s, torch.SymInt):
            node = s.node
            env = node.shape_env
            for sym in node.expr.free_symbols:
                if sym in out:
                    continue
                known = getattr(env, "backed_var_to_val", None) or env.var_to_val
                val = int(known.get(sym, 2))
                vr = env.var_to_range.get(sym)
                hi = _finite(vr.upper) if vr is not None else None
                lo = _finite(vr.lower) if vr is not None else None
                other = val + 1 if hi is None or val + 1 <= hi else val - 1
                if lo is not None and other < lo:
                    other = val
                out[sym] = (val, other)
    return out


def _finite(x: Any) -> int | None:
    try:
        v = int(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if abs(v) < 1 << 62 else None


def _concrete(x: Any, env: dict) -> Any:
    if isinstance(x, torch.SymInt):
        import sympy

        return int(x.node.expr.xreplace({s: sympy.Integer(env[s]) for s in x.node.expr.free_symbols}))
    return x


def _is_causal_mask(mask: fx.Node, q: Any, k: Any, constants: Mapping[str, torch.Tensor]) -> bool:
    qs, ks = _shape(q), _shape(k)
    if len(qs) < 2 or len(ks) < 2:
        return False
    subgraph = _ancestors(mask, constants)
    if subgraph is None:
        return False
    leaves = [n.meta.get("val") for n in subgraph if n.op == "call_function" and n.target is _SYM_SIZE]
    syms = _symbols(leaves + list(qs) + list(ks))
    envs = [{s: v[0] for s, v in syms.items()}]
    if syms:
        envs.append({s: v[1] for s, v in syms.items()})
    for env in envs:
        q_len, kv_len = _concrete(qs[-2], env), _concrete(ks[-2], env)
        if q_len != kv_len:
            return False  # is_causal is top-left aligned; a cache's mask is bottom-right
        try:
            value = _evaluate(subgraph, mask, env, constants)
        except _NotConstant:
            return False
        except Exception:  # noqa: BLE001 - a mask we cannot evaluate stays as it is
            return False
        if not _matches_causal(value, q_len, kv_len):
            return False
    return True


def _ancestors(mask: fx.Node, constants: Mapping[str, torch.Tensor]) -> list[fx.Node] | None:
    """The nodes the mask is computed from, in graph order; ``sym_size`` nodes are leaves (only
    a size is read). None when a placeholder other than a constant (a user input, parameter,
    buffer), a get_attr or a non-function node is reached other than through a size."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name not in constants:
                return None
            continue
        if n.op != "call_function":
            return None
        if n.target is _SYM_SIZE:
            continue
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(subgraph: list[fx.Node], mask: fx.Node, env: dict, constants: Mapping[str, torch.Tensor]) -> Any:
    values: dict[fx.Node, Any] = {}
    for n in subgraph:
        if n.op == "placeholder":
            if n.name not in constants:
                raise _NotConstant(n.name)
            c = constants[n.name]
            if c.is_meta:
                raise _NotConstant(n.name)
            values[n] = c
            continue
        if n.target is _SYM_SIZE:
            val = n.meta.get("val")
            if val is None:
                raise _NotConstant(n.name)
            values[n] = _concrete(val, env)
            continue
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
                raise _NotConstant(n.name)
        elif not (getattr(target, "__module__", None) in ("_operator", "operator", "math") or target in vars(operator).values()):
            raise _NotConstant(n.name)  # a higher-order op, a Python function: not evaluated
        args = fx.map_arg(n.args, values.__getitem__)
        kwargs = fx.map_arg(n.kwargs, values.__getitem__)
        args, kwargs = _on_cpu(args), _on_cpu(kwargs)
        out = target(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.numel() > _MAX_ELEMENTS:
            raise _NotConstant(n.name)
        values[n] = out
    return values[mask]


def _on_cpu(x: Any) -> Any:
    """Device arguments to the CPU (a model captured on the meta device bakes device="meta")."""
    if isinstance(x, torch.device) and x.type != "cpu":
        return torch.device("cpu")
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(v) for v in x)
    return x


def _matches_causal(value: Any, q_len: int, kv_len: int) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (q_len, kv_len):
        return False
    if value.numel() > _MAX_ELEMENTS:
        return False
    pattern = causal_pattern_of(q_len, kv_len)
    if value.dtype == torch.bool:
        return bool(torch.equal(value, pattern.expand_as(value)))
    if not value.is_floating_point():
        return False
    keep = pattern.expand_as(value)
    if not bool((value[keep] == 0).all()):
        return False
    masked = value[~keep]
    lowest = torch.finfo(value.dtype).min
    return bool(((masked == float("-inf")) | (masked == lowest)).all())


# --- keys and values repeated to the query's heads (transformers' repeat_kv) ----------------------

_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _unrepeated_kv(q: Any, k: Any, v: Any) -> tuple[Any, Any, bool]:
    """``(k0, v0, True)`` where ``k`` and ``v`` are transformers' ``repeat_kv`` of ``k0`` and
    ``v0`` by the same factor (eager passes ``enable_gqa=True`` instead); else ``(k, v, False)``."""
    k0, rk = _repeat_source(k)
    v0, rv = _repeat_source(v)
    if k0 is None or v0 is None or rk != rv or rk < 2:
        return k, v, False
    qs, ks, vs = _shape(q), _shape(k0), _shape(v0)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return k, v, False
    if not (isinstance(ks[-1], int) and ks[-1] == vs[-1] and ks[-1] <= _GQA_MAX_HEAD_DIM):
        return k, v, False
    return k0, v0, True


def _repeat_source(x: Any) -> tuple[fx.Node | None, int]:
    """``hidden[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)`` -> (hidden, n_rep)."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _VIEWS):
        return None, 0
    e = x.args[0]
    if not (isinstance(e, fx.Node) and e.target is torch.ops.aten.expand.default):
        return None, 0
    u = e.args[0]
    if not (isinstance(u, fx.Node) and u.target is torch.ops.aten.unsqueeze.default and u.args[1] == 2):
        return None, 0
    src = u.args[0]
    if not all(_from_transformers(n) for n in (x, e, u)) or not isinstance(src, fx.Node):
        return None, 0
    ss, es, xs = _shape(src), _shape(e), _shape(x)
    if len(ss) != 4 or len(es) != 5 or len(xs) != 4:
        return None, 0
    b, h, s, d = ss
    n_rep = es[2]
    if not isinstance(n_rep, int) or es != (b, h, n_rep, s, d) or xs != (b, h * n_rep, s, d):
        return None, 0
    return src, n_rep


def _repeat_chain(x: fx.Node) -> list[fx.Node]:
    """The reshape, expand and unsqueeze of a ``repeat_kv`` (:func:`_repeat_source`)."""
    e = x.args[0]
    return [x, e, e.args[0]]


def _traced_from(n: fx.Node, package: str) -> bool:
    """Some frame of the node's trace is in ``package`` (an SDPA call is traced through torch's
    own functional wrapper: the package's frame is not the innermost one)."""
    trace = n.meta.get("stack_trace") or ""
    return f"/{package}/" in trace or f"\\{package}\\" in trace


def _from_transformers(n: fx.Node) -> bool:
    """The node was traced from code in the ``transformers`` package (its innermost frame)."""
    trace = n.meta.get("stack_trace") or ""
    files = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return bool(files) and ("/transformers/" in files[-1] or "\\transformers\\" in files[-1])


def _drop_unused(g: fx.Graph, candidates: set[fx.Node]) -> None:
    """Erase the candidates (the rewritten masks' computations, the replaced key/value
    repetitions) left without users; users come later in the graph, so one reverse sweep."""
    for n in reversed(list(g.nodes)):
        if n in candidates and n.op == "call_function" and not n.users:
            g.erase_node(n)


# ---- attention in a forward without autograd: the kernel eager's training forward runs ----------

_TRAINING = threading.local()
_WRAP_GRAD = getattr(getattr(torch.ops, "higher_order", None), "wrap_with_set_grad_enabled", None)

#: ops whose outputs never require grad, whatever their inputs (factories reading only a
#: tensor's shape, dtype and device; ``detach``)
_NO_GRAD_OUTPUT = {
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "detach",
}  # fmt: skip


@contextlib.contextmanager
def training_forward() -> Iterator[None]:
    """The calling thread runs a training step's forward without autograd (a checkpointed
    stage, recomputed in its backward): :func:`sdpa_as_trained` then runs attention as eager's
    forward, under autograd, would."""
    prev = getattr(_TRAINING, "on", False)
    _TRAINING.on = True
    try:
        yield
    finally:
        _TRAINING.on = prev


def sdpa_as_trained(*args: Any, _shfx_grads: tuple[bool, ...] = (), **kwargs: Any) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` as eager's training forward runs it.

    The CPU's math kernel computes another way (other bits) when autograd records it: eagerly
    in training, q, k, v (and a learned mask: T5's position bias) require grad. A stage's forward
    without autograd (``torch.no_grad()``, recomputed in the backward) would run the other way
    and its outputs, the loss, differ from eager's in the last bits. Inside
    :func:`training_forward`, with grad off, the inputs that require grad in training
    (``_shfx_grads``, from :func:`pin_attention_grad_mode`) are given ``requires_grad`` again
    and the op runs under autograd; its graph is dropped with the ``detach``. Elsewhere (under
    autograd, or an evaluation under ``no_grad``, as eager's) the op runs as it is."""
    if torch.is_grad_enabled() or not getattr(_TRAINING, "on", False) or not any(_shfx_grads):
        return _SDPA(*args, **kwargs)

    def flagged(x: Any, g: bool) -> Any:
        return x.detach().requires_grad_(True) if g and isinstance(x, torch.Tensor) else x

    # (q, k, v and the mask in that order; the mask positional or the attn_mask keyword)
    args = tuple(flagged(x, i < len(_shfx_grads) and _shfx_grads[i]) for i, x in enumerate(args))
    if "attn_mask" in kwargs:
        kwargs = {**kwargs, "attn_mask": flagged(kwargs["attn_mask"], _shfx_grads[3])}
    with torch.enable_grad():
        return _SDPA(*args, **kwargs).detach()


def requires_grad_in_training(gm: fx.GraphModule, trainable: set[str]) -> dict[fx.Node, bool]:
    """Whether each node's value requires grad in eager's training forward: a trainable
    parameter's placeholder (``trainable``: placeholder names) does, and a floating-point result
    of an op reading one, unless the op never passes grad (:data:`_NO_GRAD_OUTPUT`) or a
    ``torch.no_grad()`` region of the forward (``_set_grad_enabled(False)`` in the graph)
    computes it."""
    rg: dict[fx.Node, bool] = {}
    grad_on = True
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            rg[n] = n.name in trainable
            continue
        if n.op != "call_function":
            rg[n] = False
            continue
        if n.target is torch._C._set_grad_enabled:
            grad_on = bool(n.args[0]) if n.args else grad_on
            rg[n] = False
            continue
        if n.target is _WRAP_GRAD:  # a torch.no_grad() / enable_grad() region of the forward
            rg[n] = bool(n.args[0]) and any(rg.get(a, False) for a in n.all_input_nodes)
            continue
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        floating = any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", getattr(n.target, "__name__", ""))
        if n.target is operator.getitem:
            rg[n] = rg.get(n.args[0], False) and (val is None or (isinstance(val, torch.Tensor) and val.is_floating_point()))
        elif name in _NO_GRAD_OUTPUT:
            rg[n] = False
        else:
            rg[n] = grad_on and floating and any(rg.get(a, False) for a in n.all_input_nodes)
    return rg


def pin_attention_grad_mode(gm: fx.GraphModule, trainable: set[str]) -> list[str]:
    """Make every ``aten.scaled_dot_product_attention`` node call :func:`sdpa_as_trained` with
    which of its q, k, v and mask require grad in training (:func:`requires_grad_in_training`).
    Returns the names of the nodes whose call changed (one input at least requires grad)."""
    rg = requires_grad_in_training(gm, trainable)
    pinned = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not _SDPA:
            continue
        args = list(n.args[:4])
        if len(args) < 4:
            args.append(n.kwargs.get("attn_mask"))
        grads = tuple(bool(isinstance(a, fx.Node) and rg.get(a, False)) for a in args)
        if any(grads):
            n.target = sdpa_as_trained
            n.kwargs = {**n.kwargs, "_shfx_grads": grads}
            pinned.append(n.name)
    if pinned:
        gm.recompile()
    return pinned
