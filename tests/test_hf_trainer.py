"""Hugging Face's Trainer and accelerate with shfx (shfx/hf.py, docs/usage.md "Hugging Face
Trainer and accelerate").

Each run is compared with its eager twin, bitwise: ``shfx.hf.Trainer`` against
``transformers.Trainer`` on the eager model (weight-decay groups, warmup + cosine, clipping with
the norm above and below the threshold, gradient accumulation, dropout, the loss normalised by
the batch's token count), against the plain shfx loop, across a Trainer checkpoint and resume;
an ``accelerate`` loop over the compiled model against the same loop over the eager one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shfx
from shfx.errors import UsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import shfx.hf  # noqa: E402  (needs transformers)

VOCAB, SEQ = 64, 16


def _model(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[: i % 3] = -100  # a different number of counted tokens per example
        return {"input_ids": ids, "labels": labels}


def _args(out: str, steps: int = 4, **kw):
    base = dict(
        output_dir=out, per_device_train_batch_size=4, max_steps=steps, report_to=[], use_cpu=True, logging_steps=1,
        save_strategy="no", gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1,
        lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=0.95, seed=0, disable_tqdm=True,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


def _options() -> dict:
    return {"window": 1, "device": shfx.EmulatedDevice(memory="64MiB")}


def _log(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"weights differ: {bad[:5]}"


def test_trainer_matches_the_eager_trainer(tmp_path):
    eager_model = _model()
    t = shfx.hf.Trainer(model=_model(), args=_args(str(tmp_path / "a")), train_dataset=_Data(), shfx_options=_options())
    t.train()
    e = transformers.Trainer(model=eager_model, args=_args(str(tmp_path / "b")), train_dataset=_Data())
    e.train()
    assert _log(t, "loss") == _log(e, "loss") and len(_log(t, "loss")) == 4
    assert _log(t, "learning_rate") == _log(e, "learning_rate")
    norms, eager_norms = _log(t, "grad_norm"), _log(e, "grad_norm")
    assert norms == eager_norms
    assert min(norms) < 0.95 < max(norms), f"want the norm above and below max_grad_norm: {norms}"
    _assert_same_weights(t.compiled.state_dict(), eager_model.state_dict())
    # evaluation: the loss under torch.no_grad() (shfx's inference program)
    ev, eager_ev = t.evaluate(_Data()), e.evaluate(_Data())
    assert ev["eval_loss"] == eager_ev["eval_loss"]
    # the optimizer state, torch's format on both sides (the Trainer's groups: decay, no decay)
    mine, theirs = t.optimizer.state_dict(), e.optimizer.state_dict()
    assert [g["weight_decay"] for g in mine["param_groups"]] == [0.1, 0.0]
    assert [len(g["params"]) for g in mine["param_groups"]] == [len(g["params"]) for g in theirs["param_groups"]]
    for i, s in theirs["state"].items():
        for k, v in s.items():
            assert torch.equal(mine["state"][i][k], v), (i, k)


class _InOrder:
    """A trainer that takes the batches in dataset order (so a plain loop can replay them)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def test_trainer_matches_the_plain_loop(tmp_path):
    """A model compiled by the user, trained by the Trainer, against the loop one writes by hand."""

    class T(_InOrder, shfx.hf.Trainer):
        pass

    def compiled():
        opt = shfx.optim.AdamW(groups=lambda name, p: {"weight_decay": 0.0} if ("bias" in name or ".ln_" in name) else None,
                               lr=1e-3, weight_decay=0.1)  # fmt: skip
        return shfx.compile(_model(dropout=0.0), optimizer=opt, grad_accum_steps=2, max_grad_norm=0.95, **_options())

    cm = compiled()
    t = T(model=cm, args=_args(str(tmp_path / "a")), train_dataset=_Data())
    t.train()

    ref = compiled()
    sched = transformers.get_cosine_schedule_with_warmup(ref.optimizer, num_warmup_steps=1, num_training_steps=4)
    data, losses, norms = _Data(), [], []
    for step in range(4):
        micro = [[data[i] for i in range(8 * step + 4 * m, 8 * step + 4 * m + 4)] for m in range(2)]
        batches = [{k: torch.stack([x[k] for x in b]) for k in b[0]} for b in micro]
        counted = sum(int((b["labels"][:, 1:] if t._loss_shifts_labels else b["labels"]).ne(-100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            loss = ref(**b, num_items_in_batch=torch.tensor(counted)).loss
            loss.backward()
            total += loss.detach()
        norms.append(ref.clip_grad_norm_(0.95).item())
        ref.step()
        sched.step()
        ref.zero_grad()
        losses.append(float(total))
    assert _log(t, "grad_norm") == norms
    assert _log(t, "loss") == losses
    _assert_same_weights(cm.state_dict(), ref.state_dict())


def test_trainer_checkpoint_resumes_exactly(tmp_path):
    out = str(tmp_path / "run")
    t = shfx.hf.Trainer(model=_model(), args=_args(out, save_strategy="steps", save_steps=2), train_dataset=_Data(),
                        shfx_options=_options())  # fmt: skip
    t.train()
    full = t.compiled.state_dict()
    r = shfx.hf.Trainer(model=_model(), args=_args(out, save_strategy="steps", save_steps=2), train_dataset=_Data(),
                        shfx_options=_options())  # fmt: skip
    r.train(resume_from_checkpoint=out + "/checkpoint-2")
    assert _log(r, "loss")[-2:] == _log(t, "loss")[-2:]
    _assert_same_weights(r.compiled.state_dict(), full)
    # the saved model is a Hugging Face checkpoint an eager model loads
    t.save_model(str(tmp_path / "final"))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    _assert_same_weights(back.state_dict(), full)


def test_accelerate_loop_matches_eager():
    from accelerate import Accelerator

    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))} for i in range(16)]
    for d in data:
        d["labels"] = d["input_ids"]

    def run(model, opt, clip):
        acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
        sched = transformers.get_cosine_schedule_with_warmup(opt, 1, 4)
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        torch.manual_seed(1)
        losses = []
        for batch in loader:
            with acc.accumulate(model):
                out = model(**batch)
                acc.backward(out.loss)
                losses.append(out.loss.item())
                if acc.sync_gradients:
                    losses.append(float(clip(model)))
                opt.step()
                sched.step()
                opt.zero_grad()
        return losses

    eager = _model()
    cm = shfx.compile(_model(), optimizer=shfx.optim.AdamW(lr=1e-3), grad_accum_steps=2, max_grad_norm=0.5, **_options())
    mine = run(cm, cm.optimizer, lambda m: cm.clip_grad_norm_(0.5))
    theirs = run(eager, torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True),
                 lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))  # fmt: skip
    assert mine == theirs
    _assert_same_weights(cm.state_dict(), eager.state_dict())


def test_what_the_adapter_refuses(tmp_path):
    cm = shfx.compile(_model(), optimizer=shfx.optim.AdamW(), **_options())
    with pytest.raises(UsageError, match="shfx.hf.Trainer"):
        transformers.Trainer(model=cm, args=_args(str(tmp_path)), train_dataset=_Data())
    with pytest.raises(UsageError, match="gradient_accumulation_steps=2.*grad_accum_steps=1"):
        shfx.hf.Trainer(model=cm, args=_args(str(tmp_path)))
    with pytest.raises(UsageError, match="compiled without max_grad_norm"):
        shfx.hf.Trainer(model=cm, args=_args(str(tmp_path), gradient_accumulation_steps=1))
    with pytest.raises(UsageError, match="precision"):
        shfx.hf.Trainer(model=_model(), args=_args(str(tmp_path), bf16=True))
    with pytest.raises(UsageError, match="optim='adafactor'"):
        shfx.hf.Trainer(model=_model(), args=_args(str(tmp_path), optim="adafactor"), shfx_options=_options())
    other = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(UsageError, match="cm.optimizer"):
        shfx.hf.Trainer(model=_model(), args=_args(str(tmp_path)), shfx_options=_options(), optimizers=(other, None))
    bare = shfx.compile(_model(), **_options())
    with pytest.raises(UsageError, match="no optimizer"):
        shfx.hf.Trainer(model=bare, args=_args(str(tmp_path)))
