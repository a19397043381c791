"""The host AdamW on flat buffers against torch.optim.AdamW (its default for-loop
implementation and the fused one)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import shfx
from shfx.passes.layout import TensorInfo, plan_groups
from shfx.runtime.emulated import EmulatedBackend
from shfx.runtime.host_optim import CHUNK, HostAdamW, _spans, fused_adamw_with_copy
from shfx.runtime.host_store import GRAD_VALID, HostStore



def _reference_step(ref: list, topt: torch.optim.Optimizer, shapes: list) -> list[torch.Tensor]:
    """One step of the torch reference on fresh random gradients; returns them (to give shfx)."""
    grads = [torch.randn(s) for s in shapes]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    topt.step()
    return grads

def make(shapes, merge_views=True, **opt):
    params = [torch.randn(*s) for s in shapes]
    infos = [TensorInfo.of(f"p{i}", "param", p, trainable=True) for i, p in enumerate(params)]
    groups = plan_groups([infos])
    backend = EmulatedBackend(shfx.EmulatedDevice())
    ref = [p.clone().requires_grad_() for p in params]
    store = HostStore(backend, groups, {f"p{i}": p for i, p in enumerate(params)}, pin=False)
    cfg = shfx.optim.AdamW(**opt)
    return params, ref, store, HostAdamW(cfg, store, merge_views=merge_views), cfg, backend


# odd sizes (one view per parameter), and a mix where runs of parameters whose sizes are
# multiples of 16 get merged into one view (vector bodies, scalar tails, several parallel chunks)
SHAPES = {
    "odd": [(7, 3), (5,), (1,), (33,)],
    "merged": [(64,), (256, 64), (48,), (7,), (64, 16), (33, 65), (16,), (1,), (128, 40), (40,), (17,)],
}


@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("opt", [{}, {"lr": 1e-2, "weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True, "betas": (0.8, 0.99)}])
def test_matches_torch_adamw(opt, fused, shapes):
    torch.manual_seed(0)
    params, ref, store, host, cfg, backend = make(SHAPES[shapes], **opt)
    topt = torch.optim.AdamW(ref, fused=fused, **opt)
    for step in range(6):
        grads = [torch.randn_like(p) * (10.0 ** -step) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        topt.step()
        for i, g in enumerate(grads):
            store.param_grad_view(f"p{i}", 0).copy_(g)
        store.grad_state[0] = GRAD_VALID
        host.update(0, cfg.hyperparams())
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5 if not fused else 0, atol=1e-7 if not fused else 0)
    # padding between parameters stays zero
    master = store.master(0)
    covered = torch.zeros_like(master, dtype=torch.bool)
    for k, off in store.groups[0].offsets.items():
        n = store.groups[0].info(k).numel
        covered[off // 4 : off // 4 + n] = True
    assert torch.all(master[~covered] == 0)
    assert host.steps(0) == 6
    backend.close()


def test_model_params_are_views_of_the_store():
    torch.manual_seed(0)
    params, _, store, host, cfg, backend = make([(4, 4)])
    store.grad(0).fill_(1.0)
    store.grad_state[0] = GRAD_VALID
    before = params[0].clone()
    host.update(0, cfg.hyperparams())
    assert not torch.equal(before, params[0])  # the model's own tensor changed in place
    assert params[0].data_ptr() == store.tensors["p0"].data_ptr()
    backend.close()


def test_hyperparameter_validation():
    with pytest.raises(ValueError, match="lr must be >= 0"):
        shfx.optim.AdamW(lr=-1)
    with pytest.raises(ValueError, match="betas"):
        shfx.optim.AdamW(betas=(0.9, 1.5))
    opt = shfx.optim.AdamW()
    opt.param_groups[0]["lr"] = 0.5
    assert opt.lr == 0.5
    opt.lr = 0.25  # sets every group
    assert opt.param_groups[0]["lr"] == 0.25
    opt.param_groups[0]["lr"] = -1.0  # torch lets a group take any value: checked when a step reads it
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.hyperparams()


def test_spans_merge_only_where_bitwise_safe():
    # (offset, numel) in elements; a run grows while its length is a multiple of 16 and the
    # next parameter starts where it ends
    assert _spans([(0, 64), (64, 32), (96, 7), (112, 16), (128, 16)]) == [(0, 103), (112, 32)]
    assert _spans([(0, 16), (32, 16)]) == [(0, 16), (32, 16)]  # a gap: never merged
    assert _spans([(0, 7), (16, 16)]) == [(0, 7), (16, 16)]  # a tail ends a run
    assert _spans([(0, 0), (0, 16), (16, 5)]) == [(0, 21)]  # empty parameters are skipped
    assert _spans([(0, 64), (64, 32)], merge=False) == [(0, 64), (64, 32)]
    # a parameter that starts a part (Group.part_starts: the working dtype may change) starts a view
    assert _spans([(0, 64), (64, 32), (96, 16)], boundaries={64}) == [(0, 64), (64, 48)]
    assert _spans([(0, 64), (64, 32), (96, 16)], boundaries={96}) == [(0, 96), (96, 16)]
    assert _spans([(0, 64), (64, 32)], boundaries={0}) == [(0, 96)]


def test_transformer_group_is_one_view():
    h = 64
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    _, _, store, host, cfg, backend = make(block * 2)
    store.grad(0).normal_()
    host.update(0, cfg.hyperparams())
    assert len(host.state[0].views[0]) == 1
    backend.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("opt", [{"weight_decay": 0.1}, {"amsgrad": True, "maximize": True}])
def test_merged_views_bitwise_equal_per_parameter_views(opt, threads):
    shapes = SHAPES["merged"] + [(1024, 48), (3,), (2048,), (999,)]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for merge in (True, False):
            torch.manual_seed(0)
            params, _, store, host, cfg, backend = make(shapes, merge_views=merge, **opt)
            for step in range(4):
                store.grad(0).zero_()
                for i, p in enumerate(params):
                    store.param_grad_view(f"p{i}", 0).copy_(torch.randn_like(p) * (10.0**-step))
                store.grad_state[0] = GRAD_VALID
                host.update(0, cfg.hyperparams())
            st = host.state[0]
            runs.append((len(st.views[0]), [store.master(0).clone(), st.exp_avg.clone(), st.exp_avg_sq.clone()]))
            backend.close()
    finally:
        torch.set_num_threads(prev)
    (n_merged, merged), (n_single, single) = runs
    assert n_merged < n_single == len(shapes)
    for a, b in zip(merged, single):
        assert torch.equal(a, b)


# ---- the update with a 16-bit working copy (mixed precision) ---------------------------------------
# Flat fp32 buffers laid out like a group (parameters at 16-element boundaries), updated by
# fused_adamw_with_copy over merged or per-parameter views, against torch.optim.AdamW(fused=True)
# on separate fp32 parameters followed by p16.copy_(p32).

COPY_SHAPES = [(64,), (33, 65), (16,), (7,), (1000,), (48,), (256, 9), (3,), (160,), (17,)]


class Flat:
    """Parameters of ``shapes`` in flat buffers (master, grad, m, v, max_v, working) and the views
    an update covers (merged runs or one per parameter)."""

    def __init__(self, shapes, working_dtype, merge, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.offsets, off = [], 0
        for s in shapes:
            self.offsets.append(off)
            off += -(-math.prod(s) // 16) * 16
        self.n = off
        self.master = torch.zeros(off)
        for o, s in zip(self.offsets, shapes):
            self.master[o : o + math.prod(s)] = torch.randn(math.prod(s), generator=gen)
        self.grad, self.m, self.v, self.vmax = (torch.zeros(off) for _ in range(4))
        self.working = torch.full((off,), 7.0, dtype=working_dtype)  # stale until the first update
        self.step = torch.zeros(())
        self.spans = _spans([(o, math.prod(s)) for o, s in zip(self.offsets, shapes)], merge)

    def views(self, buf):
        return [buf[o : o + k] for o, k in self.spans]

    def params(self):
        return [self.master[o : o + math.prod(s)].clone().view(s) for o, s in zip(self.offsets, self.shapes)]

    def set_grads(self, grads):
        for o, g in zip(self.offsets, grads):
            self.grad[o : o + g.numel()] = g.reshape(-1)

    def of(self, buf):
        """Per-parameter tensors of a flat buffer."""
        return [buf[o : o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def update(self, hp, chunk, working=True, grad_scale=None, found_inf=None):
        self.step += 1
        n = len(self.spans)
        fused_adamw_with_copy(
            self.views(self.master), self.views(self.grad), self.views(self.m), self.views(self.v),
            [self.step] * n, hp, self.views(self.working) if working else None, grad_scale, found_inf, chunk,
            max_exp_avg_sqs=self.views(self.vmax) if hp["amsgrad"] else None,
        )  # fmt: skip
        if found_inf is not None:
            self.step -= found_inf


def assert_matches(flat, ref, topt, working_dtype):
    for p, r in zip(flat.of(flat.master), ref):
        assert torch.equal(p, r.detach())
    for w, r in zip(flat.of(flat.working), ref):
        assert torch.equal(w, r.detach().to(working_dtype))  # p16.copy_(p32)
    for r, m, v in zip(ref, flat.of(flat.m), flat.of(flat.v)):
        assert torch.equal(m, topt.state[r]["exp_avg"]) and torch.equal(v, topt.state[r]["exp_avg_sq"])
        assert torch.equal(flat.step, topt.state[r]["step"])


@pytest.fixture
def one_thread():
    # tiny kernel calls: with a team of 2 on a shared 2-core machine every fork/join can wait for
    # a time slice (the parallel split itself is covered by test_fused_adamw_with_copy_large_tensors)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize(
    "dtype, opt",
    [(torch.bfloat16, {"lr": 1e-2}), (torch.float16, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True})],
)
def test_fused_adamw_with_copy_matches_torch_then_cast(opt, dtype, merge, one_thread):
    hp = shfx.optim.AdamW(**opt).hyperparams()
    for chunk in [16, 48, 100, 1000, CHUNK]:
        flat = Flat(COPY_SHAPES, dtype, merge)
        assert merge == (len(flat.spans) < len(COPY_SHAPES))
        ref = [p.requires_grad_() for p in flat.params()]
        topt = torch.optim.AdamW(ref, fused=True, **opt)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            grads = [torch.randn(s, generator=gen) * 10.0**-step for s in COPY_SHAPES]
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            topt.step()
            flat.set_grads(grads)
            flat.update(hp, chunk)
            assert_matches(flat, ref, topt, dtype)


def test_fused_adamw_with_copy_large_tensors():
    # tensors large enough for the kernel's parallel split, chunks not multiples of 16
    shapes = [(300, 301), (40000,), (5,), (128, 129)]
    hp = shfx.optim.AdamW(lr=1e-2).hyperparams()
    prev = torch.get_num_threads()
    try:
        for threads, chunk in [(1, 1000), (2, 4096 + 5), (2, 1 << 14)]:
            torch.set_num_threads(threads)
            flat = Flat(shapes, torch.bfloat16, merge=True)
            ref = [p.requires_grad_() for p in flat.params()]
            topt = torch.optim.AdamW(ref, fused=True, lr=1e-2)
            for _ in range(3):
                grads = _reference_step(ref, topt, shapes)
                flat.set_grads(grads)
                flat.update(hp, chunk)
            assert_matches(flat, ref, topt, torch.bfloat16)
    finally:
        torch.set_num_threads(prev)


def test_fused_adamw_with_copy_kernel_calls_and_step(monkeypatch, one_thread):
    calls = []
    kernel = torch._fused_adamw_

    def counting(*a, **k):
        calls.append(sum(t.numel() for t in a[0]))
        return kernel(*a, **k)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    flat = Flat(COPY_SHAPES, torch.bfloat16, merge=True)
    hp = shfx.optim.AdamW().hyperparams()
    flat.step.fill_(5.0)
    n = len(flat.spans)
    args = [flat.views(b) for b in (flat.master, flat.grad, flat.m, flat.v)]
    fused_adamw_with_copy(*args, [flat.step] * n, hp)  # no working copy: one call, as before
    assert calls == [sum(p.numel() for p in args[0])]
    calls.clear()
    fused_adamw_with_copy(*args, [flat.step] * n, hp, flat.views(flat.working), chunk=48)
    assert len(calls) > 10 and max(calls) <= 48 and sum(calls) == sum(p.numel() for p in args[0])
    assert flat.step.item() == 5.0  # the kernel reads the step, never increments it
    with pytest.raises(ValueError, match="chunk"):
        fused_adamw_with_copy(*args, [flat.step] * n, hp, flat.views(flat.working), chunk=15)


def test_fused_adamw_with_copy_mixed_working_views(one_thread):
    # per view: bf16, fp32 (a plain copy: a part kept in fp32), none (no separate copy)
    shapes = [(64,), (100,), (32,)]
    flat = Flat(shapes, torch.bfloat16, merge=False)
    ref = [p.requires_grad_() for p in flat.params()]
    topt = torch.optim.AdamW(ref, fused=True, lr=1e-2)
    hp = shfx.optim.AdamW(lr=1e-2).hyperparams()
    w32 = torch.zeros(100)
    untouched = torch.zeros(32, dtype=torch.bfloat16)
    for _ in range(3):
        grads = _reference_step(ref, topt, shapes)
        flat.set_grads(grads)
        flat.step += 1
        views = [flat.views(b) for b in (flat.master, flat.grad, flat.m, flat.v)]
        fused_adamw_with_copy(*views, [flat.step] * 3, hp, [flat.views(flat.working)[0], w32, None], chunk=48)
    assert torch.equal(flat.of(flat.working)[0], ref[0].detach().to(torch.bfloat16))
    assert torch.equal(w32, ref[1].detach())
    assert torch.equal(flat.of(flat.master)[2], ref[2].detach()) and torch.equal(untouched, torch.zeros(32, dtype=torch.bfloat16))


def test_fused_adamw_with_copy_grad_scaler(one_thread):
    # torch.amp.GradScaler with AdamW(fused=True): grad_scale and found_inf go to the kernel;
    # an inf skips the step (params, m, v, step unchanged), the working copy still equals the master
    for dtype in (torch.float16, torch.bfloat16):
        grad_scaler_run(dtype)


def grad_scaler_run(dtype):
    flat = Flat(COPY_SHAPES, dtype, merge=True)
    ref = [p.requires_grad_() for p in flat.params()]
    topt = torch.optim.AdamW(ref, fused=True, lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    scaler.scale(torch.zeros(()))  # creates its scale
    hp = shfx.optim.AdamW(lr=1e-2, weight_decay=0.1).hyperparams()
    scale = torch.tensor(2.0**16)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        grads = [torch.randn(s, generator=gen) * scale for s in COPY_SHAPES]
        if step in (1, 3):
            grads[step].view(-1)[0] = float("inf") if step == 1 else float("nan")
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        before = [flat.master.clone(), flat.m.clone(), flat.v.clone(), flat.step.clone()]
        scaler.step(topt)
        scaler.update()
        flat.set_grads(grads)
        found_inf = torch.tensor(float(not all(torch.isfinite(g).all() for g in grads)))
        flat.update(hp, 48, grad_scale=scale.clone(), found_inf=found_inf)
        if found_inf.item():
            scale *= 0.5
            for a, b in zip(before, [flat.master, flat.m, flat.v, flat.step]):
                assert torch.equal(a, b)
        assert scale.item() == scaler.get_scale()
        assert_matches(flat, ref, topt, dtype)
        for r, g in zip(ref, flat.of(flat.grad)):  # divided in place by the scale (unless skipped), bitwise
            assert torch.equal(g.view(torch.int32), r.grad.view(torch.int32))
    assert flat.step.item() == 3


def test_host_adamw_updates_the_working_copy(one_thread):
    """A mixed-precision group (bf16 parameters, and two kept fp32 like a BatchNorm's: a second
    part): the update is bitwise torch.optim.AdamW(fused=True) on the fp32 masters, the working
    copy is their cast, views never span the parts, a found_inf step changes nothing."""
    from shfx.passes.layout import copy_dtypes

    torch.manual_seed(0)
    shapes = [(64,), (32, 16), (48,), (16,), (7,), (64,)]
    params = [torch.randn(*s) for s in shapes]
    kept = {3, 4}  # fp32 on the device
    infos = [
        TensorInfo.of(f"p{i}", "param", p, trainable=True, device_dtype=None if i in kept else torch.bfloat16)
        for i, p in enumerate(params)
    ]
    (grp,) = groups = plan_groups([infos], copy_dtypes("bf16"))
    assert [p.dtype for p in grp.parts] == [torch.bfloat16, torch.float32] and len(grp.part_starts) == 1
    backend = EmulatedBackend(shfx.EmulatedDevice())
    ref = [p.clone().requires_grad_() for p in params]
    store = HostStore(backend, groups, {f"p{i}": p for i, p in enumerate(params)}, pin=False)
    cfg = shfx.optim.AdamW(lr=1e-2)
    host = HostAdamW(cfg, store, chunk=32)
    topt = torch.optim.AdamW(ref, fused=True, lr=1e-2)
    for step in range(4):
        grads = [torch.randn_like(p) for p in params]
        found_inf = torch.tensor(1.0 if step == 2 else 0.0)
        if not found_inf.item():
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            topt.step()
        for i, g in enumerate(grads):
            store.param_grad_view(f"p{i}", 0).copy_(g)
        host.update(0, cfg.hyperparams(), grad_scale=torch.tensor(1.0), found_inf=found_inf)
    st = host.state[0]
    start = grp.part_starts[0]
    for v in st.views[0]:  # no view crosses into the fp32 part
        lo = v.storage_offset() - store.master(0).storage_offset()
        assert lo >= start or lo + v.numel() <= start
    assert host.steps(0) == 3
    spans = dict(zip((i.key for i in grp.infos if i.trainable), grp.trainable_spans()))
    for i, (p, r) in enumerate(zip(params, ref)):
        assert torch.equal(p, r.detach())  # the model's parameter is the master
        o, n = spans[f"p{i}"]
        w = store.working_view(0, o, n)
        assert w.dtype == (torch.float32 if i in kept else torch.bfloat16)
        assert torch.equal(w, r.detach().reshape(-1).to(w.dtype))
    # the timing runs the same batches on scratch buffers, the working copy included
    scratch = host.scratch(0)
    assert len(scratch) == 5 and scratch[4].dtype == torch.bfloat16
    assert host.time_update_on(0, cfg.hyperparams(), scratch) > 0
    backend.close()

