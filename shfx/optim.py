"""Optimizers shfx runs on the host, next to the master weights.

Each is a ``torch.optim.Optimizer`` with its torch counterpart's arguments, defaults,
``param_groups``, ``state``, ``state_dict()`` and ``load_state_dict()``, so learning-rate
schedulers (``torch.optim.lr_scheduler.*``) and checkpoint code written for torch work
unchanged. ``shfx.compile(model, optimizer=...)`` binds it to the model (its parameter groups
then hold the model's own parameters) and, at the first call, to the host store: updates then run
on the store's flat per-stage buffers, one fused call per (stage, parameter group), each starting
as soon as that stage's gradients are on the host.

- :class:`AdamW`: ``torch.optim.AdamW(fused=True)``'s kernel, bitwise equal to it.
- :class:`SGD`: ``torch.optim.SGD(fused=True)``'s kernel (momentum, dampening, nesterov, weight
  decay), bitwise equal to it.
- :class:`Adafactor`: ``torch.optim.Adafactor(foreach=True)``'s functional update over views of
  the flat buffers, bitwise equal to it.

Each also runs on the device (:mod:`shfx.runtime.device_optim`) for the groups a policy updates
there (``Resident``, ``L2L``, ``Stronghold(resident_first=k)``), its states in device memory.

Parameter groups the torch way (lists of dicts whose ``"params"`` are the model's parameters or
their names) or by a function of the name::

    shfx.optim.AdamW(groups=lambda name, p: {"weight_decay": 0.0} if p.ndim < 2 else None)

Hyperparameters are read from ``param_groups`` when a step's updates are issued: a change
between steps (a scheduler, ``cm.optimizer.lr = x`` which sets every group) applies at the next.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .errors import UsageError

__all__ = ["HostOptimizer", "AdamW", "SGD", "Adafactor"]

GroupFn = Callable[[str, nn.Parameter], "dict[str, Any] | None"]

# attributes of torch.optim.Optimizer (and ours) that are never hyperparameters
_OWN = frozenset({"defaults", "param_groups", "state"})


def _is_name_list(xs: Iterable[Any]) -> bool:
    return any(isinstance(x, str) for x in xs)


class HostOptimizer(torch.optim.Optimizer):
    """Base of shfx's host optimizers (see the module docstring).

    ``params``: as for torch (parameters, ``(name, parameter)`` pairs, or a list of group
    dicts), where a parameter may also be given by its name in the model; None (the default):
    every parameter of the compiled model. ``groups``: ``fn(name, param) -> dict | None``, the
    hyperparameters that differ from the defaults for that parameter; parameters with equal
    answers share a group, groups in order of their first parameter. Unnamed arguments are the
    torch counterpart's hyperparameters.

    Until ``shfx.compile`` binds it, ``param_groups`` is one group of the defaults (no params).
    After the first call the set of groups is fixed (the host store is laid out), so
    :meth:`add_param_group` refuses; their hyperparameters can change at any time.
    """

    #: the torch optimizer this one reproduces, and the options shfx's kernels correspond to
    torch_class: type[torch.optim.Optimizer] = torch.optim.Optimizer
    torch_options: dict[str, Any] = {}
    #: whether :mod:`shfx.runtime.device_optim` can run it (policies that update on the device)
    on_device = False
    #: which runner of :mod:`shfx.runtime.host_optim` runs it (``runner_for`` dispatches on
    #: it, so a subclass runs as its base); None: none does
    host_runner: str | None = None
    #: how it runs under data parallel (docs/usage.md, "Data parallel"): ``"sharded"`` (each
    #: rank updates its range of every group's flat buffers: an elementwise update, AdamW's and
    #: SGD's), ``"replicated"`` (each rank updates every group whole from the all-reduced
    #: gradient: an update that reads across elements, Adafactor's row and column means), or
    #: None (refused under data parallel)
    data_parallel: str | None = None

    def __init__(self, params: Any = None, *, groups: GroupFn | None = None, **hyper: Any):
        self._validate(hyper)
        probe = torch.zeros(1, requires_grad=True)
        defaults = dict(self.torch_class([probe], **{**self.torch_options, **hyper}).defaults)
        d = self.__dict__
        d["defaults"] = defaults
        d["param_groups"] = [{**defaults, "params": []}]  # unbound: the defaults as one group
        d["_state"] = defaultdict(dict)
        d["_groups_fn"] = groups
        d["_params"] = list(params) if params is not None else None
        d["_ready"] = False  # torch.optim.Optimizer.__init__ ran with the resolved groups
        d["_cm"] = None  # weakref to the CompiledModel
        d["runner"] = None  # the host-store runner (shfx.runtime.host_optim), at the first call
        d["_where"] = {}  # id(param) -> (store group, element offset, numel, shape)
        d["_layout"] = {}  # store group -> [(param group, [(element offset, numel)])]
        if self._params is not None and groups is None and not self._has_names(self._params):
            self._init_groups(self._params)

    # ---- hyperparameters --------------------------------------------------------------------
    @classmethod
    def _validate(cls, hyper: dict) -> None:
        """Raise ValueError for hyperparameters torch would refuse, with shfx's wording."""

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        defaults = d.get("defaults")
        if defaults is not None and name in defaults and name not in _OWN:
            return d["param_groups"][0][name] if d.get("param_groups") else defaults[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        defaults = d.get("defaults")
        if defaults is not None and name in defaults and name not in _OWN and name != "params":
            self._validate({name: value})
            defaults[name] = value
            for g in d.get("param_groups", ()):
                g[name] = value  # every group, as existing code setting cm.optimizer.lr expects
            return
        super().__setattr__(name, value)

    def group_hyperparams(self, group: dict) -> dict:
        """One group's hyperparameters as the kernel takes them (validated)."""
        raise NotImplementedError

    #: fp32 states the host runner keeps per trainable element (the memory ledger's count)
    per_element_states = 2

    def host_states(self, groups: Any) -> Any:
        """What the host runner keeps beside the master weights of ``groups`` (a variant's
        ``graph.groups``), as the memory ledger counts it: a
        :class:`shfx.passes.ledger.HostOptimizerStates` (``cm.variant.ledger(optimizer=...)``)."""
        from shfx.passes.ledger import HostOptimizerStates

        return HostOptimizerStates(
            per_element=self.per_element_states, group_bytes=tuple(self._whole_state_bytes(g) for g in groups),
            replicated=self.data_parallel == "replicated", step_counters=tuple(self._step_counters(g) for g in groups),
        )  # fmt: skip

    def _whole_state_bytes(self, group: Any) -> int:
        """Bytes of group ``group``'s states that are not per element (none by default)."""
        return 0

    def ssd_extents(self, group: Any) -> list[tuple[str, int]]:
        """``(name, bytes)`` of the flat state buffers of ``group`` (a :class:`shfx.passes.layout.Group`)
        the NVMe tier keeps on the SSD, as the host runner names them (its ``ssd_states``), known
        before any host store exists: the parameter tier's store is made first. AdamW: ``m``, ``v``."""
        return [("m", group.state_bytes), ("v", group.state_bytes)]

    def _step_counters(self, group: Any) -> int:
        """Step counters of group ``group`` (one by default: shfx keeps one per stage)."""
        return 1

    def hyperparams(self) -> dict | tuple[dict, ...]:
        """A snapshot of the hyperparameters, taken when an update is issued: one dict
        (unbound, one group) or one per parameter group, in ``param_groups`` order."""
        groups = self.param_groups
        if not self._ready:
            return self.group_hyperparams(groups[0])
        return tuple(self.group_hyperparams(g) for g in groups)

    # ---- groups ----------------------------------------------------------------------------
    @staticmethod
    def _has_names(params: list) -> bool:
        for x in params:
            if isinstance(x, dict):
                ps = x.get("params", [])
                if isinstance(ps, str) or (not isinstance(ps, torch.Tensor) and _is_name_list(ps)):
                    return True
            elif isinstance(x, str):
                return True
        return False

    def _init_groups(self, param_groups: list) -> None:
        defaults = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        self.__dict__["defaults"] = defaults
        placeholder = self.__dict__.pop("param_groups")
        self.__dict__["_ready"] = True  # (Optimizer.__init__ calls our add_param_group)
        try:
            torch.optim.Optimizer.__init__(self, param_groups, defaults)
        except BaseException:
            self.__dict__["_ready"] = False
            self.__dict__["param_groups"] = placeholder
            raise

    def _resolve(self, named: dict[str, nn.Parameter]) -> list:
        """The parameter groups for a model whose parameters are ``named``."""

        def param(x: Any) -> Any:
            if isinstance(x, str):
                if x not in named:
                    some = ", ".join(list(named)[:5])
                    raise ValueError(
                        f"{type(self).__name__}: no parameter named {x!r} in the model (its names: {some}, ...); "
                        "name parameters as model.named_parameters() does"
                    )
                return named[x]
            return x

        params, fn = self._params, self._groups_fn
        if fn is None:
            if params is None:
                return [{"params": list(named.values())}]
            out = []
            for x in params:
                if isinstance(x, dict):
                    ps = x.get("params", [])
                    ps = [ps] if isinstance(ps, (str, torch.Tensor)) else list(ps)
                    out.append({**x, "params": [param(p) for p in ps]})
                else:
                    out.append(param(x))
            return out
        if params is not None and any(isinstance(x, dict) for x in params):
            raise ValueError(f"{type(self).__name__}: give either a list of group dicts or groups=fn, not both")
        chosen = None if params is None else {id(param(x[1] if isinstance(x, tuple) else x)) for x in params}
        by_key: dict[Any, dict] = {}
        for name, p in named.items():
            if chosen is not None and id(p) not in chosen:
                continue
            over = fn(name, p) or {}
            if not isinstance(over, dict):
                raise TypeError(f"groups(name, param) must return a dict or None, got {type(over).__name__} for {name!r}")
            if "params" in over:
                raise ValueError(f"groups(name, param) returned 'params' for {name!r}; return hyperparameters only")
            key = tuple(sorted((k, repr(v)) for k, v in over.items()))
            by_key.setdefault(key, {**over, "params": []})["params"].append(p)
        return list(by_key.values())

    def attach(self, cm: Any, model: nn.Module) -> None:
        """Bind to compiled model ``cm`` of ``model`` (``shfx.compile`` calls this)."""
        if self._cm is not None and self._cm() is not None and self._cm() is not cm:
            raise UsageError(
                f"this {type(self).__name__} is already bound to another compiled model; create one optimizer per "
                "shfx.compile call"
            )
        named = dict(model.named_parameters())
        if not self._ready:
            self._init_groups(self._resolve(named))
        ids = {id(p) for p in named.values()}
        for i, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) not in ids:
                    raise ValueError(
                        f"{type(self).__name__}: param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the compiled model; give the model's own parameters (or their names)"
                    )
        self.__dict__["_cm"] = weakref.ref(cm)

    def bind(self, store: Any, params: dict[str, torch.Tensor]) -> Any:
        """Lay the parameter groups over ``store`` (``params``: store key -> the model's tensor)
        and return the runner the engine calls (:mod:`shfx.runtime.host_optim`)."""
        from .runtime.host_optim import runner_for

        if not self._ready:
            raise UsageError(f"{type(self).__name__} is not bound to a model: pass it to shfx.compile(model, optimizer=...)")
        key_of = {id(t): k for k, t in params.items()}
        pos: dict[str, tuple[int, int, int]] = {}
        for g, grp in enumerate(store.groups):
            keys = [i.key for i in grp.infos if i.kind == "param" and i.trainable]
            for k, (off, n) in zip(keys, grp.trainable_spans()):
                pos[k] = (g, off, n)
        group_of: dict[str, int] = {}
        where: dict[int, tuple[int, int, int, tuple[int, ...]]] = {}
        for i, pg in enumerate(self.param_groups):
            for p in pg["params"]:
                k = key_of.get(id(p))
                if k is None or k not in pos:
                    continue  # frozen: never has a gradient, as torch.optim skips it
                if k in group_of and group_of[k] != i:
                    raise ValueError(f"parameter {k!r} is in param_groups[{group_of[k]}] and param_groups[{i}]")
                group_of[k] = i
                where[id(p)] = (*pos[k], tuple(p.shape))
        missing = [k for k in pos if k not in group_of]
        if missing:
            raise UsageError(
                f"{type(self).__name__}: trainable parameter(s) {', '.join(repr(k) for k in missing[:5])} are in no "
                "parameter group, but shfx updates every trainable parameter; add them to a group (or set "
                "requires_grad=False before the first call)"
            )
        layout: dict[int, dict[int, list[tuple[int, int]]]] = {}
        for k, i in group_of.items():
            g, off, n = pos[k]
            layout.setdefault(g, {}).setdefault(i, []).append((off, n))
        self.__dict__["_layout"] = {g: sorted((i, sorted(s)) for i, s in d.items()) for g, d in layout.items()}
        self.__dict__["_where"] = where
        self.__dict__["runner"] = runner_for(self, store)
        pending = self.__dict__.pop("_pending", None)
        if pending is not None:  # loaded before the first call
            self._load_state(pending)
        return self.runner

    def layout(self, g: int) -> list[tuple[int, list[tuple[int, int]]]] | None:
        """Store group ``g``'s trainable parameters as ``[(param group index, [(element offset,
        numel)])]`` (sorted); None when not bound to a store (one group over all of them)."""
        if not self._layout:
            return None
        return self._layout.get(g, [])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.runner is not None:
            raise UsageError(
                f"{type(self).__name__}.add_param_group after the first call: the host store is laid out for the "
                "groups shfx.compile saw. Give every group when creating the optimizer (hyperparameters of "
                "existing groups can still change)."
            )
        if not self._ready:
            raise UsageError(
                f"{type(self).__name__}.add_param_group before shfx.compile resolved the groups; pass the groups "
                "as a list of dicts when creating the optimizer"
            )
        super().add_param_group(param_group)

    # ---- stepping ------------------------------------------------------------------------------
    def _compiled(self, what: str) -> Any:
        cm = self._cm() if self._cm is not None else None
        if cm is None:
            raise UsageError(f"{type(self).__name__}.{what}() needs a compiled model: shfx.compile(model, optimizer=this)")
        return cm

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The compiled model's step (``cm.step()`` and this are the same); ``closure`` is
        evaluated first, as torch does, and its value returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._compiled("step")._apply_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``cm.zero_grad``."""
        cm = self._cm() if self._cm is not None else None
        if cm is None:
            super().zero_grad(set_to_none)
        else:
            cm.zero_grad(set_to_none)

    # ---- state -------------------------------------------------------------------------------
    @property
    def state(self) -> defaultdict:  # type: ignore[override]
        """Per parameter, its optimizer state as torch names it, as views of the flat buffers
        (host, or device for stages updated there): writing into them changes the state.
        Parameters not updated yet have none, as in torch."""
        if self.runner is None:
            return self.__dict__["_state"]
        out: defaultdict = defaultdict(dict)
        for pg in self.param_groups:
            for p in pg["params"]:
                w = self._where.get(id(p))
                if w is None:
                    continue
                st = self.runner.param_state(*w, self._device_state(w[0]))
                if st:
                    out[p] = st
        return out

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_state"] = value

    def _device_state(self, g: int) -> Any:
        cm = self._cm() if self._cm is not None else None
        eng = getattr(cm, "_engine", None)
        dev = getattr(eng, "device_optimizer", None)
        return None if dev is None else dev.state.get(g)

    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index]}]}``,
        indices numbering the parameters across groups in order. The state tensors are views of
        the live buffers, as torch's are its live tensors; ``step`` is a copy per parameter."""
        cm = self._cm() if self._cm is not None else None
        if cm is not None:
            cm._settle()
        index: dict[int, int] = {}
        groups = []
        for pg in self.param_groups:
            packed = {k: v for k, v in pg.items() if k != "params"}
            ids = []
            for p in pg["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            packed["params"] = ids
            groups.append(packed)
        state = {
            index[id(p)]: {k: (v.clone() if k == "step" else v) for k, v in s.items()} for p, s in self.state.items()
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any], *, read: Callable[[list[int]], dict[int, dict]] | None = None) -> None:
        """Load torch's format (from this class or its torch counterpart): every group's
        hyperparameters, and the per-parameter state copied into the flat buffers. Parameters
        of one stage share a step counter: their steps must be equal, and either all or none of
        a stage's trainable parameters must have state. Everything is checked before any stage
        changes (each stage's entries against what its state holds), so a refused state dict
        changes nothing.

        ``read`` (a checkpoint read one stage at a time, as ``shfx.checkpoint`` does): the
        state's tensors are placeholders (meta tensors of the shapes and dtypes to load; each
        ``step`` a real value), checked as they are, and ``read(indices)`` gives the real
        ``{index: {name: tensor}}`` of the parameters at those indices, called once per stage
        just before that stage's state is written: one stage's state is in memory at a time."""
        groups, saved = self.param_groups, state_dict.get("param_groups")
        if saved is None or "state" not in state_dict:
            raise ValueError("load_state_dict expects torch's format: a dict with 'state' and 'param_groups'")
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError(
                f"the state dict has {len(saved)} groups of {[len(s['params']) for s in saved]} parameters, this "
                f"optimizer {len(groups)} of {[len(g['params']) for g in groups]}: build the optimizer with the same groups"
            )
        if not self._ready:
            raise UsageError("load_state_dict needs the parameter groups: call it after shfx.compile(model, optimizer=this)")
        cm = self._cm() if self._cm is not None else None
        if cm is not None:
            cm._settle()
        if self.runner is None:
            # before the first call: the host store holding the state is laid out then (bind)
            if read is not None:
                state = read(sorted(i for i, e in state_dict["state"].items() if e))
            else:
                state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()} for i, e in state_dict["state"].items()}
            self.__dict__["_pending"] = {"state": state, "param_groups": saved}
        else:
            self._load_state(state_dict, read)
        for g, s in zip(groups, saved):
            for k, v in s.items():
                if k not in ("params", "param_names"):
                    g[k] = v

    def _load_state(self, state_dict: dict[str, Any], read: Callable[[list[int]], dict[int, dict]] | None = None) -> None:
        """The per-parameter part of :meth:`load_state_dict`, into the runner's buffers: every
        stage checked (the runner's ``check_group``), then each written (``read``: its entries
        read first)."""
        by_index: dict[int, torch.Tensor] = {}
        for g, s in zip(self.param_groups, state_dict["param_groups"]):
            for p, i in zip(g["params"], s["params"]):
                by_index[i] = p
        per_group: dict[int, list] = {}
        for i, p in by_index.items():
            w = self._where.get(id(p))
            if w is not None:
                per_group.setdefault(w[0], []).append((i, w))
        plan = []
        for g, items in sorted(per_group.items()):  # every check before any stage changes
            have = [(i, w, state_dict["state"][i]) for i, w in items if state_dict["state"].get(i)]
            if have and len(have) != len(items):
                raise ValueError(
                    f"the state dict has state for {len(have)} of the {len(items)} trainable parameters of stage {g}; "
                    "shfx keeps one step counter per stage, so load either all of them or none"
                )
            steps = {float(e["step"]) for _, _, e in have if "step" in e}
            if len(steps) > 1:
                raise ValueError(f"the parameters of stage {g} have different steps {sorted(steps)}; shfx keeps one per stage")
            plan.append((g, have))
        for g, have in plan:
            self.runner.check_group(g, [(w, e) for _, w, e in have], self._device_state(g))
        for g, have in plan:
            # (read: this stage's state only, freed before the next stage's is read)
            self.runner.load_group(g, _read_entries(have, read), self._device_state(g))


def _read_entries(have: list[tuple[int, Any, dict]], read: Callable[[list[int]], dict[int, dict]] | None) -> list:
    """A stage's ``[(where, entry)]`` of ``have`` (``[(index, where, entry)]``), the entries
    read by ``read`` when it is given."""
    if read is None or not have:
        return [(w, e) for _, w, e in have]
    got = read([i for i, _, _ in have])
    return [(w, got[i]) for i, w, _ in have]


class AdamW(HostOptimizer):
    """AdamW on the host (decoupled weight decay), as ``torch.optim.AdamW(fused=True)``.

    >>> opt = AdamW(lr=3e-4, weight_decay=0.1)
    >>> opt.betas
    (0.9, 0.999)
    """

    torch_class = torch.optim.AdamW
    torch_options = {"fused": True}
    on_device = True
    host_runner = "adamw"
    data_parallel = "sharded"

    @property
    def per_element_states(self) -> int:  # type: ignore[override]
        return 3 if any(g["amsgrad"] for g in self.param_groups) else 2

    def __init__(
        self,
        params: Any = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        groups: GroupFn | None = None,
    ):
        super().__init__(
            params, groups=groups, lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize,
        )  # fmt: skip

    @classmethod
    def _validate(cls, hyper: dict) -> None:
        if "lr" in hyper and not 0.0 <= float(hyper["lr"]):
            raise ValueError(f"AdamW lr must be >= 0, got {hyper['lr']}")
        if "eps" in hyper and not 0.0 <= float(hyper["eps"]):
            raise ValueError(f"AdamW eps must be >= 0, got {hyper['eps']}")
        if "betas" in hyper:
            b = tuple(hyper["betas"])
            if len(b) != 2 or not all(0.0 <= float(x) < 1.0 for x in b):
                raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {hyper['betas']}")
        if "weight_decay" in hyper and not 0.0 <= float(hyper["weight_decay"]):
            raise ValueError(f"AdamW weight_decay must be >= 0, got {hyper['weight_decay']}")

    def group_hyperparams(self, group: dict) -> dict:
        self._validate(group)
        b1, b2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": float(b1),
            "beta2": float(b2),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "amsgrad": bool(group["amsgrad"]),
            "maximize": bool(group["maximize"]),
        }


class SGD(HostOptimizer):
    """SGD with momentum, as ``torch.optim.SGD(fused=True)`` (its kernel, bitwise), on the host
    or on the device.

    >>> SGD(lr=0.1, momentum=0.9, nesterov=True).momentum
    0.9
    """

    torch_class = torch.optim.SGD
    torch_options = {"fused": True}
    on_device = True  # (shfx.runtime.device_optim.DeviceSGD)
    host_runner = "sgd"
    data_parallel = "sharded"  # (momentum is elementwise: a flat range of it is exact)
    per_element_states = 1  # the momentum buffer (the runner keeps one whatever the momentum)

    def ssd_extents(self, group: Any) -> list[tuple[str, int]]:
        return [("momentum", group.state_bytes)]

    def __init__(
        self,
        params: Any = None,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        groups: GroupFn | None = None,
    ):
        super().__init__(
            params, groups=groups, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize,
        )  # fmt: skip

    @classmethod
    def _validate(cls, hyper: dict) -> None:
        for k in ("lr", "momentum", "weight_decay"):
            if k in hyper and not 0.0 <= float(hyper[k]):
                raise ValueError(f"SGD {k} must be >= 0, got {hyper[k]}")

    def group_hyperparams(self, group: dict) -> dict:
        self._validate(group)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("SGD nesterov needs momentum > 0 and dampening 0")
        return {
            "lr": float(group["lr"]),
            "momentum": float(group["momentum"]),
            "dampening": float(group["dampening"]),
            "weight_decay": float(group["weight_decay"]),
            "nesterov": bool(group["nesterov"]),
            "maximize": bool(group["maximize"]),
        }


class Adafactor(HostOptimizer):
    """Adafactor, as ``torch.optim.Adafactor(foreach=True)`` (its update function
    over views of the flat buffers, bitwise). Parameters of two or more dimensions keep a row
    and a column factor of the second moment (``row_var``, ``col_var``), others a full
    ``variance``; every parameter keeps its own ``step``.

    >>> Adafactor(lr=1e-2).beta2_decay
    -0.8
    """

    torch_class = torch.optim.Adafactor
    torch_options = {"foreach": True}
    on_device = True  # (shfx.runtime.device_optim.DeviceAdafactor)
    host_runner = "adafactor"
    # NOTE: replicated, not sharded: a matrix's factored second moment is the mean of its
    # squared gradient over whole rows and whole columns, which a flat range of the group cuts;
    # its states are O(rows + cols) per matrix, so holding them whole on every rank costs little
    data_parallel = "replicated"
    per_element_states = 0

    def _whole_state_bytes(self, group: Any) -> int:
        from .runtime.host_optim import _factored_numel

        shapes = [tuple(i.shape) for i in group.infos if i.kind == "param" and i.trainable]
        return sum(_factored_numel(sh) for sh in shapes) * group.dtypes.state.itemsize

    def ssd_extents(self, group: Any) -> list[tuple[str, int]]:
        return [("factors", self._whole_state_bytes(group))]

    def _step_counters(self, group: Any) -> int:
        """One per trainable parameter, as torch keeps them."""
        return sum(1 for i in group.infos if i.kind == "param" and i.trainable and torch.Size(i.shape).numel())

    def __init__(
        self,
        params: Any = None,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        groups: GroupFn | None = None,
    ):
        super().__init__(
            params, groups=groups, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
            maximize=maximize,
        )  # fmt: skip

    @classmethod
    def _validate(cls, hyper: dict) -> None:
        if "lr" in hyper and not 0.0 <= float(hyper["lr"]):
            raise ValueError(f"Adafactor lr must be >= 0, got {hyper['lr']}")
        if "beta2_decay" in hyper and not float(hyper["beta2_decay"]) <= 0:
            raise ValueError(f"Adafactor beta2_decay must be <= 0, got {hyper['beta2_decay']}")
        if "weight_decay" in hyper and not 0.0 <= float(hyper["weight_decay"]):
            raise ValueError(f"Adafactor weight_decay must be >= 0, got {hyper['weight_decay']}")

    def group_hyperparams(self, group: dict) -> dict:
        self._validate(group)
        eps1, eps2 = group["eps"]
        return {
            "lr": float(group["lr"]),
            "beta2_decay": float(group["beta2_decay"]),
            "eps1": None if eps1 is None else float(eps1),
            "eps2": float(eps2),
            "d": float(group["d"]),
            "weight_decay": float(group["weight_decay"]),
            "maximize": bool(group["maximize"]),
        }
