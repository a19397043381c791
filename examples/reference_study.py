"""STRONGHOLD's artifact setup, predicted three ways: analytic costs + simulator, and closed forms.

    python examples/reference_study.py

The setup of ../shared/REFERENCE.md: GPT with hidden 2048, 16 heads, sequence 1024, micro-batch 4,
fp32, vocabulary 50304, on the V100-32GB-PCIe3 profile with 90 GB of host RAM. Stage specs and
costs come from :func:`shfx.cost_model.analytic.plan_inputs` (the model is built on the meta device
and captured with two blocks, then repeated: :class:`shfx.cost_model.depth.DepthModel`), the step from
:func:`shfx.passes.schedule.schedule_window` + :func:`shfx.cost_model.simulate.simulate`, and next to it the
formulas of :mod:`shfx.cost_model.formulas`.

Prints (i) iteration time vs layers at a fixed window, (ii) iteration time vs window at a fixed
size (also over a pageable-memory link, where the window matters more), (iii) the largest
trainable layer count and the smallest hiding window, each cross-checked with the simulator,
(iv) where the memory model spends bytes it need not, and (v) mixed precision on every hardware
profile: fp32, bf16 and fp16 (with the step journal's rollback copies, as ``shfx.compile``
keeps them in fp16) side by side: the largest model per policy (the capacity planner), the
simulated stronghold step and the bytes it moves over the link. Writes CSVs under examples/out/
(and PNG plots if matplotlib is installed). ``--only-precision`` prints (v) alone.
"""

from __future__ import annotations

import csv
import time
from dataclasses import replace
from pathlib import Path

import sympy as sp
import torch

from shfx.cost_model import formulas as fm
from shfx.cost_model.analytic import links_of
from shfx.cost_model.depth import DepthModel
from shfx.cost_model.hardware import PROFILES, get_profile
from shfx.cost_model.planner import plan
from shfx.cost_model.shapes import short_precision
from shfx.cost_model.simulate import simulate
from shfx.models.gpt import GPT, GPTShape
from shfx.passes.policies import policy_names, policy_program

H, A, S, B, V = 2048, 16, 1024, 4, 50304
PROFILE = "V100-32GB-PCIe3"
HOST_BYTES_GB = 90e9  # "90 GB host RAM" (the profile says 90 GiB; both are reported)
WINDOW = 4  # fixed window for the layer sweep
FIXED_LAYERS = 48  # fixed size for the window sweep
OUT = Path(__file__).resolve().parent / "out"
GB, GiB = 1e9, 2**30


def build(n: int) -> GPT:
    return GPT(GPTShape(vocab=V, seq=S, layers=n, heads=A, hidden=H))


def inputs() -> tuple:
    idx = torch.zeros(B, S, dtype=torch.long)
    return idx, idx


def Model(hw, precision: str = "float32") -> DepthModel:
    """Specs and costs for any layer count from one capture (plan_inputs + repeat_blocks), in
    ``precision`` (fp16: its simulated steps pay the step journal's rollback copies)."""
    return DepthModel(build, inputs, blocks="transformer.h", hardware=hw, precision=precision)


PRECISIONS = ("float32", "bfloat16", "float16")


def precision_study() -> list[list]:
    """(v) fp32, bf16 and fp16 on every hardware profile: the largest model per policy, and at
    FIXED_LAYERS the simulated stronghold step (W=WINDOW) and the bytes it moves each way."""
    policies = policy_names()
    rows = []
    for name in PROFILES:
        hw = get_profile(name)
        for prec in PRECISIONS:
            family = GPTShape(vocab=V, seq=S, heads=A, hidden=H, batch=B, precision=prec)
            largest = {r.policy: r for r in plan(family, hw).rows}
            specs, costs = Model(hw, prec).at(FIXED_LAYERS)
            prog = policy_program("stronghold", specs, WINDOW, 0)
            tl = simulate(prog, costs, rollback=family.rollback_default)
            moved = prog.bytes_moved()
            host = tl.by_resource.get("host optimizer", 0.0) / tl.step_s
            rows.append([
                name, short_precision(prec) + ("+rb" if family.rollback_default else ""), f"{hw.matmul_flops(prec) / 1e12:g}",
                *(largest[p].layers for p in policies), largest["stronghold"].binding,
                f"{tl.step_s:.3f}", tl.bottleneck, round(100 * host), f"{moved['h2d'] / GiB:.1f}", f"{moved['d2h'] / GiB:.1f}",
            ])
    return rows


def print_precision_study() -> list[list]:
    rows = precision_study()
    hdr = ["profile", "precision", "TFLOP/s", *(f"largest {p}" for p in policy_names()), "stronghold limited by",
           f"step s ({FIXED_LAYERS}L W={WINDOW})", "bound", "host opt %", "h2d GiB", "d2h GiB"]
    print(fmt_table(hdr, rows, f"(v) Mixed precision on each profile: largest layers per policy (window 2, the planner's "
                               f"default), and one stronghold step at {FIXED_LAYERS} layers, W={WINDOW} "
                               "(fp16+rb: with the step journal's rollback copies, fp16's default)"))
    print("  bf16/fp16: 16-bit working copy and gradients on the device, fp32 master, gradients and AdamW m, v on the host "
          "(plus the 16-bit image prefetches send); V100 runs bf16 matmuls at its fp32 rate (no bf16 tensor cores).")
    write_csv("reference_precision.csv", hdr, rows)
    return rows


def fmt_table(headers: list[str], rows: list[list], title: str) -> str:
    cells = [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_csv(name: str, headers: list[str], rows: list[list]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(headers)
        w.writerows(rows)
    return path


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    resid = max(abs(y - (icpt + slope * x)) / y for x, y in zip(xs, ys))
    return slope, icpt, resid


def print_formulas() -> None:
    """The closed forms used below, as sympy prints them."""
    sym = fm.gpt_stage_times(None)  # FLOPs and bytes over symbolic hardware rates
    F, Bdev, lat, h2d, d2h, host = fm.HW_SYMBOLS
    lines = [
        ("params", fm.params_total()),
        ("slot bytes", fm.slot_bytes()),
        ("device peak (simulator)", fm.device_memory(counted_by="simulator")),
        ("device peak (GPU)", fm.device_memory(counted_by="gpu")),
        ("host bytes", fm.host_memory()),
        ("block t_f", sym["block"].f),
        ("block t_pf", sym["block"].pf),
        ("block t_u", sym["block"].u),
        ("T_F (n identical stages)", fm.forward_time()),
        ("T_B (n identical stages)", fm.backward_time()),
        ("T (GPT, readable form)", fm.step_time_gpt_steady()),
        ("smallest hiding W", fm.smallest_hiding_window()),
    ]
    print(f"Formulas (shfx.cost_model.formulas; hardware symbols {', '.join(map(str, fm.HW_SYMBOLS))})")
    for name, expr in lines:
        print(f"  {name:26s} = {expr}")
    print()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only-precision", action="store_true", help="print (v), mixed precision per profile, only")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.only_precision:
        print_precision_study()
        print(f"\nCSV files in {OUT}; {time.perf_counter() - t0:.1f} s")
        return
    hw = get_profile(PROFILE)
    print(hw.describe())
    print(f"GPT h={H} heads={A} seq={S} batch={B} vocab={V}, fp32; host RAM {HOST_BYTES_GB / GB:.0f} GB\n")
    model = Model(hw)

    # ---- stage costs: analytic (captured graph) vs formulas --------------------------------
    st = fm.gpt_stage_times(hw, H, S, B, V)  # attention included, as the analytic model counts it
    st_attn = fm.gpt_stage_times(hw, H, S, B, V, attention_flops=False)
    specs8, table8 = model.at(8)
    idx = {"head": 0, "block": 1, "tail": len(specs8) - 1}
    rows = []
    for kind, i in idx.items():
        c, sp_ = table8.costs[i], specs8[i]
        x = st[kind]
        rows.append([
            kind, sp_.slot_bytes / 1e6, float(fm.FP32 * fm.stage_param_counts(H, S, V)[kind]["slot"]) / 1e6,
            c.forward_s * 1e3, float(x.f) * 1e3, float(st_attn[kind].f) * 1e3, c.backward_s * 1e3,
            table8.links.time_s("h2d", sp_.prefetch_bytes) * 1e3, float(x.pf) * 1e3,
            table8.links.time_s("d2h", sp_.grad_bytes) * 1e3, c.update_s * 1e3, float(x.u) * 1e3,
        ])
    hdr = ["stage", "slot MB", "formula MB", "t_f ms", "formula", "no attn", "t_b ms", "t_pf ms", "formula",
           "t_og ms", "t_u ms", "formula"]
    print(fmt_table(hdr, rows, "Per-stage costs: plan_inputs (analytic) vs formulas"))
    blk = st["block"]
    print(f"  (attention scores and values, 4bs^2h = {float(4 * B * S * S * H) / 1e9:.1f} GFLOP per block forward, "
          f"are {100 * (1 - float(st_attn['block'].f) / float(blk.f)):.1f}% of a block's time)\n")
    write_csv("reference_stages.csv", hdr, rows)

    def formula_T(layers, window, stage_times=st, duplex=1):
        return float(fm.step_time_gpt(layers, window, stage_times["head"], stage_times["block"], stage_times["tail"], duplex=duplex))

    def steady_T(layers, window, stage_times=st):
        return float(fm.step_time_gpt_steady(layers, window, stage_times["head"], stage_times["block"], stage_times["tail"]))

    print_formulas()

    # ---- (i) iteration time vs layers ----------------------------------------------------------
    rows = []
    xs, ys = [], []
    for L in range(8, 129, 8):
        tl = model.simulate(L, window=WINDOW)
        T_f = formula_T(L, WINDOW)
        flops = float(fm.flops_per_iteration(L, H, S, B, V))
        dev_sim = float(fm.device_memory(WINDOW, L, H, A, S, B, V, counted_by="simulator"))
        dev_gpu = float(fm.device_memory(WINDOW, L, H, A, S, B, V, counted_by="gpu"))
        host = float(fm.host_memory(L, H, S, V))
        rows.append([L, tl.step_s, T_f, steady_T(L, WINDOW), 100 * (T_f / tl.step_s - 1), flops / tl.step_s / 1e12,
                     tl.bottleneck, tl.peak_device_bytes / GiB, dev_sim / GiB, dev_gpu / GiB, host / GB])
        xs.append(L)
        ys.append(tl.step_s)
    hdr = ["layers", "sim s", "formula s", "steady s", "err %", "TFLOP/s", "bound", "sim dev GiB", "formula GiB",
           "GPU GiB", "host GB"]
    print(fmt_table(hdr, rows, f"(i) Iteration time vs layers, W={WINDOW}"))
    slope, icpt, resid = linear_fit(xs, ys)
    per_layer = float(sp.Max(blk.f, blk.pf, (blk.f + blk.pf) / WINDOW)
                      + sp.Max(blk.b, blk.og, blk.pf, blk.u, (blk.b + blk.og + blk.pf) / WINDOW))
    print(f"  linear fit: T = {icpt:.4f} s + {slope * 1e3:.3f} ms x layers (max residual {100 * resid:.3f}%); "
          f"formula slope max(t_f,t_pf,(t_f+t_pf)/W) + max(t_b,t_og,t_pf,t_u,(t_b+t_og+t_pf)/W) = {per_layer * 1e3:.3f} ms\n")
    write_csv("reference_layers.csv", hdr, rows)

    # ---- (ii) iteration time vs window ---------------------------------------------------------
    pageable = replace(links_of(hw), h2d_bps=0.4 * hw.h2d_bps, d2h_bps=0.4 * hw.d2h_bps)
    hw_pg = replace(hw, h2d_bps=pageable.h2d_bps, d2h_bps=pageable.d2h_bps)
    st_pg = fm.gpt_stage_times(hw_pg, H, S, B, V)
    rows = []
    resident = {}
    for name, links in (("pinned", None), ("pageable", pageable)):
        resident[name] = model.simulate(FIXED_LAYERS, window=FIXED_LAYERS + 2, links=links).step_s
    for Wn in range(1, 17):
        tl = model.simulate(FIXED_LAYERS, window=Wn)
        tl_pg = model.simulate(FIXED_LAYERS, window=Wn, links=pageable)
        rows.append([
            Wn, tl.step_s, formula_T(FIXED_LAYERS, Wn), tl.bottleneck, tl.peak_device_bytes / GiB,
            tl_pg.step_s, formula_T(FIXED_LAYERS, Wn, st_pg), formula_T(FIXED_LAYERS, Wn, st_pg, duplex=hw.duplex),
            tl_pg.bottleneck,
        ])
    hdr = ["W", "sim s", "formula s", "bound", "sim dev GiB", "pageable sim", "formula", "pessim.", "bound"]
    print(fmt_table(hdr, rows, f"(ii) Iteration time vs window, {FIXED_LAYERS} layers "
                               f"(pinned 12 GB/s; pageable = 40% of pinned, 4.8 GB/s)"))
    print(f"  all resident (W={FIXED_LAYERS + 2}): pinned {resident['pinned']:.4f} s, pageable {resident['pageable']:.4f} s\n")
    write_csv("reference_window.csv", hdr, rows)
    window_rows = rows

    # ---- (iii) largest model and smallest hiding window ------------------------------------------
    print("(iii) Largest trainable model and smallest hiding window")
    host_caps = {"90 GB": HOST_BYTES_GB, "90 GiB (profile)": hw.host_memory_bytes}
    summary = []
    for counted in ("simulator", "emulated", "gpu"):
        for host_name, host_cap in host_caps.items():
            fit = fm.largest_layers(WINDOW, H, A, S, B, V, hw.device_memory_bytes, host_cap, counted_by=counted)
            summary.append([counted, host_name, fit.layers, fit.binding, fit.by_constraint["device"], fit.by_constraint["host"]])
    print(fmt_table(["device counted by", "host", "largest l", "binds", "device alone", "host alone"], summary,
                    f"  largest_layers (W={WINDOW}, device {hw.device_memory_bytes / GiB:.0f} GiB)"))
    write_csv("reference_largest.csv", ["counted_by", "host", "largest_layers", "binding", "device_alone", "host_alone"], summary)
    fit = fm.largest_layers(WINDOW, H, A, S, B, V, hw.device_memory_bytes, HOST_BYTES_GB, counted_by="gpu")
    L = fit.layers
    cfg = GPTShape(vocab=V, seq=S, layers=L, heads=A, hidden=H)
    P = cfg.num_params()
    host_need = 16 * P + 4 * V * H
    host_next = 16 * GPTShape(vocab=V, seq=S, layers=L + 1, heads=A, hidden=H).num_params() + 4 * V * H
    print(f"  cross-check, host: l={L}: {P / 1e9:.3f} G params (GPTShape.num_params), 16 B/param + 4Vh = "
          f"{host_need / GB:.2f} GB <= {HOST_BYTES_GB / GB:.0f} GB < {host_next / GB:.2f} GB at l={L + 1}")
    extra_gpu = float(fm.device_memory(WINDOW, L, H, A, S, B, V, counted_by="gpu")
                      - fm.device_memory(WINDOW, L, H, A, S, B, V, counted_by="simulator"))
    tl = model.simulate(L, window=WINDOW)
    print(f"  cross-check, device at l={L}: simulated peak {tl.peak_device_bytes / GiB:.2f} GiB "
          f"(formula {float(fm.device_memory(WINDOW, L, H, A, S, B, V, counted_by='simulator')) / GiB:.2f}) "
          f"+ GPU-only terms {extra_gpu / GiB:.2f} GiB = {(tl.peak_device_bytes + extra_gpu) / GiB:.2f} GiB of "
          f"{hw.device_memory_bytes / GiB:.0f} GiB")
    Ld = fit.by_constraint["device"]
    pk = [model.simulate(x, window=WINDOW).peak_device_bytes + extra_gpu for x in (Ld, Ld + 1)]
    print(f"  cross-check, device alone: simulated peak + GPU-only terms at l={Ld}: {pk[0] / GiB:.3f} GiB, "
          f"l={Ld + 1}: {pk[1] / GiB:.3f} GiB (capacity {hw.device_memory_bytes / GiB:.0f} GiB)")

    for name, stimes in (("pinned", st), ("pageable", st_pg)):
        b_ = stimes["block"]
        hw_u = fm.smallest_hiding_window(b_.f, b_.b, b_.pf, b_.og, b_.u)
        hw_g = fm.gpt_hiding_window(stimes["head"], b_, stimes["tail"])
        col = 1 if name == "pinned" else 5
        T_res = resident[name]
        sim_w1 = next(r[0] for r in window_rows if r[col] <= T_res * 1.01)
        sim_w0 = next((r[0] for r in window_rows if r[col] <= T_res * (1 + 1e-9)), None)
        print(f"  {name:8s}: blocks alone W >= 1 + max(t_pf/t_f, (t_og+t_pf)/t_b) = 1 + max("
              f"{float(b_.pf / b_.f):.3f}, {float((b_.og + b_.pf) / b_.b):.3f}) -> W={int(hw_u)} "
              f"(hideable: {hw_u.hideable}); with the head's and tail's copies W={int(hw_g)} ({hw_g.binding}). "
              f"Simulator: smallest W within 1% of all-resident = {sim_w1}, equal to it = {sim_w0}")
    print()

    # ---- (iv) what the memory model spends -------------------------------------------------------
    print("(iv) Where device and host bytes go (reference setup)")
    counts = fm.stage_param_counts(H, S, V)
    slot = float(fm.slot_bytes(H, S, V))
    block_b = float(fm.FP32 * counts["block"]["slot"])
    act = float(fm.activation_bytes(B, S, H))
    pool = float(fm.slot_pool_bytes(WINDOW, FIXED_LAYERS, H, S, V))
    print(f"  slots: each sized to the largest stage it holds (stage i in slot i mod W): head {slot / 1e6:.1f} MB, "
          f"tail {float(fm.FP32 * counts['tail']['slot']) / 1e6:.1f} MB, block {block_b / 1e6:.1f} MB; at W={WINDOW}, "
          f"{FIXED_LAYERS} layers the pool is {pool / GB:.2f} GB (head + tail + {WINDOW - 2} blocks) where {WINDOW} "
          f"embedding-sized slots would be {WINDOW * slot / GB:.2f} GB and {WINDOW} block-sized ones {WINDOW * block_b / GB:.2f} GB")
    tied = float(fm.FP32 * V * H)
    print(f"  the tail borrows the tied embedding: its slot holds a {tied / 1e6:.0f} MB copy, prefetched and its gradient "
          f"copied back every step: {2 * tied / GB:.2f} GB more over PCIe per step ({2 * tied / hw.h2d_bps * 1e3:.0f} ms of link), "
          f"plus a {tied / 1e6:.0f} MB pending-gradient buffer on the host; the tail's prefetch ({float(st['tail'].pf) * 1e3:.1f} ms) "
          + (f"exceeds a block's forward ({float(blk.f) * 1e3:.1f} ms), so the GPT needs one more window than its blocks"
             if float(st["tail"].pf) > float(blk.f)
             else f"is within a block's forward ({float(blk.f) * 1e3:.1f} ms), so it hides at the blocks' window"))
    specs48, table48 = model.at(FIXED_LAYERS)
    tlw = model.simulate(FIXED_LAYERS, window=WINDOW)
    compute = sum(c.forward_s + c.backward_s for c in table48.costs) - table48.costs[-1].forward_s
    hd = st["head"]
    print(f"  cold start every step: {1e3 * (tlw.step_s - compute):.0f} ms of the step is not compute "
          f"({FIXED_LAYERS} layers, W={WINDOW}: {tlw.step_s:.3f} s for {compute:.3f} s of compute, "
          f"{100 * (tlw.step_s / compute - 1):.1f}%): PF(head) {float(hd.pf) * 1e3:.1f} ms then PF(block 0) "
          f"{float(blk.pf) * 1e3:.1f} ms before the first block can run, and after the first block's backward "
          f"OG(block 0) {float(blk.og) * 1e3:.1f} ms, OG(head) {float(hd.og) * 1e3:.1f} ms, U(head) {float(hd.u) * 1e3:.1f} ms "
          f"(the ends of step_time_gpt_steady); keeping the head resident with its optimizer state on the "
          f"device (as STRONGHOLD does) would save up to {float(hd.pf + hd.og + hd.u) * 1e3:.0f} ms per step")
    ws = {t.name: float(t.expr) for t in fm.device_memory_terms(WINDOW, FIXED_LAYERS, H, A, S, B, V)}
    block_ws = float(2 * S * B * H * (34 + 5 * A * S / H))
    print(f"  GPU workspace: the tail's fp32 logits (logits, log-softmax, gradient: 3 x 4bsV = {ws['workspace'] / GB:.2f} GB) "
          f"exceed a block's recompute ({block_ws / GB:.2f} GB with attention scores, "
          f"{2 * S * B * H * 34 / GB:.2f} GB without); chunking the cross-entropy would cut it to the block's")
    host48 = {t.name: float(t.expr) for t in fm.host_memory_terms(FIXED_LAYERS, H, S, V)}
    fitg = fm.largest_layers(WINDOW, H, A, S, B, V, hw.device_memory_bytes, HOST_BYTES_GB, counted_by="gpu")
    dev_at = float(fm.device_memory(WINDOW, fitg.layers, H, A, S, B, V, counted_by="gpu"))
    print(f"  host: 16 B/param, all pinned ({sum(host48[k] for k in ('params', 'grads', 'adam_m', 'adam_v')) / GB:.1f} GB "
          f"at {FIXED_LAYERS} layers); the host binds at l={fitg.layers} while the device alone allows "
          f"l={fitg.by_constraint['device']}: at l={fitg.layers} the GPU holds {dev_at / GiB:.1f} of "
          f"{hw.device_memory_bytes / GiB:.0f} GiB ({100 * dev_at / hw.device_memory_bytes:.0f}%); the optimizer states "
          f"(8 B/param) are {8 * fm.evaluate(fm.params_total(), l=fitg.layers, h=H, s=S, V=V) / GB:.0f} GB of the host's 90")
    print()

    # ---- (v) mixed precision on every profile ----------------------------------------------------
    print_precision_study()

    # ---- plots -----------------------------------------------------------------------------------
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib is not installed: no plots)")
    else:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot(xs, ys, "o-", label="simulator")
        ax[0].set(xlabel="layers", ylabel="iteration s", title=f"W={WINDOW}")
        ax[1].plot([r[0] for r in window_rows], [r[1] for r in window_rows], "o-", label="pinned")
        ax[1].plot([r[0] for r in window_rows], [r[5] for r in window_rows], "s-", label="pageable")
        ax[1].set(xlabel="window", ylabel="iteration s", title=f"{FIXED_LAYERS} layers")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(OUT / "reference_study.png", dpi=120)
        print(f"\nplot: {OUT / 'reference_study.png'}")
    print(f"\nCSV files in {OUT}; {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
