"""The Python front end: torch tensors, param_groups, bf16 numpy vs torch,
bad inputs (-> ZoptError), the examples."""
import glob
import math
import os

import numpy as np
import pytest
import torch

import zopt
from zopt import bf16
from zopt.describe import describe
from oracles.reference import Reference

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.mlir")))

EXPECTED_STATES = {
    "adamw_f32": ["param:f32", "grad:f32", "exp_avg:f32", "exp_avg_sq:f32"],
    "adam_amsgrad_f32": ["param:f32", "grad:f32", "exp_avg:f32", "exp_avg_sq:f32",
                         "max_exp_avg_sq:f32"],
    "adamw_bf16_master": ["param:bf16", "grad:bf16", "master:f32", "exp_avg:f32",
                          "exp_avg_sq:f32"],
    "lion_bf16": ["param:bf16", "grad:bf16", "master:f32", "exp_avg:bf16"],
    "sgd_nesterov_f32": ["param:f32", "grad:f32", "momentum_buffer:f32"],
    # q8 moments (abi.h "q8 moments"): codes and a per-block absmax each
    "adamw_bf16_q8": ["param:bf16", "grad:bf16", "master:i16", "exp_avg:q8", "exp_avg_sq:q8",
                      "exp_avg_absmax:f32", "exp_avg_sq_absmax:f32"],
}


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_examples_compile_and_load(steps, path):
    name = os.path.splitext(os.path.basename(path))[0]
    step = steps.text(open(path).read())
    assert step.name == name
    got = [f"{zopt._lib.STATE_NAMES[k]}:{zopt._lib.DTYPE_NAMES[d]}"
           for k, d, _ in step.states]
    if name in EXPECTED_STATES:
        assert sorted(got) == sorted(EXPECTED_STATES[name])
    assert "lr" in step.hypers
    text = open(path).read()
    if "clip_by_global_norm" in text:
        assert step.clipped and step.max_norm == 1.0
    if "zopt.unscale" in text:
        assert step.loss_scaled


def test_compile_path_and_error():
    path = os.path.join(REPO, "examples", "adamw_f32.mlir")
    so = zopt.compile(path)
    assert os.path.exists(so)
    with pytest.raises(zopt.ZoptError) as e:
        zopt.compile("zopt.step @broken {\n  %p = zopt.state param : f64 on cpu\n}\n")
    assert "zopt-compile failed" in e.value.message and len(e.value.message) > 40


def test_torch_model_params_and_zero_grads(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 1))
    ref_model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 1))
    ref_model.load_state_dict(model.state_dict())
    step = steps(rule="adamw", layout="f32")
    opt = zopt.Optimizer(step, model.parameters(), lr=0.01, weight_decay=0.05)
    topt = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.05,
                             foreach=False)
    assert all(p.grad is None for p in model.parameters())  # never allocated
    x = torch.randn(32, 7)
    y = torch.randn(32, 1)
    for it in range(5):
        for m, o in ((model, opt), (ref_model, topt)):
            o.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
    # Like torch: params whose grad is None are left alone.
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_param_groups_mutation_is_pushed(steps):
    step = steps(rule="adamw", layout="f32")
    a = np.ones(4, np.float32)
    ga = np.full(4, 0.5, np.float32)
    b = np.ones(3, np.float32)
    gb = np.full(3, 0.5, np.float32)
    opt = zopt.Optimizer(step, [dict(params=[(a, ga)], lr=0.1),
                                dict(params=[(b, gb)], lr=0.2, betas=(0.8, 0.9),
                                     bias_correction=False)])
    assert opt.param_groups[1]["betas"] == pytest.approx((0.8, 0.9))
    assert opt.param_groups[1]["bias_correction"] is False
    assert opt.param_groups[0]["bias_correction"] is True
    assert opt.param_groups[0]["params"][0] is a and opt.param_groups[1]["params"][0] is b
    opt.param_groups[0]["lr"] = 0.05
    opt.param_groups[1]["betas"] = (0.7, 0.95)
    opt.param_groups[1]["weight_decay"] = 0.3
    opt.step()
    assert opt.get_hyper(0, "lr") == 0.05
    assert opt.get_hyper(1, "beta1") == 0.7 and opt.get_hyper(1, "beta2") == 0.95
    assert opt.get_hyper(1, "weight_decay") == 0.3
    # value check of the first step with the pushed hypers
    ref = Reference("adamw", [dict(params=[np.ones(4)], lr=0.05),
                              dict(params=[np.ones(3)], lr=0.2, betas=(0.7, 0.95),
                                   weight_decay=0.3, bias_correction=False)])
    ref.step([ga, gb])
    np.testing.assert_allclose(a, ref.param(0), rtol=1e-6)
    np.testing.assert_allclose(b, ref.param(1), rtol=1e-6)


def test_bf16_numpy_and_torch_agree(steps):
    step = steps(rule="adamw", layout="bf16_master")
    rng = np.random.default_rng(5)
    p32 = rng.standard_normal(1000).astype(np.float32)
    gs = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    pn = bf16.from_f32(p32)
    gn = np.zeros_like(pn)
    opt_n = zopt.Optimizer(step, [(pn, gn)], lr=0.01, weight_decay=0.01)
    pt = torch.from_numpy(p32).to(torch.bfloat16).requires_grad_(True)
    opt_t = zopt.Optimizer(step, [pt], lr=0.01, weight_decay=0.01)
    for g in gs:
        gn[...] = bf16.from_f32(g)
        pt.grad = torch.from_numpy(g).to(torch.bfloat16)
        opt_n.step()
        opt_t.step()
    assert pt.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        pt.detach().view(torch.int16).numpy().view(np.uint16), pn)
    np.testing.assert_array_equal(opt_n.read_state(0, "master"),
                                  opt_t.read_state(0, "master"))


def test_zero3_numpy_pairs_match_zero0(steps):
    """ZeRO-3 over numpy (param, grad) pairs at one rank: every step gathers
    the full params back into the user's arrays (it used to crash there,
    reading a numpy array's address as a torch tensor's data_ptr()), bit for
    bit the ZeRO-0 step's params and states, several steps."""
    z0, z3 = steps(rule="adamw"), steps(rule="adamw", attributes={"zero_stage": 3})
    rng = np.random.default_rng(11)
    sizes = (1000, 37, 5000)
    p0 = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    pairs = {s: [(p.copy(), np.zeros_like(p)) for p in p0] for s in ("z0", "z3")}
    opts = {"z0": zopt.Optimizer(z0, pairs["z0"], lr=0.01, weight_decay=0.1),
            "z3": zopt.Optimizer(z3, pairs["z3"], lr=0.01, weight_decay=0.1)}
    for _ in range(3):
        gs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        for s, o in opts.items():
            for (_, g), gv in zip(pairs[s], gs):
                g[...] = gv
            o.step()
        for (a, _), (b, _) in zip(pairs["z0"], pairs["z3"]):
            np.testing.assert_array_equal(a, b)
    assert not any(np.array_equal(a, p) for (a, _), p in zip(pairs["z3"], p0))  # they moved
    for t in range(len(sizes)):
        np.testing.assert_array_equal(opts["z0"].read_state(t, "exp_avg_sq"),
                                      opts["z3"].read_state(t, "exp_avg_sq"))


def test_read_state_raw_and_memory_info(steps):
    step = steps(rule="adam", amsgrad=True, layout="bf16")
    p = bf16.from_f32(np.linspace(-1, 1, 17, dtype=np.float32) + 0.01)
    g = bf16.from_f32(np.full(17, 0.3, np.float32))
    opt = zopt.Optimizer(step, [(p, g)], lr=0.01)
    opt.step()
    raw = opt.read_state_raw(0, "exp_avg")
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(bf16.to_f32(raw), opt.read_state(0, "exp_avg"))
    info = opt.memory_info()
    assert info["num_params"] == 17 and info["bytes_cpu"] >= 17 * 2 * 5


# ---- bad inputs -------------------------------------------------------------

def test_wrong_dtype(steps):
    step = steps(rule="adamw", layout="f32")
    with pytest.raises(zopt.ZoptError) as e:  # f16 arrays for an f32 step (C)
        zopt.Optimizer(step, [(np.ones(3, np.float16), np.ones(3, np.float16))])
    assert e.value.code == zopt.Status.INVALID_ARGUMENT
    with pytest.raises(zopt.ZoptError) as e:  # float64 has no zopt dtype
        zopt.Optimizer(step, [(np.ones(3), np.ones(3))])
    assert e.value.code == zopt.Status.INVALID_ARGUMENT
    with pytest.raises(zopt.ZoptError):  # bf16 torch tensor to an f32 step
        zopt.Optimizer(step, [torch.ones(3, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(zopt.ZoptError):  # param/grad size mismatch
        zopt.Optimizer(step, [(np.ones(3, np.float32), np.ones(4, np.float32))])
    with pytest.raises(zopt.ZoptError):  # non-contiguous
        zopt.Optimizer(step, [(np.ones(6, np.float32)[::2], np.ones(3, np.float32))])
    p = np.ones(3, np.float32)
    with pytest.raises(zopt.ZoptError) as e:  # same param registered twice
        zopt.Optimizer(step, [(p, np.ones(3, np.float32)), (p, np.ones(3, np.float32))])
    assert e.value.code == zopt.Status.INVALID_ARGUMENT


@pytest.mark.parametrize("name,value", [("lr", -1.0), ("beta1", 1.0), ("beta2", -0.1),
                                        ("eps", 0.0), ("lr", float("nan")),
                                        ("weight_decay", float("inf")), ("lr", float("inf"))])
def test_hyper_out_of_range(steps, name, value):
    step = steps(rule="adamw", layout="f32")
    opt = zopt.Optimizer(step, [(np.ones(3, np.float32), np.ones(3, np.float32))])
    before = opt.get_hyper(0, name)
    with pytest.raises(zopt.ZoptError) as e:
        opt.set_hyper(0, name, value)
    assert e.value.code == zopt.Status.INVALID_ARGUMENT
    assert opt.get_hyper(0, name) == before
    # the same through param_groups at step()
    key = {"beta1": "betas", "beta2": "betas"}.get(name, name)
    if key == "betas":
        b = list(opt.param_groups[0]["betas"])
        b[0 if name == "beta1" else 1] = value
        opt.param_groups[0]["betas"] = tuple(b)
    else:
        opt.param_groups[0][key] = value
    with pytest.raises(zopt.ZoptError):
        opt.step()


def test_wrong_hyper_name(steps):
    step = steps(rule="adamw", layout="f32")
    opt = zopt.Optimizer(step, [(np.ones(3, np.float32), np.ones(3, np.float32))])
    with pytest.raises(zopt.ZoptError) as e:
        opt.set_hyper(0, "momentum", 0.9)  # not a slot of an Adam step
    assert e.value.code == zopt.Status.INVALID_ARGUMENT
    with pytest.raises(zopt.ZoptError):
        opt.set_hyper(0, "learning_rate", 0.1)
    with pytest.raises(zopt.ZoptError):
        opt.get_hyper(5, "lr")  # no such group
    with pytest.raises(zopt.ZoptError):  # momentum= given to an Adam step
        zopt.Optimizer(step, [(np.ones(3, np.float32), np.ones(3, np.float32))],
                       momentum=0.9)


def test_bad_state_access_and_files(steps, tmp_path):
    step = steps(rule="adamw", layout="f32")
    opt = zopt.Optimizer(step, [(np.ones(3, np.float32), np.ones(3, np.float32))])
    with pytest.raises(zopt.ZoptError):
        opt.read_state(0, "momentum_buffer")  # not a state of this step
    with pytest.raises(zopt.ZoptError):
        opt.read_state(7, "exp_avg")  # no such tensor
    with pytest.raises(zopt.ZoptError) as e:
        zopt.Step(str(tmp_path / "nope.so"))
    assert e.value.code == zopt.Status.IO
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF not really")
    with pytest.raises(zopt.ZoptError) as e:
        zopt.Step(str(junk))
    assert e.value.code in (zopt.Status.ABI, zopt.Status.IO)
    libm = [p for p in glob.glob("/lib/x86_64-linux-gnu/libm.so.6") +
            glob.glob("/usr/lib/x86_64-linux-gnu/libm.so.6")]
    if libm:  # a real shared object that is not a step
        with pytest.raises(zopt.ZoptError) as e:
            zopt.Step(libm[0])
        assert e.value.code == zopt.Status.ABI


def test_loss_scaler_config(steps):
    step = steps(rule="adamw", layout="f16_loss_scale")
    p = np.ones(8, np.float16)
    g = np.zeros(8, np.float16)
    opt = zopt.Optimizer(step, [(p, g)], loss_scaler=dict(init_scale=256.0,
                                                          growth_interval=2))
    assert opt.loss_scale == 256.0
    for _ in range(2):
        g[...] = np.float16(0.5 * opt.loss_scale)
        opt.step()
        assert not opt.last_skipped
    assert opt.loss_scale == 512.0  # grew after 2 good steps
    with pytest.raises(zopt.ZoptError):
        opt.configure_loss_scaler(init_scale=-1.0)
    with pytest.raises(zopt.ZoptError):
        opt.configure_loss_scaler(backoff_factor=2.0)


def test_example_train_mlp(zopt_bins):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_mlp.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_numpy_only_without_torch(steps, tmp_path):
    """The binding without torch (import blocked): numpy (param, grad)
    pairs, steps, state_dict (numpy arrays) round trip, bf16 master."""
    import subprocess
    import sys
    so = steps(rule="adamw", layout="bf16_master").path
    code = f"""
import sys
sys.modules["torch"] = None  # import torch fails
sys.path.insert(0, {os.path.join(REPO, 'python')!r})
import numpy as np, zopt
from zopt import bf16
assert zopt.Optimizer.__mro__[1] is object
rng = np.random.default_rng(0)
p = bf16.from_f32(rng.standard_normal(100).astype(np.float32))
g = bf16.from_f32(rng.standard_normal(100).astype(np.float32))
o = zopt.Optimizer({so!r}, [(p, g)], lr=0.01)
o.step(); o.step()
sd = o.state_dict()
assert sd["state"][0]["step"] == 2 and sd["state"][0]["exp_avg"].dtype == np.float32
saved = p.copy()
o.step()
after = p.copy()
p[...] = saved
o.load_state_dict(sd)
o.step()
assert (p == after).all()
print("NUMPY OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ,
                                        "ZOPT_RUNTIME_LIB": zopt.find_runtime_library()})
    assert r.returncode == 0 and "NUMPY OK" in r.stdout, r.stdout + r.stderr
