"""A scan of the Hugging Face model zoo: every architecture built from a tiny config (no
download), trained 3 steps with shfx at windows 1 and 2 and with eager PyTorch
(``torch.optim.AdamW(fused=True)``), same seed and data, losses and final weights compared bitwise.

    python benchmarks/hf_zoo.py                         # every architecture
    python benchmarks/hf_zoo.py --archs gpt2,bert,t5,vit
    python benchmarks/hf_zoo.py --out benchmarks/results/hf_zoo.json --markdown docs/hf_zoo.md

Each architecture runs in its own subprocess with a timeout (``--timeout``), so one crash or hang
loses only its own row. Outcomes per window:

- ``bitwise``: the 3 losses and every parameter and buffer equal to the bit to eager;
- ``refused: ...``: shfx refused before the first step (CaptureError, UsageError, PartitionError),
  with the first line of its message;
- ``fails: ...``: any other exception (a defect);
- ``differs: ...``: trained, but not bitwise (the max abs difference of losses and weights).

One ``torch.manual_seed`` before the model is built; the global RNG state is then saved and
restored before the eager run, with no reseeding between steps. Dropout is 0 in every config.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import threading
import time

V = 96  # vocabulary
B, S = 2, 8  # batch, sequence length (decoder: 6)
IMG, NUM_LABELS = 32, 3
STEPS = 3
LR, WD = 1e-2, 0.01

# the common decoder-only transformer sizes (Llama-style names)
LLAMA = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
BERT = dict(
    vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
BART = dict(
    vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
)  # fmt: skip
T5 = dict(
    vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
)  # fmt: skip
VIT = dict(
    image_size=IMG, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
NODROP_ATTN = dict(attention_dropout=0.0)

# name -> (family, model_type, config kwargs)
ARCHS: dict[str, tuple[str, str, dict]] = {
    # ---- causal LM
    "gpt2": ("causal", "gpt2", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neo": ("causal", "gpt_neo", dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                                          attention_types=[[["global", "local"], 1]], window_size=4,
                                          max_position_embeddings=64, embed_dropout=0.0,
                                          attention_dropout=0.0, resid_dropout=0.0)),
    "gptj": ("causal", "gptj", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "codegen": ("causal", "codegen", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                          n_positions=64, n_ctx=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0)),
    "llama": ("causal", "llama", dict(LLAMA)),
    "mistral": ("causal", "mistral", dict(LLAMA, head_dim=8)),
    "mixtral": ("causal", "mixtral", dict(LLAMA, head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("causal", "qwen2", dict(LLAMA)),
    "qwen2_moe": ("causal", "qwen2_moe", dict(LLAMA, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                              num_experts=4, num_experts_per_tok=2)),
    "qwen3": ("causal", "qwen3", dict(LLAMA, head_dim=8)),
    "phi": ("causal", "phi", dict(LLAMA, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("causal", "phi3", dict(LLAMA, pad_token_id=0)),
    "gemma": ("causal", "gemma", dict(LLAMA, head_dim=8)),
    "gemma2": ("causal", "gemma2", dict(LLAMA, head_dim=8, sliding_window=4)),
    "gemma3_text": ("causal", "gemma3_text", dict(LLAMA, head_dim=8, sliding_window=4)),
    "granite": ("causal", "granite", dict(LLAMA)),
    "olmo": ("causal", "olmo", dict(LLAMA)),
    "olmo2": ("causal", "olmo2", dict(LLAMA)),
    "cohere": ("causal", "cohere", dict(LLAMA)),
    "stablelm": ("causal", "stablelm", dict(LLAMA, hidden_dropout=0.0)),
    "starcoder2": ("causal", "starcoder2", dict(LLAMA, residual_dropout=0.0, embedding_dropout=0.0)),
    "persimmon": ("causal", "persimmon", dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=64, hidden_dropout=0.0)),
    "gpt_neox": ("causal", "gpt_neox", dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                            hidden_dropout=0.0)),
    "opt": ("causal", "opt", dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                  word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
                                  activation_dropout=0.0, pad_token_id=0)),
    "bloom": ("causal", "bloom", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                      hidden_dropout=0.0, attention_dropout=0.0)),
    "falcon": ("causal", "falcon", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        hidden_dropout=0.0, attention_dropout=0.0)),
    "mpt": ("causal", "mpt", dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                                  resid_pdrop=0.0, emb_pdrop=0.0)),  # attn_config.attn_pdrop: 0 by default
    "xglm": ("causal", "xglm", dict(vocab_size=V, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                    max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                    activation_dropout=0.0)),
    "biogpt": ("causal", "biogpt", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)),
    # ---- masked LM
    "bert": ("masked", "bert", dict(BERT)),
    "roberta": ("masked", "roberta", dict(BERT, pad_token_id=0)),
    "xlm-roberta": ("masked", "xlm-roberta", dict(BERT, pad_token_id=0)),
    "camembert": ("masked", "camembert", dict(BERT, pad_token_id=0)),
    "megatron-bert": ("masked", "megatron-bert", dict(BERT)),
    "roformer": ("masked", "roformer", dict(BERT, embedding_size=32)),
    "electra": ("masked", "electra", dict(BERT, embedding_size=16)),
    "albert": ("masked", "albert", dict(BERT, embedding_size=16)),
    "distilbert": ("masked", "distilbert", dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                                qa_dropout=0.0, seq_classif_dropout=0.0)),
    "deberta": ("masked", "deberta", dict(BERT)),
    "deberta-v2": ("masked", "deberta-v2", dict(BERT)),
    "modernbert": ("masked", "modernbert", dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=64, pad_token_id=0, global_attn_every_n_layers=2,
                                                local_attention=4, attention_dropout=0.0, mlp_dropout=0.0,
                                                embedding_dropout=0.0)),
    # ---- seq2seq
    "t5": ("seq2seq", "t5", dict(T5)),
    "mt5": ("seq2seq", "mt5", dict(T5)),
    "umt5": ("seq2seq", "umt5", dict(T5)),
    "bart": ("seq2seq", "bart", dict(BART)),
    "mbart": ("seq2seq", "mbart", dict(BART)),
    "plbart": ("seq2seq", "plbart", dict(BART)),
    "pegasus": ("seq2seq", "pegasus", dict(BART)),
    "marian": ("seq2seq", "marian", dict(BART, decoder_start_token_id=0, decoder_vocab_size=V)),
    "blenderbot-small": ("seq2seq", "blenderbot-small", dict(BART)),
    # ---- vision (image classification)
    "vit": ("vision", "vit", dict(VIT)),
    "deit": ("vision", "deit", dict(VIT)),
    "beit": ("vision", "beit", dict(VIT, use_mask_token=False)),
    "dinov2": ("vision", "dinov2", dict(VIT, mlp_ratio=2)),
    "swin": ("vision", "swin", dict(image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                    window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    drop_path_rate=0.0)),
    "convnext": ("vision", "convnext", dict(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], patch_size=4,
                                            image_size=IMG, drop_path_rate=0.0)),
    "convnextv2": ("vision", "convnextv2", dict(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], patch_size=4,
                                                image_size=IMG, drop_path_rate=0.0)),
    "resnet": ("vision", "resnet", dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])),
    "regnet": ("vision", "regnet", dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                        groups_width=8)),
    "mobilenet_v2": ("vision", "mobilenet_v2", dict(num_channels=3, image_size=IMG, depth_multiplier=0.35,
                                                    classifier_dropout_prob=0.0)),
    "efficientnet": ("vision", "efficientnet", dict(num_channels=3, image_size=IMG, width_coefficient=0.25,
                                                    depth_coefficient=0.25, dropout_rate=0.0,
                                                    drop_connect_rate=0.0, hidden_dim=320)),  # = the top conv's 1280 x 0.25
    "poolformer": ("vision", "poolformer", dict(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                                                patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
                                                drop_path_rate=0.0, hidden_dropout_prob=0.0)),
}  # fmt: skip

CLASS = {"deit": "DeiTForImageClassification"}  # (and DeiTForImageClassificationWithTeacher)

AUTO = {
    "causal": "AutoModelForCausalLM",
    "masked": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "vision": "AutoModelForImageClassification",
}


def build(name: str):
    import transformers

    family, model_type, kw = ARCHS[name]
    kw = dict(kw)
    if family == "vision":
        kw["num_labels"] = NUM_LABELS
    else:
        kw.setdefault("use_cache", False)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    if name in CLASS:  # the auto class maps this type to several classes and cannot choose
        return getattr(transformers, CLASS[name])(cfg).train()
    return getattr(transformers, AUTO[family]).from_config(cfg).train()


def batch(family: str, step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    if family == "vision":
        return {"pixel_values": torch.randn(B, 3, IMG, IMG, generator=g),
                "labels": torch.randint(0, NUM_LABELS, (B,), generator=g)}  # fmt: skip
    ids = torch.randint(3, V, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a padded row
    if family == "causal":
        labels = ids.masked_fill(mask == 0, -100)
    elif family == "masked":
        pick = torch.rand(B, S, generator=g) < 0.3
        pick[:, 1] = True  # at least one label per row
        pick &= mask.bool()
        labels = ids.masked_fill(~pick, -100)
        ids = ids.masked_fill(pick, 3)  # the [MASK] stand-in
    else:  # seq2seq
        labels = torch.randint(3, V, (B, 6), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_of(out):
    return out["loss"] if isinstance(out, dict) else out.loss


def first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:300]


def _report_hang(row: dict, w: int, hang_s: float) -> None:
    row[f"W={w}"] = f"fails: hang: no progress in {hang_s:.0f} s ({_stuck_threads()})"
    print("HFZOO " + json.dumps(row), flush=True)
    os._exit(0)


def _stuck_threads() -> str:
    """The innermost shfx frame of each thread, to say where a hang is."""
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        fs = [f for f in traceback.extract_stack(frame) if "/shfx/" in f.filename]
        if fs:
            f = fs[-1]
            out.append(f"{names.get(ident, ident)}: {f.filename.split('/shfx/')[-1]}:{f.lineno} {f.name}")
    return "; ".join(out)


def run_one(name: str, windows=(1, 2), hang_s: float = 0) -> dict:
    """Train ``name`` at each window with shfx and eagerly; returns {'W=1': outcome, ...}.
    With ``hang_s``, a window that takes longer is recorded as a hang and the process ends."""
    import torch

    import shfx

    family = ARCHS[name][0]
    refusals = (shfx.CaptureError, shfx.UsageError, shfx.PartitionError)
    row: dict = {"arch": name, "family": family, "model_type": ARCHS[name][1]}
    try:
        torch.manual_seed(0)
        probe = build(name)
        row["class"] = type(probe).__name__
        row["params"] = sum(p.numel() for p in probe.parameters())
        del probe
    except Exception as e:  # noqa: BLE001 - recorded
        row["unavailable"] = first_line(e)
        return row
    for w in windows:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = build(name)
        ref = copy.deepcopy(model)
        rng = torch.get_rng_state()
        stepped = False
        if hang_s:  # a hang (a deadlock) ends this process with what it has: the parent runs the rest
            watchdog = threading.Timer(hang_s, _report_hang, (row, w, hang_s))
            watchdog.daemon = True
            watchdog.start()
        try:
            cm = shfx.compile(
                model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), window=w,
                optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD),
            )  # fmt: skip
            losses = []
            for step in range(STEPS):
                loss = loss_of(cm(**batch(family, step)))
                loss.backward()
                losses.append(loss.detach().clone())
                cm.step()
                stepped = True
                cm.zero_grad()
            cm.sync()
            row["stages"] = len(cm.program.stages) if hasattr(cm, "program") else None
        except refusals as e:
            row[f"W={w}"] = ("fails: after a step: " if stepped else "refused: ") + first_line(e)
            continue
        except Exception as e:  # noqa: BLE001 - recorded
            row[f"W={w}"] = "fails: " + first_line(e)
            continue
        finally:
            if hang_s:
                watchdog.cancel()
        torch.set_rng_state(rng)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
        ref_losses = []
        try:
            for step in range(STEPS):
                loss = loss_of(ref(**batch(family, step)))
                loss.backward()
                ref_losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
        except Exception as e:  # noqa: BLE001
            row[f"W={w}"] = "fails: eager reference: " + first_line(e)
            continue
        worst, where = 0.0, []
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            if not torch.equal(a, b):
                d = (a.double() - b.double()).abs().max().item()
                worst = max(worst, d) if d == d else float("nan")
                where.append(f"loss[{i}]")
        sd, rsd = model.state_dict(), ref.state_dict()
        if sd.keys() != rsd.keys():
            where.append("state_dict keys")
        for k in sd.keys() & rsd.keys():
            if not torch.equal(sd[k], rsd[k]):
                d = (sd[k].double() - rsd[k].double()).abs().max().item() if sd[k].shape == rsd[k].shape else float("inf")
                worst = max(worst, d)
                where.append(k)
        if where:
            row[f"W={w}"] = f"differs: {worst:.3g}"
            row[f"W={w} where"] = where[:12]
        else:
            row[f"W={w}"] = "bitwise"
        row[f"W={w} s"] = round(time.perf_counter() - t0, 1)
        row["losses"] = [x.item() for x in losses]
        del cm
    return row


def run_isolated(name: str, timeout: float) -> dict:
    row = _run_child(name, timeout, "1,2")
    if row.get("W=1", "").startswith("fails: hang") and "W=2" not in row:  # its process ended at the hang
        row2 = _run_child(name, timeout, "2")
        row = row | {k: v for k, v in row2.items() if k.startswith("W=2") or k == "seconds"} | {
            "seconds": row["seconds"] + row2["seconds"]}  # fmt: skip
    return row


def _run_child(name: str, timeout: float, windows: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", name, "--timeout", str(timeout), "--windows", windows],
            capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        row = {"arch": name, "family": ARCHS[name][0], "model_type": ARCHS[name][1]}
        row["W=1"] = row["W=2"] = f"fails: timeout after {timeout:.0f} s"
        return row | {"seconds": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("HFZOO ")]
    if lines:
        row = json.loads(lines[-1][6:])
    else:
        tail = (p.stderr.strip().splitlines() or [""])[-1]
        row = {"arch": name, "family": ARCHS[name][0], "model_type": ARCHS[name][1]}
        row["W=1"] = row["W=2"] = f"fails: subprocess exit {p.returncode}: {tail[:300]}"
    return row | {"seconds": round(time.perf_counter() - t0, 1)}


def note(row: dict) -> str:
    if "unavailable" in row:
        return "not built: " + row["unavailable"]
    parts = []
    for w in (1, 2):
        if f"W={w} where" in row:
            parts.append(f"W={w} differs in " + ", ".join(row[f"W={w} where"][:4]))
    return "; ".join(parts) or row.get("class", "")


def table(rows: list[dict]) -> str:
    out = ["| architecture | family | W=1 | W=2 | note |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        w1 = r.get("W=1", "—").replace("|", "\\|")
        w2 = r.get("W=2", "—").replace("|", "\\|")
        out.append(f"| {r['arch']} | {r['family']} | {w1} | {w2} | {note(r).replace('|', '/')} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for r in rows:
        if "unavailable" in r:
            k = "unavailable"
        else:
            outs = {r.get("W=1", "").split(":")[0], r.get("W=2", "").split(":")[0]}
            k = next((o for o in ("differs", "fails", "refused") if o in outs), "bitwise")
        counts[k] = counts.get(k, 0) + 1
    return counts


def markdown(rows: list[dict], seconds: float) -> str:
    import torch
    import transformers

    c = summary(rows)
    return f"""# The Hugging Face model zoo, trained with shfx

Generated by `benchmarks/hf_zoo.py` (do not edit by hand): every architecture below is built from
a tiny config (hidden 32 or the nearest, 2 layers or stages, 4 heads, vocabulary {V}, images
{IMG}x{IMG}; no download, dropout 0), trained {STEPS} steps with shfx at windows 1 and 2 on the
emulated device, and eagerly with `torch.optim.AdamW(fused=True)` (lr {LR}, weight decay {WD}),
with one `torch.manual_seed(0)` before the model is built and the same batches; its natural loss
(causal LM, masked LM, seq2seq with labels, image classification with labels). The losses and
every parameter and buffer are compared to the bit.

- **bitwise**: losses and final weights equal to eager at W=1 and W=2;
- **refused**: shfx refused before the first step (`CaptureError`/`UsageError`/`PartitionError`,
  first line of the message; the model's weights untouched);
- **fails**: another exception (a defect); **differs**: trained, not bitwise (max abs difference).

Reproduce: `python benchmarks/hf_zoo.py --out benchmarks/results/hf_zoo.json --markdown docs/hf_zoo.md`
(torch {torch.__version__}, transformers {transformers.__version__}; {len(rows)} architectures,
{seconds / 60:.0f} min on 1 CPU thread). `tests/test_hf_zoo.py` asserts a subset (one per family)
in the default suite and the whole table with `SHFX_SLOW=1`.

Summary: {", ".join(f"{v} {k}" for k, v in sorted(c.items()))}.

{table(rows)}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", help="comma-separated names (default: all)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--markdown", help="write the table as markdown here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--windows", default="1,2", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        import warnings

        warnings.filterwarnings("ignore")
        windows = tuple(int(x) for x in a.windows.split(","))
        print("HFZOO " + json.dumps(run_one(a.one, windows, hang_s=a.timeout / 3)), flush=True)
        os._exit(0)  # threads of a hung run never finish
    names = a.archs.split(",") if a.archs else list(ARCHS)
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        sys.exit(f"unknown architectures {unknown}; known: {', '.join(ARCHS)}")
    rows, t0 = [], time.perf_counter()
    for n in names:
        r = run_isolated(n, a.timeout)
        rows.append(r)
        print(f"{n:18s} {r.get('W=1', r.get('unavailable', ''))[:70]:70s} | {r.get('W=2', '')[:70]} ({r['seconds']} s)",
              flush=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    print()
    print(table(rows))
    print(f"\n{summary(rows)}  total {seconds:.0f} s")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"seconds": round(seconds, 1), "rows": rows}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(rows, seconds))


if __name__ == "__main__":
    main()
