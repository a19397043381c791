"""``shfx.compare`` and ``shfx compare``: every policy predicted and measured side by side; a
policy that does not fit says why; the hardware path never builds real weights."""

from __future__ import annotations

import json

import pytest
import torch

import shfx
from shfx.cli import main
from shfx.passes.policies import policy_names

TINY = shfx.GPTShape(layers=2, hidden=32, heads=2, seq=16, batch=2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared machine another process
    holding a core makes 2-thread OpenMP compute several times slower (see benchmarks/README.md)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def all_fit(_one_thread):
    return shfx.compare(TINY, steps=2, device=shfx.EmulatedDevice(memory="16MiB", h2d="1GB/s", d2h="1GB/s"))


def test_every_policy_predicted_and_measured(all_fit):
    res = all_fit
    assert [r.policy for r in res.rows] == list(policy_names())
    for r in res.rows:
        p, m = r.predicted, r.measured
        assert r.fits and r.reason is None and r.measure_error is None, r.label
        assert p.error is None and p.step_s > 0 and p.bottleneck in ("compute", "link", "host optimizer")
        assert m.step_s > 0 and len(m.step_times_s) == 2
        # the program's copies are what the backend counts, step after step (a pinned budget)
        assert (m.h2d_bytes, m.d2h_bytes) == (p.h2d_bytes, p.d2h_bytes), r.label
        assert m.peak_device_bytes > 0 and p.peak_device_bytes > 0
        assert m.host_bytes > 0 and p.host_bytes >= m.host_bytes  # predicted adds the staging buffers
    res_ = res.row("resident")
    assert res_.measured.h2d_bytes == res_.measured.d2h_bytes == 0  # everything stays on the device
    sh, l2l = res.row("stronghold"), res.row("l2l")
    assert sh.label == "stronghold W=2" and sh.slots == 2 and l2l.slots == 1
    # offloading policies keep gradients and AdamW states on the host, resident and l2l do not
    assert sh.measured.host_bytes > 3 * res_.measured.host_bytes
    assert l2l.measured.host_bytes == res_.measured.host_bytes
    text = res.table()
    assert "predicted" in text and "measured, median of 2 steps" in text and "does not fit" not in text
    for r in res.rows:
        assert r.label in text
    d = json.loads(json.dumps(res.to_dict()))
    assert [r["label"] for r in d["rows"]] == [r.label for r in res.rows]
    lines = res.to_csv().splitlines()
    assert len(lines) == 1 + len(res.rows) and lines[0].startswith("policy,label,slots,fits")


def test_a_policy_that_does_not_fit_says_why():
    res = shfx.compare(
        TINY,
        policies=["resident", "stronghold"],
        steps=1,
        device=shfx.EmulatedDevice(memory="400KiB", h2d="1GB/s", d2h="1GB/s"),
    )
    resident, sh = res.row("resident"), res.row("stronghold")
    assert not resident.fits and resident.measured is None
    assert not resident.predicted.fits and "device memory" in resident.predicted.reason
    assert "400.0 KiB" in resident.reason  # the out-of-memory message names the capacity
    assert resident.predicted.peak_device_bytes > 400 * 1024
    assert sh.fits and sh.measured is not None
    text = res.table()
    assert "resident" in text and "does not fit: " in text


def test_cli_smoke(capsys, tmp_path):
    out_json = tmp_path / "cmp.json"
    argv = ["compare", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2",
            "--device", "emulated", "--h2d", "1GB/s", "--d2h", "1GB/s", "--policies", "l2l,stronghold",
            "--steps", "1", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stronghold W=2" in out and "l2l" in out and "measured" in out
    assert [r["policy"] for r in json.loads(out_json.read_text())["rows"]] == ["l2l", "stronghold"]
    with pytest.raises(SystemExit):  # argparse refuses an unknown policy
        main(["compare", "--policies", "fast"])


def test_hardware_path_predicts_without_building_weights(monkeypatch, capsys):
    import shfx.models

    built: list[torch.device] = []

    class RecordingGPT(shfx.models.GPT):
        def __init__(self, cfg):
            super().__init__(cfg)
            built.append(next(self.parameters()).device)

    monkeypatch.setattr(shfx.models, "GPT", RecordingGPT)
    res = shfx.compare(shfx.GPTShape(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304), hardware="V100-32GB-PCIe3")
    assert built and all(d.type == "meta" for d in built)  # a 2.5 B-param model, never materialised
    assert res.params > 2e9 and not res.measured
    resident, sh = res.row("resident"), res.row("stronghold")
    assert not resident.fits and "32.0 GiB" in resident.reason  # everything on a 32 GB V100 does not fit
    assert sh.fits and sh.predicted.step_s > 0 and sh.measured is None
    assert sh.predicted.host_bytes >= 16 * res.params  # fp32 master, grads, AdamW m and v on the host
    monkeypatch.undo()
    assert main(["compare", "--layers", "4", "--hidden", "256", "--heads", "4", "--hardware", "A100-80GB-PCIe4",
                 "--csv", "-"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("policy,") and len(lines) == 1 + len(policy_names())


# ---- mixed precision -------------------------------------------------------------------------------


REF = dict(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)


def test_hardware_path_in_16_bit():
    """bf16 on an A100 profile: half the prefetch bytes; gradients cast to fp32 on the device
    but the tied embedding's (16-bit: autograd sums it in the device dtype), so between half and
    all of fp32's bytes back; faster matmuls; fp16 pays
    for the step journal's rollback copies in host time and memory (on by default), bf16 not."""
    res = {p: shfx.compare(shfx.GPTShape(**REF, precision=p), hardware="A100-80GB-PCIe4", policies=["stronghold"])
           for p in ("fp32", "bf16", "fp16")}  # fmt: skip
    sh = {p: r.row("stronghold").predicted for p, r in res.items()}
    for p in ("bf16", "fp16"):
        assert sh[p].h2d_bytes == pytest.approx(sh["fp32"].h2d_bytes / 2, rel=1e-3)
        assert sh["fp32"].d2h_bytes / 2 < sh[p].d2h_bytes < sh["fp32"].d2h_bytes
        assert sh[p].step_s < sh["fp32"].step_s
        assert res[p].precision == {"bf16": "bfloat16", "fp16": "float16"}[p] and p in res[p].model
    assert sh["fp16"].step_s > sh["bf16"].step_s
    assert sh["fp16"].memory["host"]["rollback copies"] > 0 == sh["bf16"].memory["host"]["rollback copies"]
    assert "(rollback copies)" in res["fp16"].model and res["fp32"].model.endswith("vocab 50304")
    assert res["fp32"].precision == "float32"


def test_cli_precision_names(capsys):
    """--precision takes the short and the long names, and the hardware path predicts 16-bit."""
    args = ["compare", "--layers", "4", "--hidden", "256", "--heads", "4", "--hardware", "A100-80GB-PCIe4", "--csv", "-",
            "--policies", "stronghold"]  # fmt: skip
    outs = []
    for name in ("bf16", "bfloat16"):
        assert main([*args, "--precision", name]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert main([*args, "--precision", "fp32"]) == 0
    fp32 = capsys.readouterr().out
    h2d = lambda out: float(out.splitlines()[1].split(",")[9])  # noqa: E731 - pred_h2d_bytes
    assert h2d(outs[0]) == pytest.approx(h2d(fp32) / 2, rel=0.01)
    with pytest.raises(SystemExit):
        main([*args, "--precision", "fp8"])


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])  # (fp16: the slow run)
def test_16_bit_predicted_and_measured(precision):
    """A 16-bit run copies what its program says, half the fp32 run's bytes."""
    dev = shfx.EmulatedDevice(memory="16MiB", h2d="1GB/s", d2h="1GB/s")
    shape = shfx.GPTShape(layers=2, hidden=32, heads=2, seq=16, batch=2, precision=precision)
    res = shfx.compare(shape, steps=2, device=dev, policies=["stronghold", "zero-infinity"])
    fp32 = shfx.compare(TINY, steps=1, device=dev, policies=["stronghold"], measure=False)
    for r in res.rows:
        p, m = r.predicted, r.measured
        assert r.fits and m is not None, r.reason
        assert (m.h2d_bytes, m.d2h_bytes) == (p.h2d_bytes, p.d2h_bytes), r.label
    sh = res.row("stronghold").predicted
    assert sh.h2d_bytes < 0.6 * fp32.row("stronghold").predicted.h2d_bytes
    assert (sh.memory["host"]["rollback copies"] > 0) == (precision == "fp16")
