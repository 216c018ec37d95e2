"""Numerical gradient checking: analytic gradients against central differences."""
import numpy as np

from microtensor._core import Tensor, run_backward, no_grad


class GradcheckError(RuntimeError):
    """The analytic and numerical gradients disagree."""


def _outputs_of(fn, inputs):
    out = fn(*inputs)
    if isinstance(out, Tensor):
        return [out]
    return [o for o in out if isinstance(o, Tensor)]


def compare_gradients(fn, inputs, eps=1e-6, seed=0):
    """Analytic and central-difference gradients of <u, fn(inputs)>, u a random upstream
    gradient (an all-ones one hides bugs such as a missing transpose):
        analytic:  autograd's backward of u
        numerical: (<u, fn(x + eps e_i)> - <u, fn(x - eps e_i)>) / (2 eps)
    Returns [(input index, analytic, numerical)] for every float64 input requiring grad,
    as float64 numpy arrays of the input's shape."""
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    checked = [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input requires grad")
    for i in checked:
        if inputs[i].dtype != np.float64:
            raise TypeError(
                f"gradcheck: input {i} has dtype {inputs[i].dtype}; check gradients in float64 "
                "(t.double()), float32 differences are too coarse")
    rng = np.random.default_rng(seed)

    # the random upstream gradient, one per output
    outs = _outputs_of(fn, inputs)
    upstream = [rng.standard_normal(o.shape).astype(o.dtype) if o.dtype.kind == "f" else None
                for o in outs]
    pairs = [(o, u) for o, u in zip(outs, upstream) if u is not None and o.requires_grad]
    if not pairs:
        raise ValueError("gradcheck: no floating output depends on the inputs")

    # analytic
    analytic = run_backward([o for o, _ in pairs], [u for _, u in pairs], False,
                            [inputs[i] for i in checked], False)

    def objective():
        with no_grad():
            vals = _outputs_of(fn, inputs)
        return sum(float(np.sum(v._data.astype(np.float64) * u)) for v, u in zip(vals, upstream)
                   if u is not None)

    result = []
    for k, i in enumerate(checked):
        x = inputs[i]._data
        a = np.zeros(x.shape) if analytic[k] is None else analytic[k]._data.astype(np.float64)
        num = np.zeros(x.shape)
        flat = x.reshape(-1)  # a view: perturb in place
        if not np.shares_memory(flat, x):
            raise ValueError(f"gradcheck: input {i} must be contiguous")
        for j in range(flat.size):
            orig = flat[j]
            flat[j] = orig + eps
            plus = objective()
            flat[j] = orig - eps
            minus = objective()
            flat[j] = orig
            num.reshape(-1)[j] = (plus - minus) / (2 * eps)
        result.append((i, a, num))
    return result


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True, seed=0,
              nondet_tol=0.0):
    """Check the analytic gradient of `fn` at `inputs` against central differences
    (see compare_gradients): every element must satisfy
    |analytic - numerical| <= atol + rtol * |numerical|.
    Returns True; on a mismatch raises GradcheckError (or returns False) with a report
    naming the input, the worst element, both values and the error.
    """
    ok = True
    report = []
    for i, a, num in compare_gradients(fn, inputs, eps, seed):
        err = np.abs(a - num)
        bad = err > atol + rtol * np.abs(num)
        if bad.any():
            ok = False
            worst = np.unravel_index(np.argmax(err - (atol + rtol * np.abs(num))), a.shape)
            report.append(
                f"Jacobian mismatch for input {i} (shape {a.shape}): worst element {tuple(int(w) for w in worst)}: "
                f"analytic {a[worst]:.10g}, numerical {num[worst]:.10g}, abs error {err[worst]:.3g} "
                f"(allowed {atol + rtol * abs(num[worst]):.3g}); {int(bad.sum())} of {a.size} elements off")
    if ok:
        return True
    if raise_exception:
        raise GradcheckError("gradcheck failed:\n  " + "\n  ".join(report))
    return False
