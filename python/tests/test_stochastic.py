"""Stochastic rounding of bf16 states (abi.h "Stochastic rounding").

The step: plain SGD on bf16 params declared `rounding stochastic`
(p -= lr * g, computed in f32, then rounded with 16 random bits). Checked:

- against the definition: the float64 reference value rounded to f32, then
  (bits + zopt_sr_bits(zopt_sr_key(seed, t, tensor, 0), slot, i)) >> 16 with
  the hash implemented again in numpy (zopt.bf16): bit-identical except
  where the kernel's f32 value and the reference's differ in the last bit
  (then within one bf16 ULP), over tensors that span several chunks;
- unbiasedness: 400k elements whose exact result lies 0.075 bf16 ULP below
  1.0 average to it within 5 sigma (round-to-nearest would be off by 130
  sigma);
- reproducibility: the same seed gives the same bits on 1 and 3 threads,
  another seed other bits; the seed round-trips through the API.
"""
import numpy as np
import pytest

import zopt
from zopt import bf16
from zopt._lib import StateKind
from zopt.describe import describe


def sr_step(steps):
    return steps.text(describe("sgd", momentum=False, layout="bf16", stochastic=("param",)))


def param_slot(step):
    return [k for k, _, _ in step.states].index(StateKind.PARAM)


def test_matches_definition(steps):
    step = sr_step(steps)
    slot = param_slot(step)
    rng = np.random.default_rng(7)
    sizes = [1000, 70001]  # the second spans two chunks of 65536
    params = [bf16.from_f32(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    grads = [np.zeros(n, np.uint16) for n in sizes]
    seed, lr = 1234567, 0.01
    opt = zopt.Optimizer(step, [(p, g) for p, g in zip(params, grads)], lr=lr,
                         weight_decay=0.0, seed=seed)
    lr32 = float(np.float32(lr))
    for t in (1, 2, 3):
        for g in grads:
            g[...] = bf16.from_f32(rng.standard_normal(g.size).astype(np.float32))
        want = []
        for ti, (p, g) in enumerate(zip(params, grads)):
            x = bf16.to_f32(p).astype(np.float64) - lr32 * bf16.to_f32(g).astype(np.float64)
            r = bf16.sr_bits(bf16.sr_key(seed, t, ti, 0), slot, np.arange(p.size, dtype=np.uint32))
            want.append(bf16.from_f32_stochastic(x.astype(np.float32), r))
        opt.step()
        for ti, (p, w) in enumerate(zip(params, want)):
            diff = np.abs(p.astype(np.int32) - w.astype(np.int32))
            assert diff.max() <= 1, f"step {t} tensor {ti}: more than 1 bf16 ULP off the definition"
            frac = np.mean(diff == 0)
            assert frac >= 0.999, f"step {t} tensor {ti}: only {frac:.4f} bit-identical"


def test_unbiased(steps):
    step = sr_step(steps)
    n = 400_000
    p = np.full(n, 0x3F80, np.uint16)      # 1.0
    g = np.full(n, 0x3F80, np.uint16)      # 1.0
    lr = 0.075 * 2.0 ** -8                 # exact result: 1 - 0.075 ulp(below 1)
    opt = zopt.Optimizer(step, [(p, g)], lr=lr, weight_decay=0.0, seed=99)
    opt.step()
    exact = 1.0 - float(np.float32(lr))
    v = bf16.to_f32(p).astype(np.float64)
    assert set(np.unique(p).tolist()) == {0x3F7F, 0x3F80}, "rounds to the two neighbours only"
    ulp = 2.0 ** -8
    q = (1.0 - exact) / ulp                # probability of rounding down
    sigma = ulp * np.sqrt(q * (1 - q) / n)
    assert abs(v.mean() - exact) <= 5 * sigma, (v.mean(), exact, sigma)
    assert abs(np.mean(p == 0x3F7F) - q) <= 5 * np.sqrt(q * (1 - q) / n)


def test_reproducible_and_thread_independent(steps):
    step = sr_step(steps)
    rng = np.random.default_rng(3)
    n = 150_001
    p0 = bf16.from_f32(rng.standard_normal(n).astype(np.float32))
    g0 = bf16.from_f32(rng.standard_normal(n).astype(np.float32))

    def run(seed, threads):
        p, g = p0.copy(), g0.copy()
        opt = zopt.Optimizer(step, [(p, g)], lr=0.003, weight_decay=0.0, seed=seed,
                             num_threads=threads)
        assert opt.seed == seed
        for _ in range(2):
            opt.step()
        return p

    a, b, c = run(5, 1), run(5, 3), run(6, 3)
    assert np.array_equal(a, b), "same seed: same bits on 1 and 3 threads"
    differ = np.mean(a != c)
    assert 0.2 < differ < 0.8, f"another seed changes the rounding of ~half the elements ({differ:.3f})"


def test_seed_out_of_range_is_masked(steps):
    opt = zopt.Optimizer(sr_step(steps), [(np.zeros(4, np.uint16), np.zeros(4, np.uint16))],
                         lr=0.1)
    assert opt.seed == 0
    opt.set_seed(2**64 + 5)
    assert opt.seed == 5


def test_checkpoint_resume_is_bit_exact(steps, tmp_path):
    """The random bits depend on (seed, step, tensor, element, slot): a run
    resumed from a checkpoint (params from the model, the same seed set
    again) continues bit for bit."""
    step = steps.text(describe("adamw", layout="bf16", stochastic=("param", "exp_avg", "exp_avg_sq")))
    rng = np.random.default_rng(11)
    n = 70_001
    p0 = bf16.from_f32(rng.standard_normal(n).astype(np.float32))
    grads = [bf16.from_f32(rng.standard_normal(n).astype(np.float32) * 0.1) for _ in range(4)]

    def make(p, g):
        return zopt.Optimizer(step, [(p, g)], lr=1e-3, weight_decay=0.01, seed=42)

    p, g = p0.copy(), np.zeros(n, np.uint16)
    straight = make(p, g)
    for k in range(4):
        g[...] = grads[k]
        straight.step()

    p2, g2 = p0.copy(), np.zeros(n, np.uint16)
    first = make(p2, g2)
    for k in range(2):
        g2[...] = grads[k]
        first.step()
    ck = str(tmp_path / "sr.ckpt")
    first.save(ck)
    p3, g3 = p2.copy(), np.zeros(n, np.uint16)  # the model's params at the checkpoint
    resumed = make(p3, g3)
    resumed.load(ck)
    for k in range(2, 4):
        g3[...] = grads[k]
        resumed.step()
    assert np.array_equal(p3, p), "resumed params differ from the straight run"
    for kind in ("exp_avg", "exp_avg_sq"):
        assert np.array_equal(resumed.read_state(0, kind), straight.read_state(0, kind)), kind
