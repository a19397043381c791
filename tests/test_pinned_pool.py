"""The pinned pool (``shfx.compile(pinned=...)``, :mod:`shfx.runtime.pinned`, :mod:`shfx.passes.pinned`).

Every pinned host buffer of a backend comes from its one pool, within a budget; the plan pins
the PREFETCH images first, then the gradient buffers, then the staging buffers; what does not
fit is ordinary memory copied through pinned bounce buffers, on the CUDA backend and the
emulated device alike (the same ``Backend._bounce_copy``); a budget below the bounce buffers is
refused before training with the bytes needed; the ledger's ``"pinned"`` tier is what the pool
measures. No GPU needed: the CUDA backend's pool and copies run here with recorders in place of
``cudaHostRegister`` and CUDA events.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from zoo import gpt, gpt_tied, seeded_steps, token_batch

import shfx
from shfx.passes import pinned as plan_mod
from shfx.passes.pinned import BOUNCE_BUFFERS, PAGE, page_rounded, pinned_candidates, plan_for_groups, plan_pinned
from shfx.runtime import cuda
from shfx.runtime.backend import Backend
from shfx.runtime.emulated import EmulatedBackend
from shfx.runtime.pinned import PinnedAllocator

MiB = 1 << 20


# ---- the plan ----------------------------------------------------------------------------------------
def test_plan_pins_images_then_gradients_then_staging_first_fit():
    cands = pinned_candidates([16 * MiB, 16 * MiB, 1 * MiB], [16 * MiB, 0, 1 * MiB], staging=2, staging_bytes=16 * MiB)
    assert [n for n, _ in cands] == ["image 0", "image 1", "image 2", "gradient 0", "gradient 2", "staging 0", "staging 1"]
    everything = sum(page_rounded(n) for _, n in cands)
    assert plan_pinned(cands, None).pinned == tuple(cands)
    full = plan_pinned(cands, everything)
    assert full.pinned == tuple(cands) and full.bounce_buffers == 0 and full.pinned_bytes == everything
    # 4 bounce buffers of 4 MiB first, then first fit in priority order: both 16 MiB images leave
    # 2 MiB, where image 2 and gradient 2 (1 MiB each) fit and gradient 0 and the staging do not
    plan = plan_pinned(cands, 50 * MiB)
    assert [n for n, _ in plan.pinned] == ["image 0", "image 1", "image 2", "gradient 2"]
    assert [n for n, _ in plan.unpinned] == ["gradient 0", "staging 0", "staging 1"]
    assert (plan.bounce_buffers, plan.bounce_bytes) == (BOUNCE_BUFFERS, 4 * MiB)
    assert plan.pinned_bytes == 16 * MiB + 34 * MiB and plan.minimum_bytes == 16 * MiB and not plan.too_small
    assert plan.count("staging") == 0 and plan.plans("staging") and not plan.plans("image 9")
    small = plan_pinned(cands, 16 * MiB - 1)
    assert small.too_small and small.pinned == () and small.minimum_bytes == 16 * MiB
    # bounce buffers no larger than the largest buffer
    tiny = plan_pinned([("image 0", 3 * PAGE), ("image 1", 3 * PAGE)], 5 * PAGE)
    assert tiny.bounce_bytes == 3 * PAGE and tiny.too_small and tiny.minimum_bytes == 6 * PAGE  # (everything is smaller than 4 bounce buffers)


def test_pool_follows_the_plan_and_its_budget():
    calls = []
    pool = PinnedAllocator(lambda p, n: calls.append(n), lambda p: None, budget_bytes=None)
    plan = plan_pinned([("image 0", 5 * PAGE), ("image 1", 7 * PAGE), ("gradient 0", 3 * PAGE)], 14 * PAGE, chunk_bytes=PAGE)
    assert [n for n, _ in plan.pinned] == ["image 0", "gradient 0"] and plan.bounce_bytes == PAGE
    pool.set_plan(plan)
    assert calls == [PAGE] * BOUNCE_BUFFERS and pool.bounces  # the bounce buffers, up front
    a, b = pool.take(5 * PAGE, "image 0"), pool.take(7 * PAGE, "image 1")
    assert pool.owns(a) and not pool.owns(b) and pool.unpinned_allocations == 1
    # a buffer the plan does not know is pinned only beside what the plan reserves (gradient 0's 3 pages)
    extra, over = pool.take(2 * PAGE, "profile"), pool.take(PAGE, "profile")
    assert pool.owns(extra) and not pool.owns(over)
    g = pool.take(3 * PAGE, "gradient 0")
    assert pool.owns(g) and pool.live_bytes == 14 * PAGE == plan.pinned_bytes + 2 * PAGE
    del extra  # freed: unregistered, and no longer counted
    assert pool.live_bytes == plan.pinned_bytes
    pool.close()
    # one buffer more than the plan counts (a third staging buffer) is pinned if it fits beside the plan
    pool = PinnedAllocator(lambda p, n: None, lambda p: None)
    pool.set_plan(plan_pinned([("image 0", PAGE), ("staging 0", PAGE), ("staging 1", PAGE)], 4 * PAGE))
    bufs = [pool.take(PAGE, "image 0")] + [pool.take(PAGE, "staging") for _ in range(3)]
    assert all(pool.owns(b) for b in bufs) and pool.live_bytes == 4 * PAGE
    assert not pool.owns(pool.take(PAGE, "staging")) and pool.unpinned_allocations == 1  # (the budget is full)
    pool.close()


def test_set_plan_refuses_a_budget_below_the_bounce_buffers():
    pool = PinnedAllocator(lambda p, n: None, lambda p: None)
    plan = plan_pinned([("image 0", 8 * MiB), ("gradient 0", 8 * MiB)], MiB)
    with pytest.raises(shfx.UsageError, match=rf"at least 16.0 MiB \({16 * MiB} bytes\).*pinned={16 * MiB}"):
        pool.set_plan(plan)
    assert pool.plan is None and pool.allocations == 0


# ---- the option ----------------------------------------------------------------------------------------
def test_pinned_option_is_checked_and_normalised():
    cfg = shfx.config.Config.from_args
    assert cfg(pinned="8GiB").pinned == 8 << 30
    assert cfg(pinned=12345).pinned == 12345
    assert cfg().pinned == cfg(pinned="auto").pinned == plan_mod.default_pinned_bytes()
    assert cfg().pinned == int(plan_mod.physical_ram_bytes() * plan_mod.DEFAULT_RAM_FRACTION) // PAGE * PAGE
    for bad in ["lots", -1, 1.5, True, [8]]:
        with pytest.raises(ValueError) as e:
            cfg(pinned=bad)
        msg = str(e.value)  # what was given, and what is accepted
        assert msg.startswith(("pinned", "cannot read pinned")) and repr(bad) in msg and "8GiB" in msg and "'auto'" in msg, msg


# ---- every pinned buffer comes from the pool -------------------------------------------------------------
def _no_torch_pinning(monkeypatch):
    """Fail on any pinned allocation that does not go through a pool (torch's caching host allocator)."""
    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like"):
        orig = getattr(torch, name)

        def guarded(*a, _orig=orig, _name=name, **kw):
            assert not kw.get("pin_memory"), f"torch.{_name}(pin_memory=True) outside the pinned pool"
            return _orig(*a, **kw)

        monkeypatch.setattr(torch, name, guarded)

    def no_pin(self, *a, **kw):
        raise AssertionError("Tensor.pin_memory() outside the pinned pool")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pin)


def _train(cm, steps=3):
    losses = []
    for i in range(steps):
        (x, y), _, _ = token_batch(i)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _compiled(model_fn=gpt, device=None, **kw):
    torch.manual_seed(0)
    model = model_fn(layers=4) if model_fn is gpt else model_fn()
    device = device or shfx.EmulatedDevice(memory="64MiB")
    return shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=1e-2), **kw)


def _recorded(cm):
    """Replace the compiled model's pool (before its first call) by one that records every
    registration, as the CUDA backend's would call ``cudaHostRegister``."""
    calls = []
    pool = PinnedAllocator(lambda p, n: calls.append(n), lambda p: None, budget_bytes=cm.backend.pinned.budget_bytes)
    cm.backend.pinned = pool
    return pool, calls


def test_backends_share_one_host_allocation_path():
    # the CUDA backend and the emulated device allocate host memory alike: through their pool
    assert cuda.CudaBackend.alloc_host is Backend.alloc_host and EmulatedBackend.alloc_host is Backend.alloc_host
    assert isinstance(EmulatedBackend().pinned, PinnedAllocator)


@pytest.mark.parametrize("budget", [None, "300KiB"], ids=["default", "small"])
def test_every_pinned_buffer_comes_from_the_pool(monkeypatch, budget):
    cm = _compiled(**({} if budget is None else {"pinned": budget}))
    pool, calls = _recorded(cm)
    _no_torch_pinning(monkeypatch)
    _train(cm, 2)
    store = cm.engine.store
    plan = pool.plan
    # every registration is one of the pool's buffers: the planned ones and the bounce buffers
    assert len(calls) == pool.allocations == len(plan.changes([c for c in cm.variant.ledger().changes("host")]))
    assert sum(calls) == pool.live_bytes == cm.backend.pinned_bytes
    pinned = [pool.owns(b) for b in store.buffers] + [pool.owns(store.grad_bytes(g)) for g in range(len(store.groups)) if store._grads[g] is not None]
    assert pinned == [True] * len(pinned) if budget is None else 0 < sum(pinned) < len(pinned)
    assert not any(m is not None and pool.owns(m) for m in store.masters)  # (never sent: never pinned)
    cm.close()


def test_pin_memory_false_pins_nothing():
    cm = _compiled(pin_memory=False)
    _train(cm, 1)
    assert cm.backend.pinned_bytes == 0 and cm.backend.pinned.allocations == 0 and cm.backend.pinned.plan is None
    assert cm.stats()["pinned_planned_bytes"] is None
    cm.close()


# ---- a budget too small is refused before training ------------------------------------------------------
def test_budget_below_the_minimum_is_refused_before_training():
    ref = _compiled()
    _train(ref, 1)
    groups = ref.stages.groups
    ref.close()
    largest = max(max(g.nbytes, g.grad_bytes) for g in groups)
    cm = _compiled(pinned="64KiB")
    before = {k: v.clone() for k, v in cm.module.state_dict().items()}
    (x, y), _, _ = token_batch(0)
    with pytest.raises(shfx.UsageError) as e:
        cm(x, y)
    msg = str(e.value)
    need = int(re.search(r"\((\d+) bytes\)", msg).group(1))
    assert need == BOUNCE_BUFFERS * page_rounded(largest) == plan_for_groups(groups, 64 << 10).minimum_bytes
    assert f"pinned={need}" in msg and "64.0 KiB" in msg and "pin_memory=False" in msg
    # nothing trained, nothing pinned
    assert cm._engine is None and cm.backend.pinned.allocations == 0
    assert all(torch.equal(before[k], v) for k, v in cm.module.state_dict().items())
    cm.close()
    # the number it names is enough
    ok = _compiled(pinned=need)
    _train(ok, 1)
    assert ok.backend.pinned.unpinned_allocations > 0
    ok.close()


# ---- a small budget trains bitwise as the default -----------------------------------------------------
@pytest.mark.parametrize(
    "model_fn,precision,cuda_like",
    [(gpt, "fp32", False), pytest.param(gpt, "fp32", True, marks=pytest.mark.slow), pytest.param(gpt, "bf16", False, marks=pytest.mark.slow),
     (gpt_tied, "fp32", True)],  # (the second fp32 and the bf16 runs under SHFX_SLOW)
    ids=["fp32", "fp32-cuda-like", "bf16", "tied-cuda-like"],
)
def test_small_budget_trains_bitwise_like_the_default(monkeypatch, model_fn, precision, cuda_like):
    # one-page bounce buffers: every bounced copy takes several chunks
    monkeypatch.setattr(plan_mod, "BOUNCE_CHUNK_BYTES", PAGE)
    dev = lambda: shfx.EmulatedDevice(memory="64MiB", cuda_like=cuda_like)  # noqa: E731
    ref = _compiled(model_fn, dev(), precision=precision)
    small = _compiled(model_fn, dev(), precision=precision, pinned=16 * PAGE)
    a, b = _train(ref, 4), _train(small, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
    sa, sb = ref.state_dict(), small.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    pool = small.backend.pinned
    assert pool.unpinned_allocations > 0 and pool.bounced_copies > 0 and pool.bounce_bytes == PAGE
    assert ref.backend.pinned.bounced_copies == 0 and ref.backend.pinned.unpinned_allocations == 0
    # the same bytes cross the link, counted once per copy
    assert (ref.stats()["bytes_h2d"], ref.stats()["copies_h2d"]) == (small.stats()["bytes_h2d"], small.stats()["copies_h2d"])
    assert (ref.stats()["bytes_d2h"], ref.stats()["copies_d2h"]) == (small.stats()["bytes_d2h"], small.stats()["copies_d2h"])
    for cm in (ref, small):  # the ledger's pinned tier is what the pool holds
        led = cm.variant.ledger(pinned=cm.backend.pinned.plan)
        assert led.peak("pinned") == cm.backend.pinned_bytes == cm.stats()["pinned_planned_bytes"] > 0
        assert cm.backend.pinned_bytes <= cm.backend.pinned.budget_bytes
    ref.close()
    small.close()


def test_ledger_pinned_tier_term_by_term():
    cm = _compiled(pinned="300KiB")
    _train(cm, 1)
    plan = cm.backend.pinned.plan
    led = cm.variant.ledger(pinned=plan)
    terms = led.terms_at_peak("pinned")
    assert set(terms) == set(plan_mod.PINNED_TERMS)
    assert terms["bounce buffers"] == plan.bounce_total_bytes > 0
    assert terms["pinned buffers"] + terms["bounce buffers"] == cm.backend.pinned_bytes
    assert led.peak("host") == cm.variant.ledger().peak("host")  # (a view of the host memory, not more of it)
    # the report says it
    rep = str(cm.report())
    assert f"host memory {plan.describe()}" in rep and "in ordinary memory" in rep and "bounce buffers" in rep, rep
    cm.close()


# ---- the CUDA backend's bounce path, without a GPU ----------------------------------------------------
class _Event:
    made: list = []

    def __init__(self):
        self.recorded = self.synced = 0
        _Event.made.append(self)

    def record(self, stream=None):
        self.recorded += 1

    def synchronize(self):
        self.synced += 1


def _fake_cuda_backend(monkeypatch, pool):
    """A :class:`CudaBackend` whose pool is ``pool`` and whose events are recorders: its copy
    methods run on the CPU (``non_blocking`` copies between CPU tensors are ordinary ones)."""
    monkeypatch.setattr(cuda, "new_event", lambda timing=False: _Event())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    b = object.__new__(cuda.CudaBackend)  # (its __init__ needs a GPU)
    b._lock = threading.Lock()
    b.bytes_h2d = b.bytes_d2h = b.copies_h2d = b.copies_d2h = 0
    b.device = torch.device("cpu")
    b._cast_scratch = None
    b.pinned = pool
    return b


def test_cuda_backend_copies_unpinned_buffers_through_the_bounce_buffers(monkeypatch):
    calls = []
    pool = PinnedAllocator(lambda p, n: calls.append(n), lambda p: None)
    pool.set_plan(plan_pinned([("image 0", 3 * PAGE), ("image 1", 10 * PAGE + 12)], 8 * PAGE, chunk_bytes=PAGE))
    b = _fake_cuda_backend(monkeypatch, pool)
    assert calls == [PAGE] * BOUNCE_BUFFERS
    pinned, plain = b.alloc_host(3 * PAGE, True, "image 0"), b.alloc_host(10 * PAGE + 12, True, "image 1")
    assert pool.owns(pinned) and not pool.owns(plain) and calls == [PAGE] * BOUNCE_BUFFERS + [3 * PAGE]
    src = torch.arange(plain.numel() // 4, dtype=torch.float32)
    host = plain[: src.numel() * 4].view(torch.float32)
    host.copy_(src)
    dev = torch.zeros_like(src)
    _Event.made.clear()
    b.h2d_copy(dev, host)  # 11 chunks of a page
    assert torch.equal(dev, src) and len(_Event.made) == 11 and (b.copies_h2d, b.bytes_h2d) == (1, src.numel() * 4)
    # a device-to-host copy into ordinary memory: bounced, every chunk waited for before it is moved
    back_host = plain[: src.numel() * 4].view(torch.float32)
    back_host.zero_()
    _Event.made.clear()
    b.d2h_copy(back_host, dev)
    assert torch.equal(back_host, src) and all(e.synced == 1 for e in _Event.made) and len(_Event.made) == 11
    # the cast copy (a 16-bit gradient into the fp32 host gradient), bounced
    back_host.zero_()
    b.d2h_copy_cast(back_host, dev.to(torch.bfloat16))
    assert torch.equal(back_host, src.to(torch.bfloat16).float()) and b.copies_d2h == 2
    # a pinned buffer is copied directly (no event: one non_blocking copy)
    _Event.made.clear()
    b.h2d_copy(torch.zeros(3 * PAGE, dtype=torch.uint8), pinned)
    assert _Event.made == [] and pool.bounced_copies == 3
    pool.close()


# ---- the SSD store's bounce buffers ---------------------------------------------------------------------
def test_ssd_store_pins_its_bounce_buffers_through_the_pool(tmp_path):
    from test_ssd_store import _accepts_direct

    from shfx.runtime.ssd import SSDStore

    if not _accepts_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (buffered I/O uses no bounce buffer)")
    calls = []
    pool = PinnedAllocator(lambda p, n: calls.append(n), lambda p: None, budget_bytes=MiB)
    n = 5 * (64 << 10) + 17
    backing = torch.randint(0, 255, (n + 1,), dtype=torch.uint8)
    out = torch.zeros(n + 1, dtype=torch.uint8)
    # (a view at byte offset 1: unaligned, so every chunk goes through a bounce buffer)
    with SSDStore(tmp_path, {"a": n}, direct=True, bounce_buffers=2, bounce_bytes="64KiB", pin_memory=True, pinned=pool) as store:
        store.write_from("a", backing[1:]).wait()
        store.read_into("a", out[1:]).wait()
        bufs = [t for t, _ in store._bounce._free]
        assert bufs and all(pool.owns(t) for t in bufs) and all(t.data_ptr() % store.alignment == 0 for t in bufs)
        assert calls == [page_rounded(64 << 10)] * len(bufs) == [page_rounded(64 << 10)] * pool.allocations
    assert torch.equal(out[1:], backing[1:])
    pool.close()


# ---- data parallel: each rank's pool ------------------------------------------------------------------
def _dp_rank(rank: int, world: int, port: int, out: str) -> None:
    """A spawned rank: the default budget and a 16-page one (one-page bounce buffers), 3 steps
    each on its own batches; saves the losses, weights and the pinned bytes measured and planned."""
    import datetime
    import os
    import traceback

    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        plan_mod.BOUNCE_CHUNK_BYTES = PAGE
        res = {}
        for name, kw in (("default", {}), ("small", {"pinned": 16 * PAGE})):
            torch.manual_seed(rank)  # (the first call broadcasts rank 0's weights)
            cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=2,
                              optimizer=shfx.optim.AdamW(lr=1e-2), data_parallel=shfx.DataParallel(timeout_s=60), **kw)  # fmt: skip
            losses = []
            for i in range(3):
                (x, y), _, _ = token_batch(i, micro=10 * rank)
                loss = cm(x, y)
                loss.backward()
                cm.step()
                cm.zero_grad()
                losses.append(loss.detach().clone())
            pool = cm.backend.pinned
            led = cm.variant.ledger(pinned=pool.plan, rank=rank)
            res[name] = dict(losses=losses, weights={k: v.clone() for k, v in cm.state_dict().items()},
                             measured=cm.backend.pinned_bytes, ledger=led.peak("pinned"), bounced=pool.bounced_copies,
                             unpinned=pool.unpinned_allocations)  # fmt: skip
            cm.close()
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


@pytest.mark.slow  # (2 spawned ranks; the one-process ledger = pool tests run by default)
def test_data_parallel_ranks_pin_what_their_ledger_says_and_train_alike(tmp_path):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dp_rank, args=(r, 2, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [(tmp_path / f"rank{r}.err").read_text() for r in range(2) if (tmp_path / f"rank{r}.err").exists()]
    assert not errors and [p.exitcode for p in procs] == [0, 0], errors
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        d, s = res["default"], res["small"]
        assert all(torch.equal(a, b) for a, b in zip(d["losses"], s["losses"]))
        assert d["weights"].keys() == s["weights"].keys() and all(torch.equal(d["weights"][k], s["weights"][k]) for k in d["weights"])
        assert s["bounced"] > 0 and s["unpinned"] > 0 and d["bounced"] == 0
        for x in (d, s):
            assert x["measured"] == x["ledger"] > 0, (r, x["measured"], x["ledger"])


# ---- the parameter tier: its window buffers take the paged groups' places -------------------------------
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_parameter_tier_windows_are_planned_and_a_small_budget_trains_alike(tmp_path, monkeypatch, precision):
    from shfx.models import GPT, GPTShape

    monkeypatch.setattr(plan_mod, "BOUNCE_CHUNK_BYTES", PAGE)
    shape = GPTShape(vocab=64, seq=16, layers=4, heads=2, hidden=32, dropout=0.1)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(3)]
    out = {}
    for name, kw in (("default", {}), ("small", {"pinned": 16 * PAGE})):
        torch.manual_seed(0)
        tier = shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme", path=str(tmp_path / name), host_window=2)
        cm = shfx.compile(GPT(shape), device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
                          optimizer=shfx.optim.AdamW(lr=1e-2), offload=tier, precision=precision, **kw)  # fmt: skip
        losses = seeded_steps(cm, cm, batches)  # (seeded once: dropout draws from the user's stream)
        pool, prog = cm.backend.pinned, cm.variant.train
        names = [n for n, _ in pool.plan.pinned + pool.plan.unpinned]
        assert prog.ssd_images and not any(f"image {i}" in names for i in prog.ssd_images)
        assert sum(n.startswith("image window") for n in names) == prog.image_window
        assert pool.bounced_copies > 0 if name == "small" else pool.bounced_copies == 0
        assert cm.backend.pinned_bytes == cm.variant.ledger(pinned=pool.plan).peak("pinned") == cm.stats()["pinned_planned_bytes"]
        out[name] = (losses, {k: v.clone() for k, v in cm.state_dict().items()})
        cm.close()
    (a, sa), (b, sb) = out["default"], out["small"]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- activation offload's buffers: made after the plan, pinned beside it ------------------------------
@pytest.mark.parametrize(
    "kw", [{}, {"pinned": 40 * PAGE}, pytest.param({"pin_memory": False}, marks=pytest.mark.slow)], ids=["default", "small", "unpinned"]
)
def test_offloaded_activations_are_pinned_beside_the_plan(monkeypatch, kw):
    monkeypatch.setattr(plan_mod, "BOUNCE_CHUNK_BYTES", PAGE)
    cm = _compiled(offload=shfx.Offload(activations="host"), **kw)
    ref = _compiled()
    assert all(torch.equal(a, b) for a, b in zip(_train(cm, 3), _train(ref, 3)))
    pool = cm.backend.pinned
    host = cm.variant.ledger().changes("host")
    assert any(c.term == "offloaded activations" for c in host)
    if kw.get("pin_memory") is False:  # nothing pinned, whoever asks (the activation stash asks)
        assert cm.backend.pinned_bytes == 0 and pool.allocations == 0 and pool.unpinned_allocations > 0
    else:
        assert cm.backend.pinned_bytes == cm.variant.ledger(pinned=pool.plan).peak("pinned") <= pool.budget_bytes
    cm.close()
    ref.close()
