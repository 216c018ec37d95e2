"""Numerical gradient checking: analytic gradients against central differences."""
import numpy as np

from microtensor.core._core import Tensor, run_backward, wrap


class GradcheckError(RuntimeError):
    """The analytic and numerical gradients disagree."""


def _outputs_of(fn, inputs):
    out = fn(*inputs)
    if isinstance(out, Tensor):
        return [out]
    return [o for o in out if isinstance(o, Tensor)]


def compare_gradients(fn, inputs, eps=1e-6, seed=0, directions=None):
    """Analytic and central-difference gradients of <u, fn(inputs)>, u a random upstream
    gradient (an all-ones one hides bugs such as a missing transpose):
        analytic:  autograd's backward of u
        numerical: (<u, fn(x + eps e_i)> - <u, fn(x - eps e_i)>) / (2 eps)
    Returns [(input index, analytic, numerical)] for every float64 input requiring grad,
    as float64 numpy arrays of the input's shape.

    With directions=n (fast mode, as torch's fast_mode): instead of one central
    difference per element, n of them along random unit directions d through all the
    checked inputs at once, against the analytic <gradient, d>. Returns
    [(None, analytic (n,), numerical (n,))]: two evaluations per direction, whatever the
    number of elements, at the price of checking projections only."""
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
        # grad mode stays on (as in torch's gradcheck): a function may register hooks or
        # call backward inside; the graphs built here are simply dropped
        vals = _outputs_of(fn, inputs)
        return sum(float(np.sum(v._data.astype(np.float64) * u)) for v, u in zip(vals, upstream)
                   if u is not None)

    grads = [np.zeros(inputs[i].shape) if g is None else g._data.astype(np.float64)
             for i, g in zip(checked, analytic)]
    if directions is not None:
        return [(None,) + _along_directions(objective, [inputs[i]._data for i in checked],
                                            grads, eps, directions, rng)]

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


def _along_directions(objective, arrays, grads, eps, n, rng):
    """(analytic <grad, d>, central difference along d) for n random unit directions d."""
    saved = [np.array(x, copy=True) for x in arrays]
    analytic, numerical = np.zeros(n), np.zeros(n)
    for k in range(n):
        d = [rng.standard_normal(x.shape) for x in arrays]
        norm = np.sqrt(sum(float(np.sum(v * v)) for v in d))
        d = [v / norm for v in d]
        analytic[k] = sum(float(np.sum(g * v)) for g, v in zip(grads, d))
        values = []
        for sign in (1.0, -1.0):
            for x, x0, v in zip(arrays, saved, d):
                np.copyto(x, x0 + sign * eps * v)        # in place: fn sees its own tensors
            values.append(objective())
        for x, x0 in zip(arrays, saved):
            np.copyto(x, x0)
        numerical[k] = (values[0] - values[1]) / (2 * eps)
    return analytic, numerical


def _verdict(results, atol, rtol, raise_exception, what, name):
    """True if every element passes |analytic - numerical| <= atol + rtol |numerical|;
    else a report of the worst element of each failing input (raised or False)."""
    ok = True
    report = []
    for i, a, num in results:
        err = np.abs(a - num)
        bad = err > atol + rtol * np.abs(num)
        if bad.any():
            ok = False
            worst = np.unravel_index(np.argmax(err - (atol + rtol * np.abs(num))), a.shape)
            report.append(
                f"{what} mismatch for {name(i)} (shape {a.shape}): worst element {tuple(int(w) for w in worst)}: "
                f"analytic {a[worst]:.10g}, numerical {num[worst]:.10g}, abs error {err[worst]:.3g} "
                f"(allowed {atol + rtol * abs(num[worst]):.3g}); {int(bad.sum())} of {a.size} elements off")
    if ok:
        return True
    if raise_exception:
        kind = "gradgradcheck" if what.startswith("second") else "gradcheck"
        raise GradcheckError(f"{kind} failed:\n  " + "\n  ".join(report))
    return False


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True, seed=0,
              nondet_tol=0.0, fast_mode=False, directions=8):
    """Check the analytic gradient of `fn` at `inputs` against central differences
    (see compare_gradients): every element must satisfy
    |analytic - numerical| <= atol + rtol * |numerical|.
    Returns True; on a mismatch raises GradcheckError (or returns False) with a report
    naming the input, the worst element, both values and the error.
    fast_mode=True checks `directions` random projections instead of every element.
    """
    results = compare_gradients(fn, inputs, eps, seed, directions if fast_mode else None)
    return _verdict(results, atol, rtol, raise_exception, "Jacobian", _name(None))


def _name(n_inputs):
    def name(i):
        if i is None:
            return "random directions (fast mode)"
        return f"input {i}" if n_inputs is None or i < n_inputs else f"grad_output {i - n_inputs}"
    return name


def first_order_vjp(fn, inputs, grad_outputs):
    """The function (x..., u...) -> d<u, fn(x)>/dx of the inputs that require grad,
    computed with create_graph=True, so that it can be differentiated again. Inputs that
    do not reach an output give no entry."""
    n = len(inputs)
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]

    def vjp(*args):
        xs, us = args[:n], list(args[n:])
        outs = [o for o in _outputs_of(fn, xs) if o.dtype.kind == "f"]
        if len(outs) != len(us):
            raise ValueError(f"gradgradcheck: fn returned {len(outs)} floating outputs, "
                             f"but {len(us)} grad_outputs were given")
        pairs = [(o, u) for o, u in zip(outs, us) if o.requires_grad]
        grads = run_backward([o for o, _ in pairs], [u for _, u in pairs], True,
                             [xs[i] for i in wanted], False, True)
        return tuple(g for g in grads if g is not None)
    return vjp


def gradgradcheck(fn, inputs, grad_outputs=None, eps=1e-6, atol=1e-5, rtol=1e-3,
                  raise_exception=True, seed=0, fast_mode=False, directions=8):
    """Check second derivatives: gradcheck of the first-order vector-Jacobian product
        (x, u) -> d<u, fn(x)>/dx      (built with create_graph=True)
    with respect to both x and u. Its analytic gradient is a second-order VJP, made of
    the create-graph rules of every op fn uses; its numerical gradient is central
    differences of first-order VJPs. u (grad_outputs) defaults to random float64
    upstream gradients, one per floating output of fn; the check's own upstream
    gradient is random too. Returns True, or raises GradcheckError (or returns False)
    naming the input or grad_output, the worst element, both values and the error.
    fast_mode=True checks `directions` random projections instead of every element."""
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    rng = np.random.default_rng(seed + 1)
    if grad_outputs is None:
        outs = [o for o in _outputs_of(fn, inputs) if o.dtype.kind == "f"]
        grad_outputs = [wrap(rng.standard_normal(o.shape)) for o in outs]
    elif isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    us = []
    for u in grad_outputs:
        u = u if isinstance(u, Tensor) else wrap(np.asarray(u, dtype=np.float64))
        if u.dtype != np.float64:
            raise TypeError(f"gradgradcheck: grad_outputs must be float64, got {u.dtype}")
        # a private copy that requires grad: it is perturbed in place like an input
        us.append(wrap(np.array(u._data, dtype=np.float64)).requires_grad_())
    results = compare_gradients(first_order_vjp(fn, inputs, us), inputs + tuple(us), eps, seed,
                                directions if fast_mode else None)
    return _verdict(results, atol, rtol, raise_exception, "second-order (gradient of gradient)",
                    _name(len(inputs)))
