"""The emulated device's CUDA-like mode (``EmulatedDevice(cuda_like=True)``) and the CUDA path's
construction, checked without a GPU.

CUDA's execution model: one issuing thread only launches; each stream's work runs later; a
dependency is a per-stream wait, never a host wait in the issuing path; stage times come from
the device, not from the launch; no host synchronization per step outside ``step()``. The
CUDA backend and the CUDA-like emulated device share that logic
(:class:`shfx.runtime.streams.DeviceStream`), so each mistake that would cost a GPU its overlap
fails a test here. Each check has a companion that re-introduces the mistake and shows the
check catches it.

No assertion here waits on a wall-clock outcome: a gated host task holds a dependency for as
long as the test wants, and the copy-time bound comes from the emulated link's pacing (a copy of
``n`` bytes at ``b`` B/s takes at least ``n / b`` seconds).
"""

from __future__ import annotations

import threading

import pytest
import torch
from zoo import gpt, token_batch

import shfx
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind
from shfx.runtime import streams
from shfx.runtime.emulated import EmulatedBackend
from shfx.runtime.pinned import PAGE, PinnedAllocator, page_rounded

LINK = "200MB/s"


def cuda_like(memory="64MiB", link=LINK, **kw):
    return shfx.EmulatedDevice(memory=memory, h2d=link, d2h=link, cuda_like=True, **kw)


def compiled(device, window=2, model=None, **kw):
    torch.manual_seed(0)
    model = model or gpt(layers=4)
    return shfx.compile(model, device=device, window=window, optimizer=shfx.optim.AdamW(lr=1e-2), **kw), model


def train(cm, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        (x, y), _, _ = token_batch(i)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        losses.append(loss.item())
    return losses


# ---- 1. a host dependency never blocks the issuing thread ------------------------------------------
def _issue_past_a_gated_host_dependency(backend: EmulatedBackend, timeout: float) -> bool:
    """Issue, on a thread of its own: a host task held by a gate, a copy that depends on it, then
    a compute task that does not. True when the issuing thread got through to the compute task
    while the gate was closed; the gate is opened afterwards either way."""
    gate = threading.Event()
    computed = threading.Event()
    host = backend.cpu.submit(gate.wait, (), "U0")
    src, dst = torch.ones(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    toks = {}

    def issue() -> None:
        toks["pf"] = backend.h2d.submit(lambda: backend.h2d_copy(dst, src), [host], "PF1")
        toks["f"] = backend.compute.submit(computed.set, [], "F0")

    t = threading.Thread(target=issue, name="issuer")
    t.start()
    through = computed.wait(timeout)
    launched_early = "pf" in toks and toks["pf"].is_launched
    gate.set()
    t.join(60)
    toks["pf"].wait()
    assert bool(dst.all()), "the copy that waited for the host task did not run after it"
    return through and not launched_early


def test_a_host_dependency_holds_only_its_stream():
    b = EmulatedBackend(cuda_like(memory="1GiB"))
    try:
        assert _issue_past_a_gated_host_dependency(b, timeout=60)
        assert b.deferred_launches == 1  # the copy went to the h2d stream's launcher thread
    finally:
        b.close()


def test_the_check_catches_a_host_wait_in_the_issuing_path(monkeypatch):
    # the mistake: the stream waits on the host for its dependencies before launching
    monkeypatch.setattr(streams, "_ready", lambda tok: (streams._wait_ready(tok), True)[1])
    b = EmulatedBackend(cuda_like(memory="1GiB"))
    try:
        assert not _issue_past_a_gated_host_dependency(b, timeout=1.0)
    finally:
        b.close()


def _forward_past_a_gated_deferred_update(cm, timeout: float, step: int = 0) -> tuple[bool, float, float]:
    """A clipped step defers its host updates into the next forward (each prefetch waits for the
    updates of the groups it copies). Train step ``step`` with group 1's update held; then call
    the model on a thread of its own: True when stage 0's forward ran while the update was held
    (and the two steps' losses)."""
    gate, ran = threading.Event(), threading.Event()
    out = {}
    (x, y), _, _ = token_batch(step)
    first = cm(x, y)
    first.backward()
    opt, engine = cm.engine.optimizer, cm.engine
    held = sorted(g for g, grp in enumerate(engine.store.groups) if grp.trainable_bytes)[1]
    update = opt.update

    def gated_update(g, *a, **kw):
        if g == held:
            gate.wait()
        return update(g, *a, **kw)

    forward = engine._forward

    def spy(ctx, stage, slot, keep_graph):
        forward(ctx, stage, slot, keep_graph)
        if stage.index == 0:
            ran.set()

    opt.update, engine._forward = gated_update, spy
    try:
        cm.step()  # starts the deferred updates, group `held` waits for the gate
        cm.zero_grad()
        assert engine.deferred, "the clipped step deferred no update into the next forward"
        (x, y), _, _ = token_batch(step + 1)
        t = threading.Thread(target=lambda: out.setdefault("loss", cm(x, y)), name="issuer")
        t.start()
        through = ran.wait(timeout)
        gate.set()
        t.join(120)
    finally:
        gate.set()
        opt.update, engine._forward = update, forward
    out["loss"].backward()
    cm.step()
    cm.zero_grad()
    return through, first.item(), out["loss"].item()


def test_a_deferred_update_holds_only_the_prefetches_that_need_it():
    cm, _ = compiled(cuda_like(), max_grad_norm=0.5)
    ref, _ = compiled(shfx.EmulatedDevice(memory="64MiB", h2d=LINK, d2h=LINK, cuda_like=False), max_grad_norm=0.5)
    try:
        through, *losses = _forward_past_a_gated_deferred_update(cm, timeout=60)
        assert through
        assert cm.engine.backend.deferred_launches > 0
        # the same training as the default emulated mode, to the bit
        assert losses + train(cm, 1, start=2) == train(ref, 3)
        for (k, a), (_, b) in zip(sorted(cm.state_dict().items()), sorted(ref.state_dict().items())):
            assert torch.equal(a, b), k
    finally:
        cm.close()
        ref.close()


def test_the_check_catches_a_host_wait_for_a_deferred_update(monkeypatch):
    cm, _ = compiled(cuda_like(), max_grad_norm=0.5)
    try:
        monkeypatch.setattr(streams, "_ready", lambda tok: (streams._wait_ready(tok), True)[1])
        assert not _forward_past_a_gated_deferred_update(cm, timeout=1.0)[0]
    finally:
        cm.close()


# ---- 2. stage times are the device's, not the launch's ----------------------------------------------
def _copy_times_hold(cm) -> bool:
    """Every prefetch took at least its bytes over the link's bandwidth, and every forward
    started after its prefetch ended."""
    bps = cm.engine.backend.spec.h2d_bps
    ev = {(e.action, e.phase): e for e in cm.engine.trace}
    ok = True
    for n in cm.program.nodes:
        m = get_meta(n)
        if m.kind == ActionKind.PREFETCH and m.bytes and (str(m.action), m.phase) in ev:
            e = ev[(str(m.action), m.phase)]
            ok &= e.end - e.start >= m.bytes / bps * 0.999
            f = ev.get((f"F{m.stage}", "forward"))
            if f is not None and m.phase == "forward":
                ok &= f.start >= e.end - 1e-6
    return ok


def test_trace_times_are_the_devices():
    cm, _ = compiled(cuda_like())
    try:
        train(cm, 2)
        assert _copy_times_hold(cm)
    finally:
        cm.close()


def test_the_check_catches_launch_times(monkeypatch):
    import time

    cm, _ = compiled(cuda_like())
    try:
        train(cm, 1)
        monkeypatch.setattr(cm.engine.backend, "stamp", time.perf_counter)  # the mistake: host clock at launch
        train(cm, 1, start=1)
        assert not _copy_times_hold(cm)
    finally:
        cm.close()


# ---- 3. no host synchronization per step outside step() -------------------------------------------
@pytest.mark.parametrize("policy", ["stronghold", "resident"])
def test_no_host_sync_in_forward_and_backward(policy):
    pol = shfx.Resident() if policy == "resident" else shfx.Stronghold(window=2)
    cm, _ = compiled(cuda_like(memory="256MiB"), window=None if policy == "resident" else 2, policy=pol)
    try:
        train(cm, 1)
        b = cm.engine.backend
        for i in range(2):
            (x, y), _, _ = token_batch(i + 1)
            s0 = b.host_syncs
            loss = cm(x, y)
            s1 = b.host_syncs
            loss.backward()
            s2 = b.host_syncs
            assert (s1 - s0, s2 - s1) == (0, 0), f"host syncs: forward {s1 - s0}, backward {s2 - s1}"
            if policy == "resident":  # the finite check stayed on the device, for step() to read at once
                assert cm.engine.nonfinite_flags
            cm.step()
            cm.zero_grad()
    finally:
        cm.close()


def test_the_check_catches_a_sync_at_the_end_of_forward(monkeypatch):
    from shfx.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_settle", lambda tok: tok.wait())  # the mistake: wait for everything
    cm, _ = compiled(cuda_like())
    try:
        train(cm, 1)
        b = cm.engine.backend
        (x, y), _, _ = token_batch(1)
        s0 = b.host_syncs
        cm(x, y).backward()
        assert b.host_syncs > s0
        cm.step()
    finally:
        cm.close()


def test_a_nonfinite_device_gradient_is_found_at_step():
    """The device-side finite check (a flag, no host read during backward): a non-finite
    gradient still skips the whole step with skip_nonfinite, as the host read did."""
    cm, _ = compiled(cuda_like(memory="256MiB"), window=None, policy=shfx.Resident(), skip_nonfinite=True)
    try:
        train(cm, 1)
        before = {k: v.clone() for k, v in cm.state_dict().items()}
        (x, y), _, _ = token_batch(1)
        loss = cm(x, y)
        loss.backward(torch.tensor(float("inf")))
        assert cm.engine.nonfinite_flags
        cm.step()
        assert cm.last_step_skipped
        for k, v in cm.state_dict().items():
            assert torch.equal(v, before[k]), k
        cm.zero_grad()
        train(cm, 1, start=2)
    finally:
        cm.close()


# ---- 4. no record_stream needed: copies touch only memory the backend allocated once ----------------
@pytest.mark.parametrize("policy", ["stronghold", "resident", "zero-offload"])
def test_copies_touch_only_backend_allocations(policy):
    """A copy stream reads or writes on the device only slot and buffer memory allocated once
    by the backend, whose reuse the program orders (RELEASE dependencies), never a tensor the
    caching allocator could hand to another stream while the copy runs: so the CUDA backend
    needs no ``record_stream``."""
    dev = cuda_like(memory="256MiB")
    torch.manual_seed(0)
    model = gpt(layers=4)
    allocs: list[tuple[int, int]] = []
    import shfx.runtime.emulated as emu

    alloc = emu.EmulatedBackend.alloc_device

    def recording_alloc(self, nbytes, what, term="other"):
        t = alloc(self, nbytes, what, term)
        allocs.append((t.data_ptr(), nbytes))
        return t

    bad: list[str] = []
    move = emu.EmulatedBackend._move

    def checked_move(self, direction, dst, src, throttle):
        dev_side = dst if direction == "h2d" else src
        p, n = dev_side.data_ptr(), dev_side.numel() * dev_side.element_size()
        if not any(a <= p and p + n <= a + m for a, m in allocs):
            bad.append(direction)
        return move(self, direction, dst, src, throttle)

    emu.EmulatedBackend.alloc_device, emu.EmulatedBackend._move = recording_alloc, checked_move
    try:
        pol = {"stronghold": shfx.Stronghold(window=2), "resident": shfx.Resident(), "zero-offload": shfx.ZeroOffload()}[policy]
        cm = shfx.compile(model, device=dev, policy=pol, optimizer=shfx.optim.AdamW(lr=1e-2))
        train(cm, 2)
        moved = cm.engine.backend.copies_h2d + cm.engine.backend.copies_d2h
        cm.close()
    finally:
        emu.EmulatedBackend.alloc_device, emu.EmulatedBackend._move = alloc, move
    assert moved > 0
    assert not bad, f"{len(bad)} copies touched device memory the backend did not allocate: {bad[:5]}"


# ---- 5. the CUDA backend's pieces that run without a GPU ---------------------------------------------
def test_pinned_memory_is_exact_size():
    calls = []
    a = PinnedAllocator(lambda p, n: calls.append(("register", p, n)), lambda p: calls.append(("unregister", p)))
    sizes = [1, PAGE, PAGE + 1, (1 << 20) + 3, 3 * (1 << 20)]
    bufs = [a.alloc(n) for n in sizes]
    assert [b.numel() for b in bufs] == sizes
    assert all(not b.any() for b in bufs)
    regs = [c for c in calls if c[0] == "register"]
    assert [n for _, _, n in regs] == [page_rounded(n) for n in sizes]  # not a power of two: 3 MiB stays 3 MiB
    assert all(p % PAGE == 0 for _, p, _ in regs)
    assert a.live_bytes == sum(page_rounded(n) for n in sizes) and a.allocations == len(sizes)
    assert all(a.owns(b) for b in bufs) and a.owns(bufs[3][5:100])
    assert not a.owns(torch.zeros(16, dtype=torch.uint8))
    del bufs[0]
    import gc

    gc.collect()
    assert a.live_bytes == sum(page_rounded(n) for n in sizes[1:])
    a.close()
    assert a.live_bytes == 0 and sum(c[0] == "unregister" for c in calls) == len(sizes)


def test_cuda_backend_pins_through_the_allocator_and_uses_blocking_events(monkeypatch):
    from shfx.runtime import cuda

    calls = []
    fake = type("B", (), {})()
    fake.pinned = PinnedAllocator(lambda p, n: calls.append(n), lambda p: None)
    t = cuda.CudaBackend.alloc_host(fake, 5 * (1 << 20) + 7, pin=True)
    assert t.numel() == 5 * (1 << 20) + 7 and calls == [page_rounded(5 * (1 << 20) + 7)]
    assert cuda.CudaBackend.alloc_host(fake, 100, pin=False).numel() == 100 and len(calls) == 1

    made = []

    class FakeEvent:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            made.append((enable_timing, blocking))

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    cuda.new_event()
    cuda.new_event(timing=True)
    assert made == [(False, True), (True, True)]


def test_cuda_like_trains_like_the_default_mode():
    a, _ = compiled(cuda_like(), window=2)
    b, _ = compiled(shfx.EmulatedDevice(memory="64MiB", h2d=LINK, d2h=LINK, cuda_like=False), window=2)
    try:
        assert train(a, 3) == train(b, 3)
        for (k, x), (_, y) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
            assert torch.equal(x, y), k
        assert str(a.engine.backend.spec).endswith("CUDA-like)")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cuda_like", [False, True])
def test_d2h_copy_cast_on_the_emulated_device(cuda_like):
    """The emulated backend's cast copy (a 16-bit gradient into the fp32 host gradient): exact,
    paced by the fp32 bytes on a throttled link, queued behind earlier copies in the CUDA-like
    mode."""
    from shfx.runtime.emulated import EmulatedBackend

    b = EmulatedBackend(shfx.EmulatedDevice(memory="64MiB", h2d="2GB/s", d2h="2GB/s", cuda_like=cuda_like))
    try:
        src = torch.randn(300_001).to(torch.bfloat16)
        dst = torch.zeros(300_001)
        before = b.bytes_d2h
        b.d2h.submit(lambda: b.d2h_copy_cast(dst, src)).wait()
        assert torch.equal(dst, src.float())
        assert b.bytes_d2h - before == 4 * src.numel()
        with pytest.raises(ValueError, match="host elements"):
            b.d2h_copy_cast(dst[:5], src[:6])
    finally:
        b.close()
