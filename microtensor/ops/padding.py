"""F.pad and F.one_hot: a new tensor laid out around its input, padding around it (constant,
reflect, replicate, circular) or a one-hot class axis after it. Constant padding is one node,
its Backward right above its forward; the other modes are gathers (getitem with an index).
"""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import wrap, needs_graph, attach, register_ops
from microtensor.autograd.graph_rules import DifferentiableRule
from microtensor.ops._common import _tensor, declare_saved


class ConstantPadBackward(DifferentiableRule):
    """y = value everywhere, y[inner] = x;  dx = g[inner]"""

    def create_graph(self, g):
        """y = value everywhere, y[inner] = x;  dx = g[inner]"""
        return (_core.getitem(g, self.inner),)


declare_saved(ConstantPadBackward)


def _pad_pairs(pad, ndim, op="pad"):
    """torch's pad tuple (last dim first: left, right, then the dim before...) as one
    (before, after) pair per dim of the input."""
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > ndim:
        raise ValueError(f"{op}: padding length must be even and at most twice the number of "
                         f"dims ({ndim}), got {len(pad)}")
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


def pad(input, pad, mode="constant", value=None):
    """Pad the last len(pad)//2 dims. Negative padding crops. Modes: constant, reflect,
    replicate, circular (the last three on at most the last 3 dims)."""
    x = _tensor(input, "pad")
    pairs = _pad_pairs(pad, x.ndim)
    # crop first (a slice), then pad with the positive amounts
    crop = tuple(slice(max(-b, 0), n - max(-a, 0)) for (b, a), n in zip(pairs, x.shape))
    for (b, a), n in zip(pairs, x.shape):
        if n + min(b, 0) + min(a, 0) < 0:
            raise RuntimeError(f"pad: padding {pad} would give a negative size for shape "
                               f"{tuple(x.shape)}")
    if any(b < 0 or a < 0 for b, a in pairs):
        x = _core.getitem(x, crop)
    pairs = [(max(b, 0), max(a, 0)) for b, a in pairs]
    if mode == "constant":
        fill = 0 if value is None else value
        out_shape = tuple(n + b + a for (b, a), n in zip(pairs, x.shape))
        y = np.full(out_shape, fill, dtype=x._data.dtype)
        inner = tuple(slice(b, b + n) for (b, _), n in zip(pairs, x.shape))
        y[inner] = x._data
        out = wrap(y)
        if needs_graph((x,)):
            node = ConstantPadBackward()
            node.inner = inner
            attach(out, node, (x,))
        return out
    if value not in (None, 0):
        raise ValueError(f"pad: padding mode {mode!r} doesn't take in value argument")
    for d, (b, a) in enumerate(pairs):
        if b == 0 and a == 0:
            continue
        n = x.shape[d]
        i = np.arange(-b, n + a)
        if mode == "replicate":
            index = np.clip(i, 0, n - 1)
        elif mode == "reflect":
            if b >= n or a >= n:
                raise RuntimeError(f"pad: padding size should be less than the corresponding "
                                   f"input dimension, but got padding ({b}, {a}) at dimension "
                                   f"{d} of size {n}")
            period = 2 * (n - 1)
            index = np.abs((i + period) % period if period else i * 0)
            index = np.where(index >= n, period - index, index)
        elif mode == "circular":
            if b > n or a > n:
                raise RuntimeError(f"pad: padding ({b}, {a}) is larger than dimension {d} "
                                   f"of size {n}")
            index = i % n
        else:
            raise NotImplementedError(f"pad: mode {mode!r} is not implemented")
        x = _core.getitem(x, (slice(None),) * d + (index,))
    return x


# ---- one-hot ---------------------------------------------------------------------------

def one_hot(tensor, num_classes=-1):
    """int64 (..., num_classes) with a 1 at each index (num_classes=-1: max + 1)."""
    t = _tensor(tensor, "one_hot")
    a = t._data
    if a.dtype.kind not in "iu":
        raise RuntimeError(f"one_hot is only applicable to index tensor of type int64, got "
                           f"{a.dtype}")
    if a.size and a.min() < 0:
        raise RuntimeError("one_hot: Class values must be non-negative.")
    if num_classes == -1:
        if a.size == 0:
            raise RuntimeError("one_hot: Can not infer total number of classes from empty "
                               "tensor.")
        num_classes = int(a.max()) + 1
    if a.size and a.max() >= num_classes:
        raise RuntimeError(f"one_hot: Class values must be smaller than num_classes "
                           f"({num_classes}), got {int(a.max())}")
    out = np.zeros(a.shape + (int(num_classes),), dtype=np.int64)
    np.put_along_axis(out, a[..., None].astype(np.int64), 1, axis=-1)
    return wrap(out)


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("index", globals(), "one_hot", scope="F")
register_ops("shape", globals(), "pad", scope="F")
