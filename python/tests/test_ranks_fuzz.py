"""Randomized differential test of zopt.Optimizer ACROSS RANKS: 2 gloo
processes (ranks_fuzz_worker.py) run one seeded random sequence of user
actions on a zopt.Optimizer over the process group (ZeRO stage 0-3, rule,
parameter class, clip and loss scaling drawn per case) and on a one-rank
twin in the same process (the same step at world size 1, gradient divisor
2, gradients the rank-order f32 sum of the ranks' ones); after most
actions every param, state_dict() element (gathered), step count and step
outcome must equal the twin's BIT FOR BIT (docs/DISTRIBUTED.md).

Actions: steps with never-zero gradients (the same on both ranks or each
its own, accumulated, None on every rank or on one rank only; set by hand
or by a backward), an inf gradient on one rank under loss scaling (a
skipped step), step(closure), zero_grad both ways, hyperparameter edits
and set_hyper, an lr scheduler, add_param_group after steps,
opt.clip_grad_norm_ (compiled clip), state_dict() -> a new optimizer
(also the other side's), save() -> load() into a new optimizer at W = 2
-> 2, 2 -> 1 and 1 -> 2, a rollback to an earlier state_dict or file (also
the other world size's file), state[p] written (masters too), p.data
written in place, replaced or swapped, grad_divisor, set_seed,
configure_loss_scaler, ZeRO-3 release/gather, refusals (a bad lr, a
duplicate param) on both sides. Per case: the rule, ZeRO stage, parameter
class, clip, loss scaling, grad_streaming and each side's bucket_elems and
num_threads (which must not change a bit).

ZOPT_FUZZ_CASES (default 8), ZOPT_FUZZ_SEED (0), ZOPT_FUZZ_ACTIONS (25)
pick the run, ZOPT_FUZZ_CHECK_ALL=1 checks after every action (to
minimize); docs/TESTING.md "The ranks fuzzer" has the long runs and what
they found (python/tests/test_ranks_finds.py)."""
import os
import shutil
import sys
import json

import pytest

from test_comm import _free_port, _run_all, _runtime_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ranks_fuzz_worker.py")
CASES = int(os.environ.get("ZOPT_FUZZ_CASES", "8"))
SEED = int(os.environ.get("ZOPT_FUZZ_SEED", "0"))
ACTIONS = int(os.environ.get("ZOPT_FUZZ_ACTIONS", "25"))


def launch(outdir, mode, seed, cases, actions, timeout):
    """Both ranks; returns their result dicts (and their outputs). The
    processes are killed at the timeout, the case files removed."""
    port = _free_port()
    cmds = [[sys.executable, WORKER, str(r), "2", str(port), str(outdir), mode, str(seed),
             str(cases), str(actions)] for r in range(2)]
    try:
        procs, outs = _run_all(cmds, timeout=timeout, env=_runtime_env())
        res = []
        for r, (p, out) in enumerate(zip(procs, outs)):
            path = os.path.join(outdir, f"rank{r}.json")
            assert p.returncode == 0 and f"DONE rank {r}" in out and os.path.exists(path), \
                "\n".join(f"rank {q} (exit {pq.returncode}):\n{oq[-6000:]}"
                          for q, (pq, oq) in enumerate(zip(procs, outs)))
            with open(path) as fh:
                res.append(json.load(fh))
        return res, outs
    finally:
        for d in os.listdir(outdir):
            if d.startswith("case"):
                shutil.rmtree(os.path.join(outdir, d), ignore_errors=True)


def test_ranks_fuzz(tmp_path, zopt_bins):
    res, _ = launch(tmp_path, "fuzz", SEED, CASES, ACTIONS, timeout=60 + 20 * CASES)
    for r in res:
        assert r["failure"] is None, r["failure"]
        assert r["cases"] == CASES
    assert res[0]["actions"] == res[1]["actions"] > 0


@pytest.mark.parametrize("mode", ["selftest", "selftest-grad"])
def test_the_harness_reports_a_perturbed_twin(tmp_path, zopt_bins, mode):
    """One bit of the twin's state (or of one gradient) flipped after (at)
    its first step: the harness reports the difference, on both ranks."""
    res, _ = launch(tmp_path, mode, 5, 1, 12, timeout=60)
    for r in res:
        assert r["failure"] is not None and "Failed:" in r["failure"] \
            and "twin" in r["failure"], r["failure"]


def test_a_rank_that_disagrees_or_dies_is_named(tmp_path, zopt_bins):
    """Rank 1 does something else at one call (ranks_inject_worker.py):
    another lr, maximize, grad_divisor or clip_grad_norm_ threshold, an add_param_group rank 0 does not make, a skipped step()
    (state_dict() instead), an exit. Every live rank's call raises
    ZoptError naming the other rank (or its call) within the zopt group's
    timeout (3 s) plus the liveness window, never hangs."""
    kinds = ["lr", "maximize", "divisor", "max_norm", "add_group", "skip_step", "exit"]
    port = _free_port()
    cmds = [[sys.executable, os.path.join(HERE, "ranks_inject_worker.py"), str(r), "2",
             str(port), str(tmp_path), *kinds] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=90, env=_runtime_env())
    res = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            res.append(json.load(fh))
    want = {  # kind: (rank 0's error names, rank 1's)
        "lr": (["group 0 lr: rank 0 has 0.01, rank 1 has 0.5"],) * 2,
        "maximize": (["group 0 flags (bit 0: maximize): rank 0 has 0, rank 1 has 1"],) * 2,
        "divisor": (["gradient divisor: rank 0 has 2, rank 1 has 4"],) * 2,
        "max_norm": (["clip max_norm: rank 0 has 1, rank 1 has 0.5"],) * 2,
        "add_group": (["rank 1 called", "ADD_TENSORS"], ["rank 0 called", "STEP"]),
        "skip_step": (["rank 1 called", "EXPORT"], ["rank 0 called", "STEP", "state_dict()"]),
        "exit": (["rank 1 did not answer"], None),
    }
    for kind, names in want.items():
        for r in range(2):
            if names[r] is None:
                assert kind not in res[r]
                continue
            got = res[r][kind]
            assert got["error"] is not None, f"{kind}: rank {r} raised nothing"
            for n in names[r]:
                assert n in got["error"], f"{kind} rank {r}: {got['error']}"
            assert got["seconds"] < 3 + 2 + 2, f"{kind} rank {r}: {got['seconds']:.1f} s"
