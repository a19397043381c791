"""The parameter tier (``shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme")``): a GPT
whose parameters, gradients and AdamW states together are several times a declared host budget
trains on the emulated device and an SSD store, bitwise equal to the same run with everything
in host RAM, and its peak RSS while training stays under the budget plus a stated overhead.

Each run is its own process (its peak RSS is its own). Measured per run:

- ``base``: the RSS after ``import torch, shfx`` (the interpreter and torch's libraries), before
  the model exists;
- ``setup peak``: the peak RSS up to the end of the first step (the model as the user built it,
  laid out one group at a time and written to the SSD);
- ``training peak``: the peak RSS over the remaining steps (after the first step glibc's
  ``malloc_trim`` returns its transient heap, in both runs, and ``/proc/self/clear_refs``
  resets the high-water mark; ``VmHWM`` after the last);
- the emulated device's peak bytes (on a GPU they are device memory; here they are host RAM);
- the ledger's host bytes (``cm.variant.ledger().static("host")``), the median step, and a
  hash of the losses and the final weights (``cm.state_dict()``, read back from the SSD after
  the measurement).

The stated overhead, what the process holds beside the host memory the ledger counts, whatever
the tier: ``base``, the emulated device's peak, and what the same model's all-in-RAM run holds
beyond its base, device and ledger (``capture``: the captured graphs, the stage modules, the
interpreter's and autograd's objects, freed heap not returned), measured in that run, + 32 MiB
(the heap's slack between the two processes). The check: ``training peak <= budget + overhead``.

Usage: ``python benchmarks/param_tier.py [--layers 8 --hidden 512 --steps 20 --budget-ratio 4]``
(writes ``results/param_tier.json``). ``benchmarks/nvme.py --tier --params`` runs it too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import hashlib, json, os, sys, time
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
cfg = json.loads(sys.argv[1])
import torch, shfx
from shfx.models import GPT, GPTShape
base = status("VmRSS")
torch.manual_seed(0)
model = GPT(GPTShape(vocab=256, seq=32, layers=cfg["layers"], heads=8, hidden=cfg["hidden"], dropout=0.1))
n_params = sum(p.numel() for p in model.parameters())
off = None
auto = cfg.get("auto", False)  # window, host window and image window: the tuner's (profiled through the tier)
if cfg["tier"] == "params":
    off = shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme", path=cfg["dir"], host_window="auto" if auto else 1,
                       image_window="auto" if auto else None, host_budget=cfg["budget"], nvme_read=cfg["rate"], nvme_write=cfg["rate"])
cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="4GiB", h2d=None, d2h=None), policy=shfx.Stronghold(window="auto" if auto else 2),
                  optimizer=shfx.optim.AdamW(lr=1e-3, weight_decay=0.01), offload=off, precision=cfg["precision"], recompute="full")
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)) for _ in range(cfg["steps"])]
torch.manual_seed(123)  # once: dropout draws from the user's stream
losses, times = [], []
for i, (x, y) in enumerate(batches):
    t0 = time.perf_counter()
    loss = cm(x, y); loss.backward(); cm.step(); cm.zero_grad()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
    if i == 0:
        setup_peak = status("VmHWM")
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # (the first step's transient heap back to the OS, in both runs)
        open("/proc/self/clear_refs", "w").write("5")  # the training's high-water mark from here
train_peak = status("VmHWM")
# (the training's own: the profile and the report below allocate scratch on the device and the host)
device_peak, host_bytes = cm.backend.peak_bytes, cm._engine.host_bytes()
led = cm.variant.ledger().static("host")
import dataclasses, pickle
from shfx.cost_model.simulate import simulate
predicted = None
if cfg["tier"] == "ram":  # the profile of the model (compute, links, the host update): the same with the tier
    from shfx.profiler import profile_costs
    costs = profile_costs(cm._engine, cm.variant, list(batches[0]))
    with open(cfg["costs"], "wb") as f:
        pickle.dump(costs, f)
    predicted = simulate(cm.variant.train, costs).step_s
elif cfg["rate"] is not None:  # the tier's program with that profile and the emulated SSD's rates
    with open(cfg["costs"], "rb") as f:
        costs = pickle.load(f)
    bps = float(shfx.passes.units.parse_bandwidth(cfg["rate"]))
    costs = costs.with_links(dataclasses.replace(costs.links, ssd_read_bps=bps, ssd_write_bps=bps))
    predicted = simulate(cm.variant.train, costs).step_s
own = chosen = None
if cfg["tier"] == "params" and cfg["rate"] is not None:  # the tuner's prediction, from a profile through the tier itself
    rep = cm.report()
    t = rep.tune
    w = cm.variant.policy.window  # (the running window: a fixed window's report ranks every window)
    chosen = {"window": w, "host_window": cm.variant.train.host_window, "image_window": cm.variant.train.image_window}
    own = next((r.step_s for r in t.host_rows if (r.host_window, r.image_window) == (t.host_window, t.image_window)), None) if t.host_rows else t.row(w).step_s
out = {"predicted_own_profile_s": own, "chosen": chosen, "base": base, "setup_peak": setup_peak, "train_peak": train_peak, "device_peak": device_peak,
       "ledger_host": sum(led.values()), "host_bytes": host_bytes, "n_params": n_params,
       "step_s": times, "losses": [float.hex(v) for v in losses], "predicted_s": predicted,
       "ssd": {k: v for k, v in cm.variant.train.bytes_moved().items() if k.startswith("ssd")},
       "actions": " ".join(cm.variant.train.actions())}
h = hashlib.sha256()
for k, v in sorted(cm.state_dict().items()):
    h.update(k.encode()); h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
out["weights_sha256"] = h.hexdigest()
cm.close()
print("RESULT " + json.dumps(out))
"""

MiB = 1 << 20
SLACK = 32 * MiB


def _run(cfg: dict) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the run {cfg} failed: {r.stderr[-3000:]}")
    return json.loads(line[7:])


def state_bytes(n_params: int, precision: str) -> int:
    """Parameters, gradients and AdamW states, in bytes: fp32 image + fp32 gradient + m + v (16 B a
    parameter); mixed precision 16-bit image + fp32 master + fp32 gradient + m + v (18 B)."""
    return n_params * (16 if precision == "fp32" else 18)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget-ratio", type=float, default=4.0, help="parameters + gradients + states over the host budget")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--rate", default=None, help="emulated SSD rate of the memory runs (default: the disk's own)")
    p.add_argument("--predict-rates", default="200MB/s,100MB/s",
                   help="emulated SSD rates of the step-time runs: measured against the simulator's prediction")
    p.add_argument("--no-auto", dest="auto", action="store_false",
                   help="skip the run with the tuner's windows (window, host_window, image_window 'auto') under the budget")
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "param_tier.json"))
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shfx-param-tier-", dir=args.dir)
    out: dict = {"config": vars(args), "load_before": os.getloadavg(), "runs": []}
    costs = os.path.join(work, "costs.pkl")
    try:
        for prec in args.precisions.split(","):
            ram = _run({"tier": "ram", "precision": prec, "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
                        "dir": work, "budget": None, "rate": None, "costs": costs})  # fmt: skip
            budget = int(state_bytes(ram["n_params"], prec) / args.budget_ratio)
            tier = _run({"tier": "params", "precision": prec, "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
                         "dir": work, "budget": budget, "rate": args.rate, "costs": costs})  # fmt: skip
            timed = [_run({"tier": "params", "precision": prec, "layers": args.layers, "hidden": args.hidden, "steps": max(6, args.steps // 2),
                           "dir": work, "budget": None, "rate": rate, "costs": costs}) | {"rate": rate}
                     for rate in args.predict_rates.split(",") if rate]  # fmt: skip
            # the tuner's windows (window, host_window, image_window "auto") under the same budget, at the first rate
            timed += [_run({"tier": "params", "precision": prec, "layers": args.layers, "hidden": args.hidden, "steps": max(6, args.steps // 2),
                            "dir": work, "budget": budget, "rate": rate, "costs": costs, "auto": True}) | {"rate": rate, "auto": True}
                      for rate in args.predict_rates.split(",")[:1] if rate and args.auto]  # fmt: skip
            capture = ram["train_peak"] - ram["base"] - ram["device_peak"] - ram["ledger_host"]
            overhead = tier["base"] + tier["device_peak"] + max(capture, 0) + SLACK
            out["runs"].append({"precision": prec, "budget": budget, "host RAM": ram, "parameter tier": tier,
                                "capture": capture, "overhead": overhead, "under_budget": tier["train_peak"] <= budget + overhead,
                                "timed": timed,
                                "bitwise": ram["losses"] == tier["losses"] and ram["weights_sha256"] == tier["weights_sha256"]})  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    med = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731 - the steps after the first
    print(f"# GPT {args.layers} x {args.hidden}, {args.steps} steps, Stronghold W=2, host window 1; "
          f"budget = (parameters + gradients + AdamW states) / {args.budget_ratio:g}\n")
    print("| precision | params+grads+states | host budget | run | ledger host | base RSS | emulated device | capture | setup peak | "
          "training peak | peak - base - device - capture | median step | bitwise | under budget + overhead |")
    print("| --- " * 14 + "|")
    for r in out["runs"]:
        for name in ("host RAM", "parameter tier"):
            x = r[name]
            net = x["train_peak"] - x["base"] - x["device_peak"] - r["capture"]
            ok = r["under_budget"] if name == "parameter tier" else ""
            print(f"| {r['precision']} | {state_bytes(x['n_params'], r['precision']) / MiB:.0f} MiB | {r['budget'] / MiB:.0f} MiB | {name} "
                  f"| {x['ledger_host'] / MiB:.1f} MiB | {x['base'] / MiB:.0f} MiB | {x['device_peak'] / MiB:.0f} MiB | {r['capture'] / MiB:.0f} MiB "
                  f"| {x['setup_peak'] / MiB:.0f} MiB | {x['train_peak'] / MiB:.0f} MiB | {net / MiB:.0f} MiB "
                  f"| {med(x['step_s']) * 1e3:.0f} ms | {r['bitwise'] if name == 'parameter tier' else ''} | {ok} |")
    print("\n## step time on the emulated SSD: measured (median after the first step) vs the simulator's prediction "
          "(the tier's program and the SSD's rates, with the all-in-RAM run's profile, and with the compiled model's own "
          "profile through the tier: cm.report())\n")
    print("| precision | run | W, H, I | SSD bytes per step (r / w) | predicted (RAM profile) | predicted (own profile) | measured "
          "| measured / predicted (RAM / own) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out["runs"]:
        ram = r["host RAM"]
        print(f"| {r['precision']} | host RAM | 2 | - | {ram['predicted_s'] * 1e3:.0f} ms | - | {med(ram['step_s']) * 1e3:.0f} ms "
              f"| {med(ram['step_s']) / ram['predicted_s']:.2f} |")
        for t in r["timed"]:
            c, m, own = t["chosen"], med(t["step_s"]), t["predicted_own_profile_s"]
            run = f"parameter tier, {t['rate']}" + (", tuned under the budget" if t.get("auto") else "")
            print(f"| {r['precision']} | {run} | {c['window']}, {c['host_window']}, {c['image_window']} "
                  f"| {t['ssd']['ssd_read'] / MiB:.0f} / {t['ssd']['ssd_write'] / MiB:.0f} MiB "
                  f"| {t['predicted_s'] * 1e3:.0f} ms | {own * 1e3:.0f} ms | {m * 1e3:.0f} ms | {m / t['predicted_s']:.2f} / {m / own:.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nload average before/after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
