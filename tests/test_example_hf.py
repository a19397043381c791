"""examples/finetune_hf.py: a Hugging Face causal LM fine-tuned with the whole trainer's recipe.

At a small size (a 4-layer Llama built from a config, with attention dropout): the loss goes
down; a run stopped after 6 steps and resumed from its checkpoint in a new process trains steps
7-12 to the bit like the run that never stopped (losses and final weights); and the same recipe
in eager PyTorch (fused AdamW with the same groups, ``clip_grad_norm_``,
``get_cosine_schedule_with_warmup``, gradient accumulation) gives bitwise the same losses,
gradient norms and weights. Skips without transformers.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import shfx.checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_hf.py"

# 4 layers (6 stages: head, 4 blocks, tail; window 2), 12 steps of 2 micro-batches, on an
# emulated device of 640 KiB for 658 KiB of weights (a step's peak is 537 KiB)
SMALL = [
    "--layers", "4", "--hidden", "64", "--heads", "2", "--vocab", "32", "--seq", "16", "--batch", "8",
    "--grad-accum", "2", "--steps", "12", "--warmup", "2", "--lr", "1e-2", "--dropout", "0.1",
    "--device-memory", "640KiB", "--threads", "1", "--quiet",
]  # fmt: skip
HALF = 6


def _load_example():
    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = _load_example()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # NOTE: --threads 1 sets torch's intra-op threads for the whole process; put them back.
    # (One thread: on a loaded 2-core machine, two OpenMP threads make every step ~10x slower;
    # and the resumed run in its subprocess uses the same count, so the kernels are the same.)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def full():
    """The uninterrupted run: 12 steps."""
    return ex.main(SMALL)


def test_loss_goes_down_and_the_schedule_drives_the_optimizer(full):
    losses, lrs = full["losses"], full["lrs"]
    assert full["steps"] == list(range(1, 13)) and all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # from about ln(32) = 3.47 towards the chain's entropy (~1.3): measured 3.45 -> 2.75
    assert last < first - 0.4, losses
    assert last > full["loss_floor"]
    # linear warmup over 2 steps (step 1 runs at lr 0, as transformers' schedule does), then cosine
    sched = [0.0, 0.5e-2, 1e-2] + [0.5e-2 * (1 + math.cos(math.pi * k / 10)) for k in range(1, 10)]
    assert lrs == pytest.approx(sched, rel=1e-6, abs=1e-12)
    assert all(n > 0 for n in full["grad_norms"])
    # offloading is real: the device holds less than the weights
    assert full["device_memory"] < full["model_bytes"] and full["stats"]["device_bytes_peak"] <= full["device_memory"]


@pytest.mark.slow  # 13 s; a resume in a new process is checked bitwise by default in test_checkpoint
def test_resume_in_a_new_process_is_exact(full, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = [*SMALL, "--save-every", str(HALF), "--checkpoint-dir", str(ckpt)]
    first = ex.main([*flags, "--stop-after", str(HALF)])
    assert first["losses"] == full["losses"][:HALF]
    extra = shfx.checkpoint.read_info(str(ckpt / "latest"))["extra"]
    assert (extra["step"], extra["next_batch"]) == (HALF, 2 * HALF)

    out = tmp_path / "resumed.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *flags, "--resume", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(out, weights_only=True)
    assert resumed["start_step"] == HALF and resumed["steps"] == list(range(HALF + 1, 13))
    assert resumed["losses"] == full["losses"][HALF:]
    assert resumed["grad_norms"] == full["grad_norms"][HALF:] and resumed["lrs"] == full["lrs"][HALF:]
    assert resumed["state_dict"].keys() == full["state_dict"].keys()
    for k, v in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][k], v), k

    # a resume with other settings is refused before anything is built, naming the flag
    with pytest.raises(SystemExit, match=r"--steps 12 \(now 14\)"):
        ex.main([*flags, "--steps", "14", "--resume"])


def test_the_recipe_equals_eager_pytorch(full):
    """The same recipe written for eager PyTorch, as a Hugging Face user would."""
    args = ex.parse_args(SMALL)
    data = ex.MarkovData(args.vocab, args.seq, args.batch, args.seed)
    model = ex.build_model(args)
    decay, no_decay = ex.param_groups(model)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [named[n] for n in decay], "weight_decay": args.weight_decay},
         {"params": [named[n] for n in no_decay], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )  # fmt: skip
    sched = transformers.get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)
    losses, norms, batch = [], [], 0
    for _ in range(args.steps):
        step_loss = torch.zeros(())
        for _ in range(args.grad_accum):
            ids = data.batch(batch)
            batch += 1
            loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
            loss.backward()
            step_loss += loss.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(step_loss.item())
    assert losses == full["losses"]
    assert norms == full["grad_norms"]
    assert any(n > args.max_grad_norm for n in norms)  # clipping did something
    for k, v in model.state_dict().items():
        assert torch.equal(full["state_dict"][k], v), k


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_param_groups_are_hugging_face_trainers(arch):
    """No decay on biases and norm weights: the split transformers.Trainer makes."""
    args = ex.parse_args(["--arch", arch, "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "32"])
    model = ex.build_model(args)
    decay, no_decay = ex.param_groups(model)
    hf = set(transformers.Trainer.get_decay_parameter_names(None, model))
    assert set(decay) == hf & set(decay + no_decay) and no_decay
    assert set(decay).isdisjoint(no_decay) and len(decay) + len(no_decay) == len(list(model.parameters()))
    norm_weights = [n for n in no_decay if not n.endswith("bias")]
    assert norm_weights and all("norm" in n or ".ln_" in n for n in norm_weights)


def test_bad_flags_say_what_to_change(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint at .*drop --resume"):
        ex.main([*SMALL, "--checkpoint-dir", str(tmp_path / "none"), "--resume"])
    with pytest.raises(SystemExit):  # argparse: "--save-every and --resume need --checkpoint-dir D"
        ex.parse_args(["--save-every", "5"])
    with pytest.raises(SystemExit):
        ex.parse_args(["--hidden", "30", "--heads", "4"])
