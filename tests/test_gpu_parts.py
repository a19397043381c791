"""The GPU kit's parts run their code paths on the CPU with an emulated Kit
(benchmarks/gpu_common.py) at tiny sizes, in this process, and return what the kit reports: the
keys a GPU run fills, with sane values. Parts 4 (speed), 7 (host AdamW), 8 (attention kernels) and
9 (peers) one test each; the core parts 1, 2, 3, 5 and 6 in one test (the whole kit in its
subprocesses, ``gpu.py --emulated``, is tests/test_gpu_kit.py's, its full run with SHFX_SLOW=1)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

gpu_common = pytest.importorskip("gpu_common")
core = pytest.importorskip("gpu_parts_core")
speed = pytest.importorskip("gpu_parts_speed")
peers = pytest.importorskip("gpu_parts_peers")


@pytest.fixture
def kit(tmp_path):
    # one intra-op thread: these are code-path checks, and on a loaded 2-core machine OpenMP teams
    # of 2 make the tiny steps ~50x slower (each parallel region waits for a descheduled worker)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield gpu_common.Kit(emulated=True, out=tmp_path / "out", deadline=time.monotonic() + 300)
    finally:
        torch.set_num_threads(prev)


def finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_core_parts_emulated(kit):
    """Parts 1, 2, 3, 5, 6 (the core of ``gpu.py``): what tests/test_gpu_kit.py's full emulated
    run (slow) checks of them, each part with its own Kit as a part's subprocess gets."""
    fns = {1: core.part_environment, 2: core.part_equivalence, 3: core.part_residency, 5: core.part_simulator, 6: core.part_capacity}
    results = {}
    for n, fn in fns.items():
        part_kit = gpu_common.Kit(emulated=True, out=kit.out, deadline=time.monotonic() + 120, part=str(n))
        results[n] = fn(part_kit)
        json.dumps(results[n])  # JSON-able
    assert results[1]["links"]["h2d_pinned_bps"] > 0
    eq = [r for r in results[2]["equivalence"] if "max_loss_diff" in r]
    assert eq and all(r["bitwise_weights"] for r in eq)  # on the CPU: bitwise
    res = [r for r in results[3]["runs"] if "ledger_peak" in r]
    assert res and all(r["backend_peak_equals_ledger"] and r["bytes_equal"] and r["host_equals_ledger"] for r in res)
    assert any(r.get("ratio") for r in results[5]["rows"])
    assert results[6].get("losses_finite") is True
    # results go back through the return values: the parts write no files of their own
    assert sorted(p.name for p in kit.out.iterdir()) == ["gpu_log.txt"]


def test_part_speed_emulated(kit):
    r = speed.part_speed(kit)
    json.dumps(r)  # JSON-able
    assert set(r["models"]) == {"gpt", "llama"}
    for arch, m in r["models"].items():
        assert "error" not in m, m.get("traceback")
        assert finite_pos(m["throughput_ratio_stronghold_over_resident"]), arch
        assert m["window"] >= 1 and m["window_how"] == "auto"
        assert "window report" in m["report"]
        for run in ("resident", "stronghold"):
            assert finite_pos(m[run]["step_s_median"]) and len(m[run]["steps_s"]) >= 2
            assert finite_pos(m[run]["model_tflops"]) and finite_pos(m[run]["tokens_per_s"])
            assert m[run]["hardware_tflops_with_recompute"] == pytest.approx(m[run]["model_tflops"] * 8 / 6)
            assert all(math.isfinite(x) for x in m["losses"][run])
        # the same weights and batches, the eager bf16 recipe against shfx's (bitwise on the CPU today)
        assert m["max_loss_diff"] < 1e-2
        assert m["params"] > 0 and m["tokens_per_step"] == m["shape"]["batch"] * m["shape"]["seq"]
        # shfx refuses Resident() in bf16 today: the baseline says which it is and why
        assert m["resident_kind"]
        assert (m["shfx_resident_bf16_refused"] is None) == m["resident_kind"].startswith("shfx")
    assert r["throughput_ratio"]["gpt"] > 0 and "meets_target" in r
    tr = r["models"]["gpt"]["trace"]
    assert "error" not in tr, tr
    doc = json.loads((kit.out / "trace_step.json").read_text())
    ev = doc["traceEvents"]
    measured = [e for e in ev if e.get("pid") == 1 and e["ph"] == "X"]
    simulated = [e for e in ev if e.get("pid") == 2 and e["ph"] == "X"]
    assert {"F0", "B0"} <= {e["name"] for e in measured} and simulated
    assert all(e["dur"] >= 0 for e in measured)
    assert tr["runtime_events"] == len(measured)
    assert sorted(p.name for p in kit.out.iterdir() if p.suffix == ".json") == ["trace_step.json"]


def test_part_attention_emulated(kit):
    r = speed.part_attention(kit)
    json.dumps(r)
    assert r["attn_implementation"] == "sdpa"
    for who in ("shfx", "eager"):
        ops = r[who]["aten_ops"]
        assert any("scaled_dot_product" in k for k in ops), ops
        assert r[who]["verdict"] in ("fused", "math", "both")
        assert isinstance(r[who]["sdpa_with_mask"], bool) and r[who]["sdpa_input_shapes"]
    assert r["shfx"]["cuda_kernels"] == {} and r["eager"]["cuda_kernels"] == {}
    # on the CPU both run torch's fused CPU flash kernel (shfx recomputes the forward: more calls)
    assert r["same_verdict"] and r["both_fused"], r["summary"]
    assert any("flash_attention_for_cpu" in k for k in r["shfx"]["fused_attention_ops"])


def test_part_host_adam_emulated(kit):
    r = speed.part_host_adam(kit)
    json.dumps(r)
    assert r["returncode"] == 0, r.get("stderr_tail")
    assert finite_pos(r["adamw_gbs"]) and finite_pos(r["adamw_fraction_of_stream_bound"])
    assert finite_pos(r["adamw_fraction_of_probe_bound"]) and finite_pos(r["stream_bound_gbs"])
    assert r["check_ok"] is True
    assert r["working_copy"] and r["working_copy"][0]["equals_master_cast"]
    assert r["configs"] and {"1x1", "2x1"} <= set(r["configs"][0])


def test_part_peers_emulated(kit):
    r = peers.part_peers(kit)
    json.dumps(r)
    assert set(r["models"]) == {"gpt", "llama"}
    for arch, entry in r["models"].items():
        assert set(entry) == set(peers.SYSTEMS)
        for system in ("shfx", "fsdp2"):
            e = entry[system]
            assert e["status"] == "ran", (arch, system, e.get("error"), e.get("traceback"))
            assert finite_pos(e["step_s_median"]) and finite_pos(e["model_tflops"])
            assert all(math.isfinite(x) for x in e["losses"])
            assert finite_pos(e["host_peak_rss_bytes"]) and e["gpu_peak_allocated_bytes"] is None
        assert "offload" in entry["fsdp2"] and entry["fsdp2"]["backend"] == "gloo"
        for system in ("torchao", "deepspeed"):  # CUDA only (and only where carried)
            assert entry[system]["status"] == "unavailable"
            assert entry[system]["reason"].startswith("not available here: ")
        assert r["table"][arch]["shfx"]["throughput_vs_shfx"] == pytest.approx(1.0)
    assert json.loads((kit.out / "peers.json").read_text())["models"].keys() == r["models"].keys()
    assert sorted(p.name for p in kit.out.iterdir() if p.suffix == ".json") == ["peers.json"]
