"""Checkpoints of data-parallel training (shfx.dp_checkpoint): written by N ranks, loaded by M.

The reference is an eager model trained 3 steps with torch's AdamW in this process. Its state is
split into ranks' ranges the way the data-parallel runtime holds it (a tiny fake host store:
parameters back to back in a group's flat buffer, padded, chunk = ceil(T/N) per rank) and a fake
compiled model offers the runtime's protocol (``cm._engine.dp.state_pieces()`` ...). Spawned
processes with gloo on the CPU save with 2 ranks and load with 3; a 1-process checkpoint loads into
2 ranks; the 2-rank checkpoint loads into eager torch through ``load_into`` and into a compiled
model without data parallel: every element equals the reference (torch.equal). Two spawns in
all, each under a timeout; a failed and a killed rank leave the last good checkpoint.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import shfx.checkpoint as ckpt
import shfx.dp_checkpoint as dpc
from shfx.dp_checkpoint import flat_range_boxes
from shfx.errors import UsageError

FIELDS = ("exp_avg", "exp_avg_sq")
# the fake store's parameter groups (flat buffers), parameters back to back
GROUPS = [["net.0.weight", "net.0.bias", "net.1.weight"], ["net.1.bias", "net.2.weight", "net.2.bias", "scale"]]
PAD = 8  # each group's flat buffer is padded to a multiple of PAD elements
SPAWN_TIMEOUT_S = 180


# ---- flat_range_boxes -----------------------------------------------------------------------------------
def _is_box(shape: tuple[int, ...], a: int, b: int) -> bool:
    """Whether the flat range [a, b) of ``shape`` is one rectangular box (brute force)."""
    idx = [torch.tensor(i) for i in zip(*[tuple(int(x) for x in torch.unravel_index(torch.tensor(f), shape)) for f in range(a, b)])]
    if not shape:
        return (a, b) == (0, 1)
    volume = math.prod(int(i.max() - i.min() + 1) for i in idx)
    return volume == b - a


def _fewest_boxes(shape: tuple[int, ...], lo: int, hi: int) -> int:
    """The fewest boxes the range [lo, hi) splits into (dynamic programming over _is_box)."""
    best = [0] + [math.inf] * (hi - lo)
    for end in range(lo + 1, hi + 1):
        best[end - lo] = min(best[start - lo] + 1 for start in range(lo, end) if _is_box(shape, start, end))
    return best[hi - lo]


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 0), (1, 4), (3, 4), (4, 1), (2, 3, 4), (2, 1, 3), (3, 2, 2)])
def test_flat_range_boxes_tile_every_range_with_the_fewest_boxes(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for lo, hi in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, lo, hi)
        at = 0
        for offsets, sizes, start in boxes:
            assert len(offsets) == len(sizes) == len(shape)
            assert start == at, (shape, lo, hi, boxes)
            part = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            n = math.prod(sizes)
            assert n > 0
            # the box is the contiguous run of elements [lo + start, lo + start + n)
            assert torch.equal(part.reshape(-1), torch.arange(lo + start, lo + start + n)), (shape, lo, hi, boxes)
            at += n
        assert at == hi - lo, (shape, lo, hi, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        if hi - lo <= 12:  # the brute-force minimum is cubic
            assert len(boxes) == (_fewest_boxes(shape, lo, hi) if hi > lo else 0), (shape, lo, hi, boxes)


def test_flat_range_boxes_refuses_a_range_outside_the_tensor():
    with pytest.raises(UsageError, match=r"\[3, 13\) is not within a tensor of shape \(3, 4\)"):
        flat_range_boxes((3, 4), 3, 13)
    with pytest.raises(UsageError, match="0 <= lo <= hi <= numel"):
        flat_range_boxes((3, 4), 5, 4)


def test_ranges_that_overlap_or_leave_a_gap_are_refused():
    shape, dt = (3, 4), torch.float32
    dpc._check_tiling(("w", "exp_avg"), shape, dt, [(0, 5, 0, shape, dt), (5, 5, 2, shape, dt), (5, 12, 1, shape, dt)])
    with pytest.raises(UsageError, match=r"rank 1's \[4, 12\) overlaps element 5"):
        dpc._check_tiling(("w", "exp_avg"), shape, dt, [(0, 5, 0, shape, dt), (4, 12, 1, shape, dt)])
    with pytest.raises(UsageError, match=r"rank 1's \[6, 12\) leaves a gap before element 5"):
        dpc._check_tiling(("w", "exp_avg"), shape, dt, [(0, 5, 0, shape, dt), (6, 12, 1, shape, dt)])
    with pytest.raises(UsageError, match="end at element 11 of 12"):
        dpc._check_tiling(("w", "exp_avg"), shape, dt, [(0, 5, 0, shape, dt), (5, 11, 1, shape, dt)])
    with pytest.raises(UsageError, match=r"rank 0 holds w.exp_avg as \(3, 4\) torch.float32, rank 1 as \(12,\)"):
        dpc._check_tiling(("w", "exp_avg"), shape, dt, [(0, 5, 0, shape, dt), (5, 12, 1, (12,), dt)])


# ---- the model, the reference, the fake data-parallel runtime --------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))  # a 0-d parameter: a 0-d state

    def forward(self, x):
        return self.net(x) * self.scale


def _reference(tmp: str) -> dict:
    """Train 3 AdamW steps eagerly; save a 1-process checkpoint (p1) and the state (ref.pt)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    ref = {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        "lr": opt.param_groups[0]["lr"],
    }
    assert set(ref["state"]) == {n for g in GROUPS for n in g}
    ckpt.save_from(model, opt, os.path.join(tmp, "p1"))
    torch.save(ref, os.path.join(tmp, "ref.pt"))
    return ref


class FakeStore:
    """The optimizer states of one rank as the data-parallel runtime holds them: per group, a
    flat buffer (GROUPS' parameters back to back, padded to PAD), rank r holding elements
    [r * chunk, min(T, (r + 1) * chunk)), chunk = ceil(T / N), of each field (NaN until set)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], rank: int, ranks: int):
        self.pieces: dict[str, dict[str, tuple]] = {}
        self.buffers = []
        for names in GROUPS:
            spans, total = {}, 0
            for n in names:
                spans[n] = (total, total + math.prod(shapes[n]))
                total = spans[n][1]
            total = -(-total // PAD) * PAD
            chunk = -(-total // ranks)
            lo, hi = min(total, rank * chunk), min(total, (rank + 1) * chunk)
            for field in FIELDS:
                buf = torch.full((hi - lo,), float("nan"))
                self.buffers.append(buf)
                for n, (a, b) in spans.items():
                    s, e = max(a, lo), min(b, hi)
                    if s < e:  # a parameter outside this rank's range has no piece here
                        self.pieces.setdefault(n, {})[field] = (shapes[n], s - a, e - a, buf[s - lo : e - lo])

    def fill(self, state: dict) -> None:
        for n, fields in self.pieces.items():
            for f, (_, lo, hi, local) in fields.items():
                local.copy_(state[n][f].reshape(-1)[lo:hi])

    def mismatches(self, state: dict) -> list[str]:
        return [
            f"{n}.{f}[{lo}:{hi}]"
            for n, fields in self.pieces.items()
            for f, (_, lo, hi, local) in fields.items()
            if not torch.equal(local, state[n][f].reshape(-1)[lo:hi])
        ]


class FakeDP:
    def __init__(self, store: FakeStore, rank: int, ranks: int):
        self.store, self.rank, self.ranks, self.group = store, rank, ranks, dist.group.WORLD
        self.refreshed = 0

    def state_pieces(self, create=False):
        return self.store.pieces

    def refresh_masters(self):
        self.refreshed += 1


class FakeEngine:
    def __init__(self, dp):
        self.dp, self.skipped_steps = dp, 0

    def invalidate_device_weights(self):
        pass


class FakeCompiled:
    """What shfx.checkpoint.save/load use of a compiled model under data parallel."""

    scaler, skipped_steps, _pending_checkpoint = None, 0, None

    def __init__(self, rank: int, ranks: int, ref: dict | None):
        torch.manual_seed(100 + rank)  # weights unlike the reference's unless set from it
        self.module = Net()
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.5, weight_decay=0.01)
        shapes = {n: tuple(p.shape) for n, p in self.module.named_parameters()}
        self.store = FakeStore(shapes, rank, ranks)
        for n, p in self.module.named_parameters():  # the step counter stays in optimizer.state
            self.optimizer.state[p] = {"step": torch.tensor(0.0)}
        if ref is not None:
            self.module.load_state_dict(ref["weights"])
            self.store.fill(ref["state"])
            self.optimizer.param_groups[0]["lr"] = ref["lr"]
            for n, p in self.module.named_parameters():
                self.optimizer.state[p]["step"].copy_(ref["state"][n]["step"])
        self._engine = FakeEngine(FakeDP(self.store, rank, ranks))

    def state_dict(self):
        return self.module.state_dict()

    def _settle(self):
        pass

    def mismatches(self, ref: dict) -> list[str]:
        bad = [k for k, v in self.module.state_dict().items() if not torch.equal(v, ref["weights"][k])]
        bad += self.store.mismatches(ref["state"])
        named = dict(self.module.named_parameters())
        bad += [f"{n}.step" for n in ref["state"] if not torch.equal(self.optimizer.state[named[n]]["step"], ref["state"][n]["step"])]
        if self.optimizer.param_groups[0]["lr"] != ref["lr"]:
            bad.append("lr")
        if self._engine.dp.refreshed != 1:
            bad.append(f"refresh_masters called {self._engine.dp.refreshed} times")
        return bad


def _load_and_check(rank: int, ranks: int, path: str, ref: dict) -> float:
    cm = FakeCompiled(rank, ranks, None)
    t0 = time.perf_counter()
    ckpt.load(cm, path)
    took = time.perf_counter() - t0
    bad = cm.mismatches(ref)
    assert not bad, f"rank {rank}/{ranks} loaded {path} with these different from the reference: {bad}"
    return took


def _perturbed(ref: dict) -> dict:
    return {**ref, "state": {n: {f: v + 1 for f, v in fs.items()} for n, fs in ref["state"].items()}}


# ---- the spawned ranks --------------------------------------------------------------------------------
def _job_two_ranks(rank: int, ranks: int, tmp: str, ref: dict) -> dict:
    """A piece that breaks the protocol on rank 1 is refused on both ranks (no hang); 1 -> 2 (load
    p1); save p2 with 2 ranks; then a save that fails on rank 1 keeps p2."""
    bad = FakeCompiled(rank, ranks, None)
    if rank == 1:
        shape, lo, hi, local = bad.store.pieces["net.2.weight"]["exp_avg"]
        bad.store.pieces["net.2.weight"]["exp_avg"] = (shape, lo, hi, local[1:])
    expect = "must be a contiguous 1-D CPU tensor of hi - lo = 12" if rank == 1 else "rank 1 refused the checkpoint: the data-parallel"
    with pytest.raises(UsageError, match=expect):
        ckpt.load(bad, os.path.join(tmp, "p1"))
    times = {"load 1->2 s": _load_and_check(rank, ranks, os.path.join(tmp, "p1"), ref)}
    p2 = os.path.join(tmp, "p2")
    t0 = time.perf_counter()
    ckpt.save(FakeCompiled(rank, ranks, ref), p2)
    times["save 2 ranks s"] = time.perf_counter() - t0
    before = os.readlink(p2)
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        def fail(self, plan, planner):
            raise OSError("no space left on device (test)")

        FileSystemWriter.write_data = fail
    with pytest.raises(Exception, match="no space left on device"):
        ckpt.save(FakeCompiled(rank, ranks, _perturbed(ref)), p2)
    dist.barrier()
    assert os.readlink(p2) == before
    assert sorted(e for e in os.listdir(tmp) if e.startswith(".p2.")) == [before], "the failed save left files"
    return times


def _job_three_ranks(rank: int, ranks: int, tmp: str, ref: dict) -> dict:
    """2 -> 3 (load p2); then rank 2 is SIGKILLed half way through a save to p2."""
    times = {"load 2->3 s": _load_and_check(rank, ranks, os.path.join(tmp, "p2"), ref)}
    with open(os.path.join(tmp, f"times-3-{rank}.json"), "w") as f:
        json.dump(times, f)
    if rank == 2:
        os.environ[ckpt._KILL_ENV] = "data"  # this rank dies with its shards written, before the metadata
    try:
        ckpt.save(FakeCompiled(rank, ranks, _perturbed(ref)), os.path.join(tmp, "p2"))
    except Exception as e:  # the survivors: gloo reports the dead peer
        with open(os.path.join(tmp, f"survivor-{rank}.txt"), "w") as f:
            f.write(str(e)[:2000])
    return times


JOBS = {"two": _job_two_ranks, "three": _job_three_ranks}


def _worker(rank: int, ranks: int, port: int, tmp: str, job: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks, timeout=datetime.timedelta(seconds=60)
    )
    try:
        ref = torch.load(os.path.join(tmp, "ref.pt"))
        times = JOBS[job](rank, ranks, tmp, ref)
        with open(os.path.join(tmp, f"times-{job}-{rank}.json"), "w") as f:
            json.dump(times, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(ranks: int, job: str, tmp: str) -> float:
    """Run ``job`` on ``ranks`` spawned processes; a hang past SPAWN_TIMEOUT_S fails the test."""
    t0 = time.monotonic()
    ctx = mp.start_processes(_worker, args=(ranks, _free_port(), tmp, job), nprocs=ranks, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() - t0 > SPAWN_TIMEOUT_S:
                pytest.fail(f"the {ranks}-rank job {job!r} did not finish in {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return time.monotonic() - t0


def _eager_load_mismatches(path: str, ref: dict) -> list[str]:
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.01)
    ckpt.load_into(model, opt, path)
    names = {id(p): n for n, p in model.named_parameters()}
    bad = [k for k, v in model.state_dict().items() if not torch.equal(v, ref["weights"][k])]
    state = {names[id(p)]: s for p, s in opt.state.items()}
    assert set(state) == set(ref["state"])
    bad += [f"{n}.{f}" for n, fs in ref["state"].items() for f, v in fs.items() if not torch.equal(state[n][f], v)]
    return bad + (["lr"] if opt.param_groups[0]["lr"] != ref["lr"] else [])


def _compiled_load_mismatches(path: str, ref: dict) -> list[str]:
    """Load into a compiled model without data parallel (one process, no process group) that
    has taken a step (its optimizer state lives in the host store's flat buffers)."""
    import shfx

    torch.manual_seed(7)
    cm = shfx.compile(
        Net(), optimizer=shfx.optim.AdamW(lr=0.5, weight_decay=0.01), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None)
    )
    try:
        cm(torch.randn(4, 5)).square().mean().backward()
        cm.optimizer.step()
        cm.optimizer.zero_grad()
        cm.load_checkpoint(path)
        named = dict(cm.module.named_parameters())
        bad = [k for k, v in cm.state_dict().items() if not torch.equal(v, ref["weights"][k])]
        bad += [
            f"{n}.{f}" for n, fs in ref["state"].items() for f, v in fs.items() if not torch.equal(cm.optimizer.state[named[n]][f], v)
        ]
        return bad + (["lr"] if cm.optimizer.param_groups[0]["lr"] != ref["lr"] else [])
    finally:
        cm.close()


def test_saved_by_two_ranks_loads_with_three_one_and_eager(tmp_path):
    tmp = str(tmp_path)
    ref = _reference(tmp)
    took = {"spawn 2 ranks s": _spawn(2, "two", tmp)}
    p1, p2 = os.path.join(tmp, "p1"), os.path.join(tmp, "p2")
    # the same keys, shapes and dtypes as the 1-process checkpoint
    assert ckpt.read_info(p2)["tensors"] == ckpt.read_info(p1)["tensors"]
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(p2).read_metadata()
    chunks = {k: len(m.chunks) for k, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}
    written = {}
    for index in md.storage_data:
        written[index.fqn] = written.get(index.fqn, 0) + 1
    assert all(chunks[k] == 1 and written[k] == 1 for k in chunks if k.startswith("model.")), (chunks, written)
    # group 1: 49 elements padded to 56, chunk 28: net.1.weight ([42, 49)) is rank 1's alone; net.0.weight
    # (7, 5) at [0, 35) is cut inside row 5: rank 0 holds 5 rows + 3 elements, rank 1 2 elements + 1 row
    assert chunks["optimizer.state.net.1.weight.exp_avg"] == 1
    assert chunks["optimizer.state.net.0.weight.exp_avg"] == 4
    assert chunks["optimizer.state.scale.exp_avg"] == 1  # 0-d
    assert chunks["optimizer.state.net.0.weight.exp_avg"] == written["optimizer.state.net.0.weight.exp_avg"]

    assert _eager_load_mismatches(p2, ref) == []  # 2 -> eager torch, one process without a process group
    assert _compiled_load_mismatches(p2, ref) == []  # 2 -> a compiled model without data parallel
    before = os.readlink(p2)
    with pytest.raises(mp.ProcessExitedException) as e:
        _spawn(3, "three", tmp)
    assert e.value.error_index == 2 and e.value.signal_name == "SIGKILL", e.value
    for r in range(3):  # every rank's 2 -> 3 check ran (and passed) before the kill
        with open(os.path.join(tmp, f"times-3-{r}.json")) as f:
            took.update({f"rank {r} {k}": v for k, v in json.load(f).items()})
    assert os.readlink(p2) == before
    assert _eager_load_mismatches(p2, ref) == []  # the killed save left the last good checkpoint
    for r in range(2):
        with open(os.path.join(tmp, f"times-two-{r}.json")) as f:
            took.update({f"rank {r} {k}": v for k, v in json.load(f).items()})
    print("timings:", {k: round(v, 3) for k, v in took.items()})


def test_module_docstring_examples():
    import doctest

    assert doctest.testmod(dpc).failed == 0
