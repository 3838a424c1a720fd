#!/usr/bin/env python3
"""Issue 19's real-model study: a small character-level transformer trained
with each optimizer-state layout, the final validation loss of each against
f32 AdamW.

    PYTHONPATH=python /usr/bin/python3 bench/precision_study.py               # 1,000 steps x 3 seeds
    PYTHONPATH=python /usr/bin/python3 bench/precision_study.py --steps 60 --seeds 1   # test size
    ... --json out.json --plot docs/benchmarks/precision_study.png

The corpus is the license texts of /usr/share/common-licenses (the same bytes
on every Debian machine; 90 % train, the last 10 % validation). The model
(`CharTransformer`: 2 layers, d=64, 4 heads, context 64, batch 16; 0.11M
params: a tied embedding of 5,376 elements, weights of 4,096-16,384, LayerNorm
weights and biases under 4,096; small so that 21 runs of 1,000 steps fit a
2-core machine, 0.1-0.3 s a step) keeps
its weights in the layout's param dtype and computes in f32 (each weight is
read as `w.float()`), so the runs differ in what the optimizer stores, not in
the matmuls' precision; a bf16 param's gradient arrives in bf16, as in bf16
training. Every layout sees the same batches and the same initial weights
(rounded to its param dtype).

Layouts (`LAYOUTS`; each a zopt.steps.adamw call; "keep32": the precision
policy, small tensors and the embedding keep f32 moments):
  f32             f32 params, f32 moments (the reference; also checked against
                  torch.optim.AdamW on the first seed)
  bf16_sr         bf16 params rounded stochastically, f32 moments, no master
  bf16_rne        bf16 params rounded to nearest, f32 moments, no master
  remainder       bf16 params + int16 remainder (exact f32 master), f32 moments
  remainder_bf16m the same with bf16 moments (keep32)
  kahan           bf16 params with a bf16 Kahan compensation (NUMERICS §11), f32 moments
  q8_sr, q8_remainder, q8_kahan   q8 moments (keep32) with bf16-SR params / a
                  remainder master / a Kahan compensation: run when this
                  build's runtime runs q8 moments, else listed as skipped
                  with the reason.
Prints one line per run and a table of the mean final validation loss per
layout (and its ratio to f32); --json writes every run's curve.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

import zopt

LICENSES = ["GPL-3", "Apache-2.0", "GFDL-1.3", "LGPL-3", "MPL-2.0", "Artistic", "GPL-2"]
CTX, D, HEADS, LAYERS, BATCH = 64, 64, 4, 2, 16
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 1.0

BF = torch.bfloat16
LAYOUTS = {
    "f32": dict(param="f32"),
    "bf16_sr": dict(param="bf16", moments="f32", rounding="stochastic"),
    "bf16_rne": dict(param="bf16", moments="f32"),
    "remainder": dict(param="bf16", master="remainder", moments="f32"),
    "remainder_bf16m": dict(param="bf16", master="remainder", moments="bf16", keep32=True),
    "kahan": dict(param="bf16", master="kahan", moments="f32"),
    "q8_sr": dict(param="bf16", moments="q8", rounding={"param": "stochastic"}, keep32=True),
    "q8_remainder": dict(param="bf16", master="remainder", moments="q8", keep32=True),
    "q8_kahan": dict(param="bf16", master="kahan", moments="q8", keep32=True),
}


def corpus():
    parts = []
    for name in LICENSES:
        path = os.path.join("/usr/share/common-licenses", name)
        if os.path.exists(path):
            parts.append(open(path, "rb").read())
    if not parts:
        raise SystemExit("no license texts under /usr/share/common-licenses")
    data = b"\n".join(parts)
    vocab = sorted(set(data))
    lut = np.zeros(256, np.int64)
    lut[vocab] = np.arange(len(vocab))
    ids = torch.from_numpy(lut[np.frombuffer(data, np.uint8)])
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(vocab)


class CharTransformer(torch.nn.Module):
    """A pre-LN GPT block stack whose weights are read as f32 (`_w`)."""

    def __init__(self, vocab, dtype):
        super().__init__()
        P = lambda *s: torch.nn.Parameter(torch.empty(*s))  # noqa: E731
        self.tok_emb, self.pos_emb = P(vocab, D), P(CTX, D)
        self.blocks = torch.nn.ModuleList()
        for _ in range(LAYERS):
            b = torch.nn.Module()
            b.ln1_w, b.ln1_b, b.ln2_w, b.ln2_b = P(D), P(D), P(D), P(D)
            b.qkv_w, b.qkv_b, b.proj_w, b.proj_b = P(3 * D, D), P(3 * D), P(D, D), P(D)
            b.fc_w, b.fc_b, b.out_w, b.out_b = P(4 * D, D), P(4 * D), P(D, 4 * D), P(D)
            self.blocks.append(b)
        self.lnf_w, self.lnf_b = P(D), P(D)
        self.dtype = dtype

    def init(self, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if n.endswith("ln1_w") or n.endswith("ln2_w") or n == "lnf_w":
                    v = 1.0 + 0.02 * torch.randn(p.shape, generator=g)
                elif p.dim() == 1:
                    v = 0.02 * torch.randn(p.shape, generator=g)
                else:
                    v = torch.randn(p.shape, generator=g) * (0.02 if "emb" in n else p.shape[-1] ** -0.5)
                p.data = v.to(self.dtype)
        return self

    def forward(self, idx):
        f = lambda w: w.float()  # noqa: E731
        T = idx.shape[1]
        x = f(self.tok_emb)[idx] + f(self.pos_emb)[:T]
        mask = torch.full((T, T), float("-inf")).triu(1)
        for b in self.blocks:
            h = torch.nn.functional.layer_norm(x, (D,), f(b.ln1_w), f(b.ln1_b))
            q, k, v = (h @ f(b.qkv_w).t() + f(b.qkv_b)).split(D, dim=-1)
            sh = lambda t: t.view(t.shape[0], T, HEADS, D // HEADS).transpose(1, 2)  # noqa: E731
            a = (sh(q) @ sh(k).transpose(-1, -2)) * (D // HEADS) ** -0.5 + mask
            y = (a.softmax(-1) @ sh(v)).transpose(1, 2).reshape(x.shape)
            x = x + y @ f(b.proj_w).t() + f(b.proj_b)
            h = torch.nn.functional.layer_norm(x, (D,), f(b.ln2_w), f(b.ln2_b))
            h = torch.nn.functional.gelu(h @ f(b.fc_w).t() + f(b.fc_b))
            x = x + h @ f(b.out_w).t() + f(b.out_b)
        x = torch.nn.functional.layer_norm(x, (D,), f(self.lnf_w), f(self.lnf_b))
        return x @ f(self.tok_emb).t()  # tied output embedding


def batches(train, steps, seed):
    g = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        i = torch.randint(0, len(train) - CTX - 1, (BATCH,), generator=g)
        yield torch.stack([train[j:j + CTX] for j in i]), torch.stack([train[j + 1:j + CTX + 1] for j in i])


@torch.no_grad()
def val_loss(model, val, n=8):
    g = torch.Generator().manual_seed(99)
    i = torch.randint(0, len(val) - CTX - 1, (n * BATCH,), generator=g)
    x = torch.stack([val[j:j + CTX] for j in i])
    y = torch.stack([val[j + 1:j + CTX + 1] for j in i])
    tot = 0.0
    for k in range(n):
        s = slice(k * BATCH, (k + 1) * BATCH)
        lg = model(x[s])
        tot += float(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), y[s].reshape(-1)))
    return tot / n


def make_opt(layout, model):
    kw = dict(LAYOUTS[layout])
    keep = kw.pop("keep32", False)
    if keep:
        kw["keep32"] = dict(below=4096, names=["tok_emb", "pos_emb"])
    step = zopt.steps.adamw(clip=CLIP, betas=BETAS, eps=EPS, **kw)
    return zopt.Optimizer(step, model.named_parameters(), lr=LR, weight_decay=WD, seed=1234)


def available(layout):
    """None, or why this build cannot run the layout."""
    kw = dict(LAYOUTS[layout])
    kw.pop("keep32", None)
    try:
        st = zopt.steps.adamw(clip=CLIP, **kw)
        zopt.Optimizer(st, [torch.nn.Parameter(torch.ones(4096, dtype=BF if kw["param"] == "bf16" else None))]).close()
    except (zopt.ZoptError, ValueError, TypeError) as e:
        return str(e).splitlines()[0][:160]
    return None


def run(layout, seed, steps, train, val, vocab, every):
    dtype = torch.float32 if LAYOUTS[layout]["param"] == "f32" else BF
    model = CharTransformer(vocab, dtype).init(seed)
    opt = make_opt(layout, model)
    curve, t0 = [], time.time()
    for it, (x, y) in enumerate(batches(train, steps, seed)):
        for g in opt.param_groups:  # warm-up then cosine
            g["lr"] = LR * min(1.0, (it + 1) / 50) * 0.5 * (1 + math.cos(math.pi * it / steps))
        lg = model(x)
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (it + 1) % every == 0 or it + 1 == steps:
            curve.append((it + 1, float(loss), val_loss(model, val)))
    opt.close()
    return dict(layout=layout, seed=seed, steps=steps, curve=curve, final_val=curve[-1][2],
                seconds=time.time() - t0)


def plot(runs, path):
    """The validation curves of every run (a color per layout), whole and
    from step 500 on."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, lo in zip(axes, (0, 500)):
        for i, layout in enumerate(layouts):
            for r in (r for r in runs if r["layout"] == layout):
                pts = [(x, v) for x, _, v in r["curve"] if x >= lo]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", alpha=0.85,
                        lw=1.2, label=layout if r["seed"] == 0 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/char)")
    seeds = len({r["seed"] for r in runs})
    axes[0].set_title(f"char transformer, {seeds} seeds per layout")
    axes[1].set_title("from step 500")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--every", type=int, default=100, help="validation every N steps")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--from", dest="from_json", nargs="+",
                    help="no training: plot (--plot) the runs of these --json files")
    a = ap.parse_args(argv)
    if a.from_json:
        runs = [r for f in a.from_json for r in json.load(open(f))["runs"]]
        plot(runs, a.plot)
        return {r["layout"]: r["final_val"] for r in runs}
    train, val, vocab = corpus()
    torch.manual_seed(0)
    print(f"# corpus {len(train) + len(val)} bytes, vocab {vocab}; model "
          f"{sum(p.numel() for p in CharTransformer(vocab, torch.float32).parameters())} params; "
          f"{a.steps} steps x {a.seeds} seeds; torch {torch.__version__}")
    runs, skipped = [], {}
    for layout in a.layouts.split(","):
        why = available(layout)
        if why:
            skipped[layout] = why
            print(f"{layout:16s} skipped: {why}")
            continue
        for seed in range(a.seeds):
            r = run(layout, seed, a.steps, train, val, vocab, a.every)
            runs.append(r)
            print(f"{layout:16s} seed {seed}: final val {r['final_val']:.4f}  ({r['seconds']:.0f} s)", flush=True)
    ref = [r["final_val"] for r in runs if r["layout"] == "f32"]
    print("\n| layout | final val loss (mean of seeds) | each seed | / f32 |")
    print("|---|---|---|---|")
    table = {}
    for layout in dict.fromkeys(r["layout"] for r in runs):
        v = [r["final_val"] for r in runs if r["layout"] == layout]
        m = sum(v) / len(v)
        ratio = m / (sum(ref) / len(ref)) if ref else float("nan")
        table[layout] = dict(mean=m, seeds=v, ratio=ratio)
        print(f"| {layout} | {m:.4f} | {', '.join(f'{x:.4f}' for x in v)} | {ratio:.4f} |")
    for layout, why in skipped.items():
        print(f"| {layout} | skipped: {why} | | |")
    if a.json:
        json.dump(dict(runs=runs, table=table, skipped=skipped, steps=a.steps), open(a.json, "w"), indent=1)
    if a.plot:
        plot(runs, a.plot)
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
