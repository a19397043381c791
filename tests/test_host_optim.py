"""The host AdamW on flat buffers against torch.optim.AdamW (its default for-loop
implementation and the fused one)."""

from __future__ import annotations

import pytest
import torch

import shfx
from shfx.passes.layout import TensorInfo, plan_groups
from shfx.runtime.emulated import EmulatedBackend
from shfx.runtime.host_optim import HostAdamW, _spans
from shfx.runtime.host_store import GRAD_VALID, HostStore


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
    with pytest.raises(KeyError):
        opt.param_groups[0]["momentum"] = 0.9


def test_spans_merge_only_where_bitwise_safe():
    # (offset, numel) in elements; a run grows while its length is a multiple of 16 and the
    # next parameter starts where it ends
    assert _spans([(0, 64), (64, 32), (96, 7), (112, 16), (128, 16)]) == [(0, 103), (112, 32)]
    assert _spans([(0, 16), (32, 16)]) == [(0, 16), (32, 16)]  # a gap: never merged
    assert _spans([(0, 7), (16, 16)]) == [(0, 7), (16, 16)]  # a tail ends a run
    assert _spans([(0, 0), (0, 16), (16, 5)]) == [(0, 21)]  # empty parameters are skipped
    assert _spans([(0, 64), (64, 32)], merge=False) == [(0, 64), (64, 32)]


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
