"""microtensor on every x86-64 CPU, not only the one running the tests.

The fused kernels are compiled three times (baseline, AVX2+FMA, AVX-512); a build that
executed a wider instruction at import killed the process on a CPU without it (an
`Illegal instruction`, no Python error), and tools that import every module of a package
(pydoc, doc generators, the op test that walks the package) died with it. Here each
test runs a child Python under qemu's user-mode emulator with an older CPU model:

  Haswell      AVX2 and FMA, no AVX-512 (most laptops: Intel's consumer CPUs, AMD before Zen 4)
  SandyBridge  AVX without AVX2 (the baseline build, on a CPU with 256-bit registers)
  Nehalem      SSE4.2, no AVX at all

and checks in the child that every module of the installed package imports, that each
per-CPU build says whether this CPU runs it and refuses every call where it does not,
that the loader and `mt.show_config()` name the widest build the CPU runs, and that the
kernels it chose give the right numbers (forward against numpy, backward by central
differences) and a training step runs. The host's own CPU is checked the same way
without emulation, so every build the host runs is covered too.

qemu-user comes from Debian's `qemu-user` package (.ci/run installs it); where it is
missing the emulated cases skip and say so. numpy and scipy must run on the emulated CPU
before microtensor can: their wheels pick their own minimum CPU (numpy 2.4's have died
under qemu's Nehalem on some hosts, and in `a @ b` under SandyBridge), so each emulated
case first runs a short numpy/scipy probe there and skips, naming the CPU and the probe's
exit status, where the probe itself fails: that is numpy's limit, not microtensor's.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

import microtensor

QEMU = shutil.which("qemu-x86_64")
# the microtensor this process imported (a build in place, or an installed one)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(microtensor.__file__)))
IS_X86_64 = os.uname().machine == "x86_64"

# the child: everything it checks goes into one JSON line on stdout
CHILD = r'''
import importlib, json, math, pkgutil, sys, warnings
import numpy as np
warnings.simplefilter("ignore")
import microtensor as mt
import models
import microtensor.nn.functional as F
from microtensor.ops import _functional_common as common

report = {"imported": [], "failed": {}, "builds": {}, "refused": {}}
for package in (mt, models):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
            report["imported"].append(info.name)
        except Exception as e:          # an ImportError is a finding too, not a crash
            report["failed"][info.name] = f"{type(e).__name__}: {e}"

for name, fused, attention, runs_here in common.KERNEL_BUILDS:
    for module_name in (fused, attention):
        m = importlib.import_module("microtensor.kernels." + module_name)
        runs = bool(getattr(m, "CPU_RUNS_THIS_BUILD", True))
        report["builds"][module_name] = {"target": getattr(m, "TARGET", None), "runs": runs,
                                         "numpy_says": bool(runs_here())}
        if not runs:    # every exported function refuses with a RuntimeError
            public = [k for k, v in vars(m).items()
                      if not k.startswith("__") and callable(v) and not isinstance(v, type)]
            refused = 0
            for k in public:
                try:
                    getattr(m, k)()
                except RuntimeError as e:
                    refused += "compiled for CPUs with" in str(e)
            report["refused"][module_name] = [refused, len(public)]

report["chosen"] = [F._kernels.fused.__name__, F._kernels.attention.__name__]
report["config"] = mt.config()["build"]
lines = []
import io, contextlib
with contextlib.redirect_stdout(io.StringIO()) as out:
    mt.show_config()
report["show_config"] = out.getvalue()

# the chosen kernels' numbers: forward against numpy, backward by central differences,
# at sizes that divide by no thread count, with 1 and 2 threads
from scipy.special import erf
rng = np.random.default_rng(0)
R, C = 37, 67
x64 = rng.standard_normal((R, C))
w64, b64 = rng.standard_normal(C), rng.standard_normal(C)
targets = rng.integers(0, C, R)
def ln_ref(x, w, b):
    mu = x.mean(-1, keepdims=True); var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b
def softmax_ref(x):
    e = np.exp(x - x.max(-1, keepdims=True)); return e / e.sum(-1, keepdims=True)
def attention_ref(q, k, v):
    T = q.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return softmax_ref(s) @ v
q, k, v = (rng.standard_normal((2, 3, 13, 8)) for _ in range(3))
cases = {
    "gelu": (lambda t: F.gelu(t), lambda a: 0.5 * a * (1 + erf(a / math.sqrt(2))), [x64]),
    "softmax": (lambda t: F.softmax(t, -1), softmax_ref, [x64]),
    "log_softmax": (lambda t: F.log_softmax(t, -1), lambda a: np.log(softmax_ref(a)), [x64]),
    "layer_norm": (lambda t, w, b: F.layer_norm(t, (C,), w, b), ln_ref, [x64, w64, b64]),
    "cross_entropy": (lambda t: F.cross_entropy(t, mt.tensor(targets)),
                      lambda a: -np.log(softmax_ref(a))[np.arange(R), targets].mean(), [x64]),
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  attention_ref, [q, k, v]),
}
report["errors"] = {}
report["gradcheck"] = {}
for threads in (1, 2):
    mt.set_num_threads(threads)
    for name, (op, ref, arrays) in cases.items():
        for dtype, tol in ((np.float64, 1e-10), (np.float32, 2e-5)):
            ts = [mt.tensor(a.astype(dtype)) for a in arrays]
            got = op(*ts).numpy().astype(np.float64)
            want = ref(*[a.astype(dtype).astype(np.float64) for a in arrays])
            err = float(np.max(np.abs(got - want) / (1 + np.abs(want))))
            report["errors"][f"{name}/{np.dtype(dtype).name}/{threads}"] = [err, tol]
        small = [mt.tensor(a[..., :5, :7] if a.ndim > 1 else a[:7], requires_grad=True)
                 for a in arrays]
        if name in ("layer_norm",):
            small = [mt.tensor(a[:5] if a.ndim > 1 else a, requires_grad=True) for a in arrays]
        if name == "cross_entropy":
            small = [mt.tensor(x64[:5], requires_grad=True)]
            op = lambda t: F.cross_entropy(t, mt.tensor(targets[:5]))
        report["gradcheck"][f"{name}/{threads}"] = bool(mt.gradcheck(op, small))

# a training step of the main job's model family, tiny
from models.gpt import GPT, GPTConfig
mt.manual_seed(0)
model = GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16))
opt = mt.optim.AdamW(model.parameters(), lr=1e-2)
idx = mt.tensor(rng.integers(0, 17, (2, 8)))
losses = []
for _ in range(3):
    logits, loss = model(idx, idx)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(float(loss.item()))
report["losses"] = losses
print("REPORT " + json.dumps(report))
'''


def run_child(cpu):
    """Run CHILD under `qemu-x86_64 -cpu cpu` (or natively for cpu=None); its report."""
    cmd = ([QEMU, "-cpu", cpu] if cpu else []) + [sys.executable, "-c", CHILD]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=PACKAGE_ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, (
        f"the child on CPU {cpu or 'host'} ended with exit code {p.returncode} "
        f"(132 or -4: an illegal instruction)\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


# cpu model -> the fused and attention builds the loader must choose there
EMULATED = {"Haswell": ("_fused_avx2", "_fused_attention_avx2"),
            "SandyBridge": ("_fused", "_fused_attention"),
            "Nehalem": ("_fused", "_fused_attention")}

# what microtensor needs of numpy and scipy, run alone on the emulated CPU first
NUMPY_PROBE = r'''
import numpy as np, scipy.special, scipy.linalg.cython_blas
a = np.random.default_rng(0).standard_normal((67, 67))
for dtype in (np.float32, np.float64):
    b = a.astype(dtype)
    s = (b @ b).sum() + np.exp(b).sum() + np.tanh(b).sum() + scipy.special.erf(b).sum()
    s += np.sort(b, axis=None)[0] + np.einsum("ij,jk->ik", b, b).sum()
assert s == s
print("NUMPY-RUNS")
'''


def numpy_runs_on(cpu):
    """None where numpy and scipy run under `qemu-x86_64 -cpu cpu`; else why not."""
    try:
        p = subprocess.run([QEMU, "-cpu", cpu, sys.executable, "-c", NUMPY_PROBE],
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"numpy's probe did not finish in 300 s under qemu -cpu {cpu}"
    if p.returncode == 0 and "NUMPY-RUNS" in p.stdout:
        return None
    how = ("an illegal instruction" if p.returncode in (-4, 132)
           else f"exit status {p.returncode}")
    return (f"numpy/scipy themselves do not run under qemu -cpu {cpu} ({how}): their wheels "
            f"need more than this CPU model, so microtensor cannot be checked there")


def check_report(report, expected_chosen=None):
    assert not report["failed"], f"modules that did not import: {report['failed']}"
    names = set(report["imported"])
    for module in ("microtensor.kernels._fused_avx512", "microtensor.kernels._fused_attention_avx512",
                   "microtensor.kernels._fused_avx2", "microtensor.kernels._fused_attention_avx2",
                   "microtensor.kernels._fused", "microtensor.nn.functional", "models.gpt"):
        assert module in names, f"{module} was not imported by the walk"
    builds = report["builds"]
    for module, b in builds.items():
        # the build's own check (the compiler's) and numpy's agree on what this CPU runs
        assert b["runs"] == b["numpy_says"], (module, b)
        if not b["runs"]:
            refused, public = report["refused"][module]
            assert public >= 5 and refused == public, (module, refused, public)
    # the loader took the widest build this CPU runs, and show_config names it
    widest = next(name for name in ("_fused_avx512", "_fused_avx2", "_fused")
                  if builds[name]["runs"])
    assert report["chosen"][0] == "microtensor.kernels." + widest
    if expected_chosen:
        assert report["chosen"] == ["microtensor.kernels." + m for m in expected_chosen]
    target = builds[widest]["target"]
    assert report["config"]["fused_kernels"] == target
    assert f"fused kernels  {target}" in report["show_config"]
    for case, (err, tol) in report["errors"].items():
        assert err <= tol, f"{case}: error {err:.2e} above {tol:.0e}"
    assert len(report["errors"]) == 6 * 2 * 2
    assert all(report["gradcheck"].values()), report["gradcheck"]
    losses = report["losses"]
    assert len(losses) == 3 and all(l == l and 0 < l < 10 for l in losses), losses
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not IS_X86_64, reason="the emulated CPUs are x86-64 models")
@pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 is not installed (Debian's qemu-user "
                                         "package; .ci/run installs it)")
@pytest.mark.parametrize("cpu", sorted(EMULATED))
def test_every_module_imports_and_the_kernels_run_on_an_older_cpu(cpu):
    why_not = numpy_runs_on(cpu)
    if why_not:
        pytest.skip(why_not)
    check_report(run_child(cpu), EMULATED[cpu])


def test_every_module_imports_and_the_kernels_run_on_this_cpu():
    check_report(run_child(None))
