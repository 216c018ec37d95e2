"""F's layers: linear, embedding and dropout, each a forward function right below its
Backward node, whose first docstring line states the math. `mt.nn.functional` hands them
on with the other families (ops/activations.py, normalization.py, losses.py,
attention.py, distance.py, padding.py, rope.py); the kernels every op runs are
`_kernels.fused` and `_kernels.attention`, the widest build the CPU runs.
"""
import math

import numpy as np

import microtensor.core._core as _core
from microtensor.kernels import _blas, _gemv
from microtensor.core._core import Tensor, wrap, needs_graph, attach, ShapeError
from microtensor.autograd.graph_rules import FusedNode
from microtensor.ops._functional_common import (  # noqa: F401
    declare_saved, _cpu_has_avx2_fma, DtypeError, _tensor, _float_array,
    _same_dtype, _contig, _owned_indices, _grad_as, _PARALLEL_MIN, _PARALLEL_MIN_MEMORY_BOUND,
    _threads, _wants_grad, _check_reduction,
)

from microtensor.ops import _kernels  # the build of the fused kernels every op reads

__all__ = ["linear", "embedding", "dropout"]


# ---- linear ----------------------------------------------------------------------
#
# The common case, a 2-D weight (out, in) and a bias of (out,) or none, is one gemm with
# the bias added by its blocks (or, for one row, a gemv per slice of the output features:
# generation's case, see kernels/_gemv.pyx). Everything else torch accepts goes through
# _linear_general below: a 1-D weight (in,) gives x @ w, the last dim dropped; a bias of
# any shape that torch broadcasts, its gradient reduced back to that shape.

class LinearBackward(FusedNode):
    """y = x @ W^T + b;  dx = g @ W,  dW = g^T @ x,  db = sum_rows(g)"""

    def backward(self, g):
        x2d, w = self.x2d, self.weight                  # (M, in), (out, in)
        g2d = _grad_as(g, (x2d.shape[0], w.shape[0]), w.dtype)   # (M, out); no copy if contiguous
        dx = dw = db = None
        nt = _core.get_num_threads()
        if _wants_grad(self, 0):
            dx = _blas.gemm(g2d, w, num_threads=nt).reshape(self.x_shape)
        if _wants_grad(self, 1):
            dw = _blas.gemm(g2d.T, x2d, num_threads=nt)  # NOTE: .T is a view, passed as a 'T' flag
            if self.weight_shape != dw.shape:
                dw = dw.reshape(self.weight_shape)      # a 1-D weight: (1, in) -> (in,)
        if len(self.inputs) > 2 and _wants_grad(self, 2):
            if self.bias_against is None:
                db = _blas.column_sum(g2d, num_threads=nt)          # g's rows added in order
            else:
                # a broadcast bias: g in the shape the bias was added to ((M, out) or the
                # output's); the engine sums it back to the bias's own shape
                db = g2d.reshape(self.bias_against)
        return (dx, dw, db)

    def composite(self, x, w, b=None):
        """y = x @ W^T + b"""
        if w.ndim == 1:
            y = _core.matmul(x, w)                                  # (...,): x @ w
        else:
            y = _core.matmul(x, _core.transpose(w, 0, 1))           # (..., out)
        if b is None:
            return y
        if self.bias_against is not None and self.bias_against != tuple(y.shape):
            # the fused path: the bias broadcast against the flattened (M, out) output
            return _core.reshape(_core.add(_core.reshape(y, self.bias_against), b),
                                 tuple(y.shape))
        return _core.add(y, b)


declare_saved(LinearBackward, 0, 1)


def linear(input, weight, bias=None):
    """y = x @ W^T + b   (x (..., in), W (out, in), b (out,))"""
    x = _float_array(input, "linear input")
    w = _float_array(weight, "linear weight")
    b = None if bias is None else _float_array(bias, "linear bias")
    _same_dtype("linear", input=x, weight=w, bias=b)
    if w.ndim != 2 or (b is not None and b.shape != (w.shape[0],)):
        return _linear_general(input, weight, bias, x, w, b)
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        _linear_shape_error(x, w)
    M = math.prod(x.shape[:-1])
    x2d = x.reshape(M, w.shape[1])                      # (M, in); a view when x is contiguous
    out = wrap(_linear_forward(x2d, w, b).reshape(x.shape[:-1] + (w.shape[0],)))
    inputs = (input, weight) if bias is None else (input, weight, bias)
    if needs_graph(inputs):
        node = LinearBackward()
        node.x2d, node.weight, node.x_shape = x2d, w, x.shape
        node.weight_shape, node.bias_against = w.shape, None
        attach(out, node, inputs)
    return out


def _linear_forward(x2d, w, b):
    """(M, out) = x2d (M, in) @ w.T (+ b (out,)): one row is a gemv over slices of w's rows
    (memory-bound: w read once, no packing); more rows a gemm, w.T passed as a flag and
    the bias added by each of its blocks as it finishes (no second pass over the output)."""
    nt = _core.get_num_threads()
    if x2d.shape[0] == 1:
        return _gemv.gemv(w, x2d, bias=b, num_threads=nt)
    return _blas.gemm(x2d, w.T, num_threads=nt, bias=b)


def _linear_shape_error(x, w):
    raise ShapeError(f"linear: input shape {x.shape} and weight shape {w.shape} do not fit "
                     f"(input's last dim must equal in_features = {w.shape[-1]})")


def _expands_to(shape, target):
    """torch's expand(): shape fits target from the right, each dim equal or 1."""
    return len(shape) <= len(target) and all(
        s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def _linear_general(input, weight, bias, x, w, b):
    """linear's other cases, as torch 2.13 takes them. x @ w.T is computed as for a 2-D
    weight (a 1-D weight is a (1, in) one, its output dim dropped). Where the bias goes
    follows torch's two paths, since they accept different shapes:
      - fused (addmm on x flattened to (M, in)): x is 2-D, or x is contiguous and the bias
        is 1-D or has exactly one dim that is not 1; the bias must expand to (M, out),
        and the weight must be 2-D;
      - otherwise the product, then the bias added in place: it must broadcast to the
        output's shape without growing it."""
    if x.ndim == 0 or w.ndim == 0:
        raise ShapeError(f"linear: both arguments need to be at least 1-D, but they are "
                         f"{x.ndim}-D and {w.ndim}-D")
    if w.ndim > 2:
        raise ShapeError(f"linear: weight must be 1-D (in_features,) or 2-D (out_features, "
                         f"in_features), got shape {w.shape}")
    if x.shape[-1] != w.shape[-1]:
        _linear_shape_error(x, w)
    w2d = w.reshape(1, -1) if w.ndim == 1 else w         # (out, in); a view
    M, N = math.prod(x.shape[:-1]), w2d.shape[0]
    out_shape = x.shape[:-1] + ((N,) if w.ndim == 2 else ())
    bias_against = None
    if b is not None:
        fused = x.ndim == 2 or (x.flags.c_contiguous and
                                (b.ndim == 1 or sum(d != 1 for d in b.shape) == 1))
        if fused:
            if w.ndim != 2:
                raise ShapeError(f"linear: a bias of shape {b.shape} with a 1-D weight "
                                 f"{w.shape} needs a 2-D weight (torch's addmm path)")
            bias_against = (M, N)
            if not _expands_to(b.shape, bias_against):
                raise ShapeError(f"linear: bias shape {b.shape} does not expand to the "
                                 f"flattened output's ({M}, {N})")
        else:
            bias_against = out_shape
            if not _expands_to(b.shape, out_shape):
                raise ShapeError(f"linear: bias shape {b.shape} does not broadcast to the "
                                 f"output's shape {out_shape}")
    x2d = x.reshape(M, w2d.shape[1])                    # (M, in)
    out2d = _linear_forward(x2d, w2d, None)             # (M, out)
    if b is not None:
        view = out2d.reshape(bias_against)
        view += b                                       # broadcast, in place: no new array
    out = wrap(out2d.reshape(out_shape))
    inputs = (input, weight) if bias is None else (input, weight, bias)
    if needs_graph(inputs):
        node = LinearBackward()
        node.x2d, node.weight, node.x_shape = x2d, w2d, x.shape
        node.weight_shape, node.bias_against = w.shape, bias_against
        node.bias_shape = None if b is None else b.shape
        attach(out, node, inputs)
    return out


# ---- embedding -------------------------------------------------------------------

class EmbeddingBackward(FusedNode):
    """y = W[idx];  dW[idx[i]] += g[i]   (repeated ids accumulate; kernel: embedding_backward)"""

    def backward(self, g):
        # only the rows the ids name: the engine adds them into the weight's gradient
        # (a (V, D) zero fill and a (V, D) addition where the table is tied to a linear)
        V, D = self.weight_shape
        ids = self.ids
        g2 = np.ascontiguousarray(g, dtype=self.dtype).reshape(ids.shape[0], D)
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, g2 = np.ascontiguousarray(ids[keep]), np.ascontiguousarray(g2[keep])
        return (None, _core.RowsGrad(ids, g2, (V, D), self.dtype, _add_rows))

    def composite(self, ids, w):
        """y = W[idx], with no gradient into row padding_idx"""
        if self.padding_idx is not None:
            keep = np.ones((w.shape[0], 1), dtype=bool)
            keep[self.padding_idx] = False
            w = _core.where(keep, w, w.detach())
        return _core.reshape(_core.getitem(w, self.ids), self.out_shape)


declare_saved(EmbeddingBackward)           # its indices are a private copy


def _add_rows(out, rows, ids):
    """out[ids[i]] += rows[i], repeated ids adding up (the kernel checks every id)."""
    if not rows.size:
        return
    if out.dtype == rows.dtype and out.flags.c_contiguous and out.flags.writeable:
        _kernels.fused.embedding_backward(out, rows, ids, _threads(rows.size, memory_bound=True))
    else:                                   # a .grad the user set in another layout
        np.add.at(out, ids, rows)


def embedding(input, weight, padding_idx=None):
    """y = W[idx]   (idx int64 of any shape, W (num_embeddings, embedding_dim))"""
    w = _float_array(weight, "embedding weight")
    idx = input._data if isinstance(input, Tensor) else np.asarray(input)
    if idx.dtype.kind not in "iu":
        raise DtypeError(f"embedding: indices must be an integer (int64) tensor, got dtype {idx.dtype}")
    if w.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {w.shape}")
    V, D = w.shape
    ids = _owned_indices(idx)                           # (M,), checked below, kept for backward
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        raise IndexError(f"embedding: index {int(ids[np.argmax(bad)])} is out of range for "
                         f"num_embeddings={V} (valid: 0 to {V - 1})")
    if padding_idx is not None:
        padding_idx = int(padding_idx)
        if padding_idx < 0:
            padding_idx += V
        if not 0 <= padding_idx < V:
            raise IndexError(f"embedding: padding_idx {padding_idx} is out of range for num_embeddings={V}")
    out = np.empty((ids.shape[0], D), dtype=w.dtype)     # (M, D)
    if out.size:
        _kernels.fused.embedding_forward(out, ids, _contig(w), _threads(out.size, memory_bound=True))
    out = wrap(out.reshape(idx.shape + (D,)))
    if needs_graph((weight,)):
        node = EmbeddingBackward()
        node.ids, node.weight_shape, node.dtype, node.padding_idx = ids, w.shape, w.dtype, padding_idx
        node.out_shape = idx.shape + (D,)
        attach(out, node, (None, weight))
    return out


# ---- dropout ---------------------------------------------------------------------

class DropoutBackward(FusedNode):
    """y = x * m / (1 - p);  dx = g * m / (1 - p)   (m: the kept positions)"""

    def backward(self, g):
        return (np.asarray(g * self.mask),)

    def composite(self, x):
        """y = x * m / (1 - p)   (self.mask holds m / (1 - p))"""
        return _core.mul(x, self.mask)


declare_saved(DropoutBackward)               # only its own mask


def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability p and scale the rest by 1/(1-p) (training only).
    inplace=True writes the result into input and returns input (its version counts one
    change), as torch: refused for a leaf that requires grad; on a non-leaf the tensor
    becomes the dropout's output in the graph (see _dropout_in_place)."""
    x = _tensor(input, "dropout input")
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) \
            or not (0.0 <= p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return x
    watched = needs_graph((input,))
    if inplace:
        _check_dropout_in_place(x, watched)
    d = _contig(_float_array(x, "dropout input"))
    if p == 1:
        mask = np.zeros(d.shape, dtype=d.dtype)
        out = np.zeros_like(d)
    else:
        uniform = _core.default_generator().random(d.size, dtype=np.float32)
        mask = np.empty_like(d)
        # in place on contiguous storage: the kernel writes each element over itself
        out = x._data if inplace and d is x._data else np.empty_like(d)
        _kernels.fused.dropout_forward(out.reshape(-1), mask.reshape(-1), d.reshape(-1), uniform,
                               float(p), _threads(d.size, memory_bound=True))
    if inplace:
        return _dropout_in_place(x, out, mask, watched)
    out = wrap(out)
    if watched:
        node = DropoutBackward()
        node.mask = mask
        attach(out, node, (input,))
    return out


def _check_dropout_in_place(x, watched):
    """What is refused before an in-place dropout changes anything: a leaf that requires
    grad (torch's words), and, unlike torch, any tensor autograd is watching. NOTE: the
    engine records no in-place op in the graph (tensor.pxi's _check_inplace says why), and
    a node that read x before the dropout without saving it (x + 1, x.sum(), a view of x)
    would send its gradient through the mask: refused, not a silently wrong gradient."""
    if watched and x._node is None:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    if watched:
        raise RuntimeError(
            f"F.dropout(..., inplace=True) on a tensor that requires grad (made by "
            f"{x._node.name()}) is not recorded by microtensor's autograd; use inplace=False "
            f"(nn.Dropout(p) without inplace), or run it under mt.no_grad()")
    if not x._data.flags.writeable:
        raise RuntimeError("dropout: this tensor's storage is read-only (an expanded or "
                           "broadcast view); clone() it before an in-place dropout")


def _dropout_in_place(x, out, mask, watched):
    """x's storage takes the result (out, unless the kernel already wrote there), its
    version counts the change, and x is returned (no autograd is watching: see
    _check_dropout_in_place)."""
    if out is not x._data:
        np.copyto(x._data, out)
    x._bump_version()
    return x


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

_core.register_op("linear", linear, kind="matmul", scope="F")
_core.register_op("embedding", embedding, kind="index", scope="F")
_core.register_op("dropout", dropout, kind="random", scope="F",
                  aliasing="view_or_copy")     # its input itself when p == 0 or not training
