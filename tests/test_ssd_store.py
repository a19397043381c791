"""The SSD store (shfx/runtime/ssd.py): bitwise round trips through a real file, direct and
buffered I/O, the bounded bounce pool, the emulated SSD's bandwidth (a lower bound only), the
counters, the space check and the scratch file's lifetime, and errors that name what failed."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import threading
import time

import pytest
import torch

import shfx
from shfx.errors import SSDIOError, SSDSpaceError
from shfx.runtime import ssd
from shfx.runtime.ssd import SSDStore, check_space

CHUNK = 8192  # two 4 KiB blocks: small, so every size below spans several chunks


def _accepts_direct(directory) -> bool:
    path = os.path.join(directory, ".shfx-direct-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture(params=["direct", "buffered"])
def store_dir(request, tmp_path):
    """(directory, direct flag) for each mode; O_DIRECT cases skip where no directory takes it."""
    if request.param == "buffered":
        return tmp_path, False
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("this platform has no O_DIRECT")
    if _accepts_direct(tmp_path):
        return tmp_path, True
    pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (tmpfs on older kernels does); the buffered case runs")


def _files(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".ssd"))


def _aligned_tensor(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose memory starts on a page boundary (anonymous mmap), so O_DIRECT can use it directly."""
    size = max(nbytes, 1)
    raw = torch.frombuffer(mmap.mmap(-1, -(-size // 4096) * 4096), dtype=torch.uint8)
    return raw[:nbytes].view(dtype)


# ------------------------------------------------------------------------- round trips

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64]
NUMELS = [1, 7, 1023, 4097, 2 * CHUNK + 3, 5 * CHUNK // 4 + 11]


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 200, (numel,), generator=gen).to(dtype)
    if dtype.is_complex:
        return torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype) * 1j + 0.5
    return torch.randn(numel, generator=gen).to(dtype)


def test_round_trip_is_bitwise_for_many_keys_dtypes_and_sizes(store_dir):
    directory, direct = store_dir
    gen = torch.Generator().manual_seed(0)
    srcs = {}
    for i, dtype in enumerate(DTYPES):
        for j, numel in enumerate(NUMELS):
            src = _random(numel + i, dtype, gen)
            if (i + j) % 3 == 0:  # page-aligned memory: O_DIRECT goes straight from/to it where lengths allow
                aligned = _aligned_tensor(src.numel() * src.element_size(), dtype)
                aligned.copy_(src)
                src = aligned
            srcs[(dtype, j)] = src
    srcs[("empty", 0)] = torch.empty(0)
    srcs[("scalar", 0)] = torch.tensor(3.25, dtype=torch.float64)
    extents = {k: v.numel() * v.element_size() for k, v in srcs.items()}
    with SSDStore(directory, extents, direct=direct, workers=3, bounce_buffers=2, bounce_bytes=CHUNK) as store:
        assert store.direct is direct
        assert all(e.offset % store.alignment == 0 for e in store.extents.values())
        writes = [store.write_from(k, v) for k, v in srcs.items()]
        for w in writes:
            w.wait()
        # the bytes are in the file, at each extent's offset (read back without the store)
        with open(store.file_path, "rb") as f:
            for k, v in srcs.items():
                f.seek(store.extents[k].offset)
                assert f.read(extents[k]) == v.reshape(-1).view(torch.uint8).numpy().tobytes(), k
        outs = {k: torch.full_like(v, 1) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in srcs.items()}
        for r in [store.read_into(k, outs[k]) for k in srcs]:
            r.wait()
        for k in srcs:
            assert torch.equal(outs[k], srcs[k]), k
        assert store.bytes_written == store.bytes_read == sum(extents.values())
        assert store.writes == store.reads == len(srcs)
        if direct:
            assert 0 < store.bounce_peak_in_use <= 2  # unaligned tails and tensors went through the pool
        else:
            assert store.bounce_allocated_bytes == 0  # buffered I/O reads and writes the tensors' memory


def test_reads_and_writes_of_different_keys_overlap(store_dir):
    directory, direct = store_dir
    n = 6 * CHUNK + 5
    keys = [("m", g) for g in range(6)] + [("v", g) for g in range(6)]
    gen = torch.Generator().manual_seed(1)
    first = {k: torch.randn(n // 4 + 1, generator=gen) for k in keys}
    second = {k: torch.randn(n // 4 + 1, generator=gen) for k in keys}
    extents = {k: first[k].numel() * 4 for k in keys}
    with SSDStore(directory, extents, direct=direct, workers=2, bounce_bytes=CHUNK) as store:
        for r in [store.write_from(k, first[k]) for k in keys]:
            r.wait()
        # read the m's back while the v's are rewritten, all in flight at once
        outs = {k: torch.empty_like(first[k]) for k in keys}
        pending = []
        for g in range(6):
            pending.append(store.read_into(("m", g), outs[("m", g)]))
            pending.append(store.write_from(("v", g), second[("v", g)]))
        for r in pending:
            r.wait()
        for r in [store.read_into(("v", g), outs[("v", g)]) for g in range(6)]:
            r.wait()
        for g in range(6):
            assert torch.equal(outs[("m", g)], first[("m", g)])
            assert torch.equal(outs[("v", g)], second[("v", g)])


def test_requests_on_one_key_are_not_reordered(tmp_path, monkeypatch):
    release = threading.Event()
    real = os.pwritev

    def held(fd, buffers, offset):  # the write stays in flight until the test lets it go
        release.wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", held)
    with SSDStore(tmp_path, {"m": 4000, "v": 4000}, direct=False) as store:
        w = store.write_from("m", torch.zeros(1000))
        with pytest.raises(ValueError, match=r"read of 'm' issued while a write of it is in flight: wait\(\)"):
            store.read_into("m", torch.empty(1000))
        with pytest.raises(ValueError, match=r"write of 'm' issued while a write of it is in flight"):
            store.write_from("m", torch.zeros(1000))
        r = store.read_into("v", torch.empty(1000))  # another key is free
        r.wait()
        assert not w.is_done
        release.set()
        w.wait()
        release_reads = threading.Event()
        real_read = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: release_reads.wait(30) and real_read(fd, bufs, off))
        r1 = store.read_into("m", torch.empty(1000))
        r2 = store.read_into("m", torch.empty(1000))  # reads of one key may overlap
        with pytest.raises(ValueError, match=r"write of 'm' issued while a read of it is in flight"):
            store.write_from("m", torch.zeros(1000))
        release_reads.set()
        r1.wait(), r2.wait()
        assert store.reads == 3 and store.writes == 1


# ------------------------------------------------------------------------- direct I/O

def test_direct_auto_falls_back_where_open_refuses_o_direct(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("this platform has no O_DIRECT")
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with SSDStore(tmp_path, {"a": 5000}) as store:
        assert store.direct is False
        x = torch.arange(1250, dtype=torch.int32)
        store.write_from("a", x).wait()
        y = torch.empty_like(x)
        store.read_into("a", y).wait()
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match=r"refuses O_DIRECT.*direct='auto'"):
        SSDStore(tmp_path, {"a": 5000}, direct=True)
    assert _files(tmp_path) == []


def test_direct_auto_falls_back_where_the_first_direct_read_is_refused(tmp_path, monkeypatch):
    if not _accepts_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    real_preadv = os.preadv
    calls = []

    def refuse_direct_io(fd, buffers, offset):
        if os.get_blocking(fd) and (_fd_flags(fd) & os.O_DIRECT):
            calls.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct_io)
    with SSDStore(tmp_path, {"a": 5000}) as store:
        assert store.direct is False and calls == [0]
        x = torch.arange(1250, dtype=torch.int32)
        store.write_from("a", x).wait()
        y = torch.empty_like(x)
        store.read_into("a", y).wait()
        assert torch.equal(x, y)


def _fd_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_bounce_memory_stays_within_the_pool(tmp_path, monkeypatch):
    if not _accepts_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    allocated = []
    real_allocate = ssd._BouncePool._allocate

    def counting(pool):
        buf = real_allocate(pool)
        allocated.append(buf[0].numel())
        return buf

    monkeypatch.setattr(ssd._BouncePool, "_allocate", counting)
    # unaligned memory (a view at byte offset 1): every chunk of every request needs a bounce buffer
    n = 10 * CHUNK + 17
    backing = torch.randint(0, 255, (8, n + 1), dtype=torch.uint8)
    srcs = {g: backing[g, 1:] for g in range(8)}
    release = threading.Event()
    real = os.pwritev

    def held(fd, buffers, offset):  # writes wait until the test saw the pool full
        release.wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", held)
    with SSDStore(tmp_path, {g: n for g in srcs}, direct=True, workers=4, bounce_buffers=2, bounce_bytes=CHUNK) as store:
        writes = [store.write_from(g, s) for g, s in srcs.items()]
        deadline = time.monotonic() + 30
        while store._bounce.in_use < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        # 4 writers want a buffer: 2 hold one (blocked in the write), the other 2 wait for the pool
        assert store._bounce.in_use == 2 and sum(allocated) == 2 * CHUNK
        release.set()
        for r in writes:
            r.wait()
        outs = torch.zeros(8, n + 1, dtype=torch.uint8)
        for r in [store.read_into(g, outs[g, 1:]) for g in srcs]:
            r.wait()
        assert torch.equal(outs[:, 1:], backing[:, 1:])
        assert sum(allocated) == store.bounce_allocated_bytes == 2 * CHUNK  # never more than the pool
        assert len(allocated) == 2 and store.bounce_peak_in_use == 2
        assert store.bytes_read == store.bytes_written == 8 * n


# ------------------------------------------------------------------------- the emulated SSD

def test_emulated_ssd_takes_at_least_bytes_over_bandwidth():
    nbytes = 1_000_000
    read_bps, write_bps = 20e6, 10e6  # 50 ms and 100 ms per request
    with SSDStore.emulated({"a": nbytes, "b": nbytes}, read_bps="20MB/s", write_bps=10e6) as store:
        directory = store.path
        x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        t0 = time.perf_counter()
        store.write_from("a", x).wait()
        assert time.perf_counter() - t0 >= nbytes / write_bps
        # two writes issued together are served one after the other, like one device queue
        t0 = time.perf_counter()
        ra, rb = store.write_from("a", x), store.write_from("b", x)
        ra.wait()
        rb.wait()
        assert time.perf_counter() - t0 >= 2 * nbytes / write_bps
        out = torch.empty_like(x)
        t0 = time.perf_counter()
        store.read_into("a", out).wait()
        assert time.perf_counter() - t0 >= nbytes / read_bps
        assert torch.equal(out, x)
        assert (store.read_bps, store.write_bps) == (read_bps, write_bps)
    assert not os.path.exists(directory)  # the emulated SSD's temporary directory goes with it


def test_group_extents_follow_the_layout(tmp_path):
    from shfx.passes.layout import TensorInfo, copy_dtypes, plan_groups

    infos = [[TensorInfo("w", "param", (10, 3), torch.float32, trainable=True)], [TensorInfo("b", "param", (7,), torch.float32, trainable=True)]]
    fp32 = plan_groups(infos)
    bf16 = plan_groups(infos, copy_dtypes("bf16"))
    ext = ssd.group_extents(fp32, master=True)
    assert list(ext) == [("m", 0), ("v", 0), ("master", 0), ("m", 1), ("v", 1), ("master", 1)]
    assert ext[("m", 1)] == fp32[1].state_bytes and ext[("master", 0)] == fp32[0].master_bytes
    assert ssd.group_extents(bf16, states=("m",)) == {("m", 0): bf16[0].state_bytes, ("m", 1): bf16[1].state_bytes}
    with SSDStore(tmp_path, ext) as store:  # a group's fp32 state round-trips through its extent
        m = torch.randn(fp32[0].trainable_numel)
        store.write_from(("m", 0), m).wait()
        back = torch.empty_like(m)
        store.read_into(("m", 0), back).wait()
        assert torch.equal(back, m)


def test_store_from_offload_spec(tmp_path):
    spec = shfx.Offload(optimizer="nvme", path=str(tmp_path / "nvme"), nvme_read="3GB/s", nvme_write="2GB/s")
    with SSDStore.from_offload(spec, {("m", 0): 64}) as store:
        assert (store.read_bps, store.write_bps) == (3e9, 2e9)
        assert os.path.dirname(store.file_path) == str(tmp_path / "nvme")
    with pytest.raises(ValueError, match="puts nothing on NVMe"):
        SSDStore.from_offload(shfx.Offload(), {("m", 0): 64})


# ------------------------------------------------------------------------- counters and errors

def test_counters_are_the_bytes_requested(tmp_path):
    sizes = {"a": 1, "b": 4096, "c": 3 * CHUNK + 1}
    with SSDStore(tmp_path, sizes, bounce_bytes=CHUNK) as store:
        for k, n in sizes.items():
            store.write_from(k, torch.ones(n, dtype=torch.uint8)).wait()
        store.read_into("c", torch.empty(sizes["c"], dtype=torch.uint8)).wait()
        store.read_into("c", torch.empty(sizes["c"], dtype=torch.uint8)).wait()
        assert (store.bytes_written, store.writes) == (sum(sizes.values()), 3)
        assert (store.bytes_read, store.reads) == (2 * sizes["c"], 2)
        assert store.file_bytes == 4096 + 4096 + 7 * 4096  # each extent padded to the 4 KiB alignment


def test_a_failed_chunk_surfaces_on_wait_with_key_offset_and_path(tmp_path, monkeypatch):
    with SSDStore(tmp_path, {("m", 0): 100, ("v", 3): 3 * CHUNK}, direct=False, bounce_bytes=CHUNK) as store:
        real = os.pwritev
        offset_v = store.extents[("v", 3)].offset

        def failing(fd, buffers, offset):
            if offset == offset_v + CHUNK:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", failing)
        req = store.write_from(("v", 3), torch.zeros(3 * CHUNK, dtype=torch.uint8))
        with pytest.raises(SSDIOError) as info:
            req.wait()
        err = info.value
        assert err.key == ("v", 3) and err.offset == offset_v + CHUNK and err.path == store.file_path
        msg = str(err)
        assert "write of ('v', 3)" in msg and f"offset {offset_v + CHUNK}" in msg and store.file_path in msg
        assert "Input/output error" in msg and isinstance(err.__cause__, OSError)
        assert store.bytes_written == store.writes == 0  # a failed request is not counted
        with pytest.raises(SSDIOError):
            req.wait()  # it stays failed
        monkeypatch.setattr(os, "pwritev", real)
        store.write_from(("v", 3), torch.zeros(3 * CHUNK, dtype=torch.uint8)).wait()  # the key is free again


def test_bad_requests_say_what_to_pass(tmp_path):
    with SSDStore(tmp_path, {("m", g): 400 for g in range(3)}) as store:
        with pytest.raises(KeyError, match=r"no extent \('m', 7\); its keys are \('m', 0\), \('m', 1\), \('m', 2\)"):
            store.read_into(("m", 7), torch.empty(100))
        with pytest.raises(ValueError, match=r"holds 400 bytes and out has 404 \(\(101,\) torch.float32\)"):
            store.read_into(("m", 0), torch.empty(101))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            store.write_from(("m", 0), torch.empty(200)[::2])
        with pytest.raises(TypeError, match="needs a tensor as src"):
            store.write_from(("m", 0), b"\0" * 400)
    with pytest.raises(ValueError, match="is closed"):
        store.read_into(("m", 0), torch.empty(100))
    with pytest.raises(ValueError, match="non-empty mapping"):
        SSDStore(tmp_path, {})
    with pytest.raises(ValueError, match=r"extent 'a' must have an int number of bytes >= 0, got -1"):
        SSDStore(tmp_path, {"a": -1})
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        SSDStore(tmp_path, {"a": 1}, workers=0)
    with pytest.raises(ValueError, match="read_bps"):
        SSDStore(tmp_path, {"a": 1}, read_bps="fast")
    assert _files(tmp_path) == []


# ------------------------------------------------------------------------- space and lifetime

def test_not_enough_space_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    real = ssd.shutil.disk_usage
    monkeypatch.setattr(ssd.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(SSDSpaceError) as info:
        SSDStore(tmp_path, {("m", 0): 8192, ("v", 0): 8192})
    err = info.value
    assert (err.needed_bytes, err.available_bytes, err.path) == (16384, 10_000, str(tmp_path))
    msg = str(err)
    assert str(tmp_path) in msg and "needs 16384 bytes" in msg and "10000 bytes" in msg and "free" in msg
    assert "larger disk" in msg  # what to change
    assert _files(tmp_path) == []
    assert check_space(tmp_path, 10_000) == 10_000
    with pytest.raises(SSDSpaceError):
        check_space(tmp_path / "not" / "made" / "yet", 10_001)  # the nearest existing parent's filesystem


def test_enospc_while_preallocating_gives_the_same_error_and_removes_the_file(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SSDSpaceError, match=r"needs 12288 bytes .* free \(preallocating the file failed") as info:
        SSDStore(tmp_path, {"a": 5000, "b": 10})  # 8192 + 4096 bytes once padded
    assert isinstance(info.value.__cause__, OSError) and info.value.needed_bytes == 12288
    assert _files(tmp_path) == []


def test_a_failed_construction_removes_the_file(tmp_path, monkeypatch):
    def broken(fd, offset, length):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="Input/output error"):
        SSDStore(tmp_path, {"a": 5000})
    assert _files(tmp_path) == []


def test_the_file_goes_on_close_and_on_garbage_collection(tmp_path):
    store = SSDStore(tmp_path, {"a": 5000})
    path = store.file_path
    assert os.path.getsize(path) == 8192 and _files(tmp_path) == [os.path.basename(path)]
    store.close()
    store.close()  # idempotent
    assert not os.path.exists(path)
    store = SSDStore(tmp_path, {"a": 5000})
    store.write_from("a", torch.zeros(5000, dtype=torch.uint8)).wait()
    path = store.file_path
    del store
    gc.collect()
    assert not os.path.exists(path)


def test_the_file_goes_at_interpreter_exit(tmp_path):
    # NOTE: checked through the finalizer's registration, not a subprocess: importing torch
    # again would take most of this file's time budget on a loaded machine.
    store = SSDStore(tmp_path, {"a": 5000})
    assert store._finalizer.alive and store._finalizer.atexit
    path = store.file_path
    store._finalizer()  # what the interpreter runs at exit for a store still open
    assert not os.path.exists(path) and not store._finalizer.alive
