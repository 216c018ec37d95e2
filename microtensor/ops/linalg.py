"""Products and norms: einsum, bmm, mm, mv, dot, outer, tensordot, vector and matrix norms.

einsum is composed from the core's permute / reshape / expand / sum / matmul (and an
advanced index for repeated subscripts), so its gradient is the sum of checked rules.
A vector norm has its own node: composing sqrt(sum(x^2)) would give a NaN gradient at
the zero vector, where torch gives 0.
"""
import builtins
import math

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, Node, wrap, needs_graph, attach, register_op, register_ops
from microtensor.autograd.graph_rules import _keepdim, _const, DifferentiableRule
from microtensor.ops._common import _tensor, _dim, _dims, _float, declare_saved
from microtensor.core._core import diagonal


# ---- matrix products -------------------------------------------------------------------

def _check_ndim(x, ndim, op, what):
    _tensor(x, op, what)
    if x.ndim != ndim:
        raise RuntimeError(f"{op}(): {what} must be a {ndim}-D tensor, got {x.ndim}-D "
                           f"(shape {x.shape})")


def _check_inner(a, b, op, da=-1, db=0):
    if a.shape[da] != b.shape[db]:
        raise _core.ShapeError(f"{op}(): shapes {a.shape} and {b.shape} cannot be multiplied "
                               f"({a.shape[da]} != {b.shape[db]})")


def mm(input, mat2):
    """(n, m) @ (m, p) -> (n, p)"""
    _check_ndim(input, 2, "mm", "self")
    _check_ndim(mat2, 2, "mm", "mat2")
    _check_inner(input, mat2, "mm")
    return _core.matmul(input, mat2)


def bmm(input, mat2):
    """(b, n, m) @ (b, m, p) -> (b, n, p), no broadcasting (as torch's)"""
    _check_ndim(input, 3, "bmm", "batch1")
    _check_ndim(mat2, 3, "bmm", "batch2")
    if input.shape[0] != mat2.shape[0]:
        raise _core.ShapeError(f"bmm(): batch sizes differ: {input.shape} and {mat2.shape}")
    _check_inner(input, mat2, "bmm", -1, 1)
    return _core.matmul(input, mat2)


def mv(input, vec):
    """(n, m) @ (m,) -> (n,)"""
    _check_ndim(input, 2, "mv", "self")
    _check_ndim(vec, 1, "mv", "vec")
    _check_inner(input, vec, "mv")
    return _core.reshape(_core.matmul(input, _core.reshape(vec, -1, 1)), -1)


def dot(input, other):
    """sum(a * b) of two 1-D tensors of one size"""
    _check_ndim(input, 1, "dot", "self")
    _check_ndim(other, 1, "dot", "tensor")
    if input.shape != other.shape:
        raise _core.ShapeError(f"dot(): inconsistent tensor size, expected tensor [{input.shape[0]}] "
                               f"and src [{other.shape[0]}] to have the same number of elements")
    return _core.sum(_core.mul(input, other))


vdot = dot


def inner(input, other):
    """sum over the last dims: inner(a, b)[i.., j..] = sum_k a[i.., k] b[j.., k]"""
    if input.ndim == 0 or other.ndim == 0:
        return _core.mul(input, other)
    _check_inner(input, other, "inner", -1, -1)
    return tensordot(input, other, ([-1], [-1]))


def outer(input, vec2):
    """out[i, j] = a[i] b[j]"""
    _check_ndim(input, 1, "outer", "self")
    _check_ndim(vec2, 1, "outer", "vec2")
    return _core.mul(_core.unsqueeze(input, 1), _core.unsqueeze(vec2, 0))


ger = outer


def baddbmm(input, batch1, batch2, beta=1, alpha=1):
    prod = bmm(batch1, batch2)
    return _core.add(_core.mul(input, beta) if beta != 1 else input,
                     _core.mul(prod, alpha) if alpha != 1 else prod)


def tensordot(a, b, dims=2):
    """Contract dims of a with dims of b: an int n (last n of a with first n of b) or a
    pair of lists. One permute + reshape per operand and one matmul."""
    if isinstance(dims, (int, np.integer)):
        if dims < 0:
            raise RuntimeError(f"tensordot expects dims >= 0, but got dims={dims}")
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = dims
        da = [da] if isinstance(da, int) else list(da)
        db = [db] if isinstance(db, int) else list(db)
    da = [_dim(d, a.ndim, "tensordot") for d in da]
    db = [_dim(d, b.ndim, "tensordot") for d in db]
    if len(da) != len(db):
        raise RuntimeError("tensordot: both dim lists must have the same length")
    for x, y in zip(da, db):
        if a.shape[x] != b.shape[y]:
            raise _core.ShapeError(f"tensordot: contracted dimensions need to match, but first "
                                   f"has size {a.shape[x]} in dim {x} and second has size "
                                   f"{b.shape[y]} in dim {y}")
    free_a = [d for d in range(a.ndim) if d not in da]
    free_b = [d for d in range(b.ndim) if d not in db]
    k = math.prod(a.shape[d] for d in da)
    left = _core.reshape(_core.permute(a, *free_a, *da), -1, k) if a.ndim else \
        _core.reshape(a, 1, 1)
    right = _core.reshape(_core.permute(b, *db, *free_b), k, -1) if b.ndim else \
        _core.reshape(b, 1, 1)
    out = _core.matmul(left, right)
    return _core.reshape(out, *[a.shape[d] for d in free_a], *[b.shape[d] for d in free_b])


def cross(input, other, dim=None):
    """The cross product of 3-vectors along dim (the first dim of size 3 when None)"""
    a, b = _tensor(input, "cross"), _tensor(other, "cross", "other")
    shape = np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    if dim is None:
        dim = next((i for i, n in enumerate(shape) if n == 3), None)
        if dim is None:
            raise RuntimeError(f"cross: no dimension of size 3 in shape {shape}")
    d = _dim(dim, len(shape), "cross")
    if shape[d] != 3:
        raise RuntimeError(f"cross: dimension {d} does not have size 3 (shape {shape})")
    a, b = _core.expand(a, *shape), _core.expand(b, *shape)
    head = (slice(None),) * d
    ax, ay, az = (_core.getitem(a, head + (i,)) for i in range(3))
    bx, by, bz = (_core.getitem(b, head + (i,)) for i in range(3))
    return _core.stack([_core.sub(_core.mul(ay, bz), _core.mul(az, by)),
                        _core.sub(_core.mul(az, bx), _core.mul(ax, bz)),
                        _core.sub(_core.mul(ax, by), _core.mul(ay, bx))], d)


def kron(input, other):
    """The Kronecker product: out[i*m + k, ...] = a[i, ...] b[k, ...] on every dim"""
    a, b = _tensor(input, "kron"), _tensor(other, "kron", "other")
    n = builtins.max(a.ndim, b.ndim)
    a = _core.reshape(a, *([1] * (n - a.ndim) + list(a.shape)))
    b = _core.reshape(b, *([1] * (n - b.ndim) + list(b.shape)))
    # (a0, 1, a1, 1, ...) * (1, b0, 1, b1, ...) -> (a0 b0, a1 b1, ...)
    ai = _core.reshape(a, *[v for s in a.shape for v in (s, 1)])
    bi = _core.reshape(b, *[v for s in b.shape for v in (1, s)])
    return _core.reshape(_core.mul(ai, bi), *[x * y for x, y in zip(a.shape, b.shape)])


# ---- einsum ----------------------------------------------------------------------------

_ELLIPSIS_BASE = 0x2460          # private symbols for the dims an ellipsis covers


def _parse_term(term, ndim, n_ellipsis, where):
    """Subscripts of one operand as a list of symbols (ellipsis dims as private ones,
    aligned from the right)."""
    if term.count("...") > 1 or ("." in term.replace("...", "")):
        raise ValueError(f"einsum(): invalid subscript {term!r} in {where}")
    letters = term.replace("...", "")
    for c in letters:
        if not c.isalpha():
            raise ValueError(f"einsum(): invalid subscript {c!r} in {where}: subscripts must "
                             "be letters in [a-zA-Z]")
    if "..." not in term:
        if len(letters) != ndim:
            raise ValueError(f"einsum(): the number of subscripts in {term!r} ({len(letters)}) "
                             f"does not match the number of dimensions ({ndim})")
        return list(letters)
    covered = ndim - len(letters)
    if covered < 0:
        raise ValueError(f"einsum(): {term!r} has more subscripts than dimensions ({ndim})")
    head, tail = term.split("...")
    ell = [chr(_ELLIPSIS_BASE + n_ellipsis - covered + i) for i in range(covered)]
    return list(head) + ell + list(tail)


def _sum_out(x, syms, keep):
    axes = tuple(i for i, s in enumerate(syms) if s not in keep)
    if axes:
        x = _core.sum(x, dim=axes)
        syms = [s for s in syms if s in keep]
    return x, syms


def _take_diagonals(x, syms):
    """A symbol repeated within one operand ('ii') selects the diagonal."""
    while len(set(syms)) != len(syms):
        s = next(s for s in syms if syms.count(s) > 1)
        p = syms.index(s)
        q = syms.index(s, p + 1)
        if x.shape[p] != x.shape[q]:
            raise ValueError(f"einsum(): subscript {s!r} is repeated for an operand but the "
                             f"sizes don't match, {x.shape[p]} != {x.shape[q]}")
        x = diagonal(x, 0, p, q)
        syms = [c for i, c in enumerate(syms) if i not in (p, q)] + [s]
    return x, syms


def _contract(a, sa, b, sb, keep, sizes):
    """One pairwise step: batch (shared, kept), contracted (shared, not kept), left-only,
    right-only symbols; one permute + reshape each and a batched matmul."""
    batch = [s for s in sa if s in sb and s in keep]
    contracted = [s for s in sa if s in sb and s not in keep]
    left = [s for s in sa if s not in sb]
    right = [s for s in sb if s not in sa]

    def arrange(x, sx, order):
        x = _core.permute(x, *[sx.index(s) for s in order]) if order != sx else x
        target = [sizes[s] for s in order]
        if list(x.shape) != target:                  # a size-1 dim broadcast against n
            x = _core.expand(x, *target)
        return x

    n_b = math.prod(sizes[s] for s in batch)
    n_l = math.prod(sizes[s] for s in left)
    n_c = math.prod(sizes[s] for s in contracted)
    n_r = math.prod(sizes[s] for s in right)
    x = _core.reshape(arrange(a, sa, batch + left + contracted), n_b, n_l, n_c)
    y = _core.reshape(arrange(b, sb, batch + contracted + right), n_b, n_c, n_r)
    out = _core.matmul(x, y)                                        # (n_b, n_l, n_r)
    order = batch + left + right
    return _core.reshape(out, *[sizes[s] for s in order]), order


def einsum(equation, *operands):
    """Einstein summation, e.g. einsum('bij,bjk->bik', a, b), 'i,j->ij', 'ii', 'ij->ji',
    '...ij,...jk->...ik'. Implicit output (no '->'): the symbols used once, sorted."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str):
        raise TypeError(f"einsum(): equation must be a str, got {type(equation).__name__}")
    for x in operands:
        _tensor(x, "einsum", "every operand")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum(): {len(terms)} subscript terms in {equation!r} but "
                         f"{len(operands)} operands")
    n_ell = builtins.max([x.ndim - len(t.replace("...", "")) for t, x in zip(terms, operands)
                          if "..." in t] or [0])
    syms = [_parse_term(t, x.ndim, n_ell, equation) for t, x in zip(terms, operands)]
    ellipsis = [chr(_ELLIPSIS_BASE + i) for i in range(n_ell)]
    if arrow:
        out_syms = _parse_term(rhs, len(rhs.replace("...", "")) + (n_ell if "..." in rhs else 0),
                               n_ell, equation)
        if len(set(out_syms)) != len(out_syms):
            raise ValueError(f"einsum(): output subscript repeated in {equation!r}")
        used = {s for ss in syms for s in ss}
        for s in out_syms:
            if s not in used:
                raise ValueError(f"einsum(): output subscript {s!r} does not appear in the "
                                 f"equation for any input operand")
    else:
        counts = {}
        for ss in syms:
            for s in ss:
                counts[s] = counts.get(s, 0) + 1
        out_syms = ellipsis + sorted(s for s, c in counts.items() if c == 1 and s not in ellipsis)

    sizes = {}
    for x, ss in zip(operands, syms):
        for s, n in zip(ss, x.shape):
            if sizes.get(s, 1) != 1 and n != 1 and n != sizes[s]:
                raise _core.ShapeError(f"einsum(): operands do not broadcast: subscript {s!r} "
                                       f"has sizes {sizes[s]} and {n} in {equation!r}")
            sizes[s] = builtins.max(sizes.get(s, 1), n) if s in sizes else n

    # each operand alone: diagonals, then sum out what no one else needs
    items = []
    for i, (x, ss) in enumerate(zip(operands, syms)):
        x, ss = _take_diagonals(x, list(ss))
        others = {s for j, o in enumerate(syms) if j != i for s in o}
        x, ss = _sum_out(x, ss, set(out_syms) | others)
        items.append((x, ss))

    x, sx = items[0]
    for i in range(1, len(items)):
        y, sy = items[i]
        keep = set(out_syms) | {s for _, later in items[i + 1:] for s in later}
        x, sx = _sum_out(x, sx, keep | set(sy))
        y, sy = _sum_out(y, sy, keep | set(sx))
        x, sx = _contract(x, sx, y, sy, keep, sizes)
    x, sx = _sum_out(x, sx, set(out_syms))
    if sx != out_syms:
        x = _core.permute(x, *[sx.index(s) for s in out_syms])
    target = [sizes[s] for s in out_syms]
    if list(x.shape) != target:
        x = _core.expand(x, *target)
    return x


# ---- norms -----------------------------------------------------------------------------

class VectorNormBackward(DifferentiableRule):
    """y = (sum |x|^p)^(1/p);  dx = g sign(x) |x|^(p-1) / y^(p-1)   (0 where y = 0)"""

    def create_graph(self, g):
        """y = (sum |x|^p)^(1/p);  dx = g sign(x) |x|^(p-1) / y^(p-1)   (0 where y = 0)"""
        x, p, dims = self.inputs[0], self.p, self.dims
        g = _keepdim(g, x.shape, dims, self.keepdim)
        sign = _const(np.sign(self.x), g.dtype)
        if p == 1:
            return (_core.mul(g, sign),)
        y0 = self.y if self.keepdim or not dims else np.expand_dims(self.y, dims)
        zero = y0 == 0
        if p == 2:
            y = _core.sqrt(_core.sum(_core.mul(x, x), dims, True))
            local = _core.div(x, _core.where(zero, 1.0, y))
        else:
            ax = _core.abs(x)
            y = _core.pow(_core.sum(_core.pow(ax, p), dims, True), 1.0 / p)
            local = _core.div(_core.mul(sign, _core.pow(ax, p - 1)), _core.pow(_core.where(zero, 1.0, y), p - 1))
        return (_core.where(zero, 0.0, _core.mul(g, local)),)


declare_saved(VectorNormBackward, 0, output=True)


def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    """(sum |x|^ord)^(1/ord) over dim (all dims when None); ord may be inf, -inf or 0."""
    t = _tensor(x, "vector_norm")
    if dtype is not None:
        t = t.to(dtype)
    if t._data.dtype.kind != "f":
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point tensor as input, "
                           f"got {t._data.dtype}")
    dims = _dims(dim, t._data.ndim, "vector_norm") if dim is not None else tuple(range(t.ndim))
    p = float(ord)
    if math.isinf(p):
        reduce = _core.amax if p > 0 else _core.amin
        return reduce(_core.abs(t), dim=dims, keepdim=keepdim) if dims else _core.abs(t)
    if p == 0:
        out = np.count_nonzero(t._data, axis=dims, keepdims=keepdim)
        return wrap(np.asarray(out, dtype=t._data.dtype))
    a = _float(t._data)
    with np.errstate(over="ignore"):
        if p == 2:
            y = np.sqrt(np.sum(a * a, axis=dims, keepdims=keepdim))
        elif p == 1:
            y = np.sum(np.abs(a), axis=dims, keepdims=keepdim)
        else:
            y = np.sum(np.abs(a) ** p, axis=dims, keepdims=keepdim) ** (1 / p)
    y = np.asarray(y, dtype=a.dtype)
    out = wrap(y)
    if needs_graph((t,)):
        node = VectorNormBackward()
        node.x, node.y, node.p, node.dims, node.keepdim = a, y, p, dims, keepdim
        attach(out, node, (t,))
    return out


def matrix_norm(A, ord="fro", dim=(-2, -1), keepdim=False, dtype=None):
    """The Frobenius norm of the matrices in the last two dims (other ords: not yet)."""
    if ord != "fro":
        raise NotImplementedError(f"linalg.matrix_norm: ord={ord!r} is not implemented "
                                  "(only 'fro')")
    if len(dim) != 2:
        raise RuntimeError(f"linalg.matrix_norm: dim must be a 2-tuple, got {dim}")
    return vector_norm(A, 2, dim, keepdim, dtype)


def linalg_norm(A, ord=None, dim=None, keepdim=False, dtype=None):
    """torch.linalg.norm: a vector norm for 1-D input or an int dim, the Frobenius norm
    for 2-D input or a 2-tuple dim; ord=None with dim=None flattens (2-norm)."""
    if isinstance(dim, int) or (isinstance(dim, (tuple, list)) and len(dim) == 1):
        return vector_norm(A, 2 if ord is None else ord, dim, keepdim, dtype)
    if dim is None:
        if ord is None:
            return vector_norm(A, 2, None, keepdim, dtype)
        if A.ndim == 1:
            return vector_norm(A, ord, None, keepdim, dtype)
        if A.ndim != 2:
            raise RuntimeError(f"linalg.norm: input must be 1-D or 2-D when ord is given and "
                               f"dim is None, got {A.ndim}-D")
        dim = (-2, -1)
    return matrix_norm(A, "fro" if ord is None else ord, dim, keepdim, dtype)


def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """torch.norm: 'fro' (or 2) is the 2-norm over dim (all dims when None); numbers and
    inf give vector p-norms."""
    if p == "fro" or p is None:
        p = 2
    if p == "nuc":
        raise NotImplementedError("norm(p='nuc') is not implemented")
    return vector_norm(input, p, dim, keepdim, dtype)


def dist(input, other, p=2):
    """The p-norm of input - other."""
    return vector_norm(_core.sub(input, other), p)


def cdist(x1, x2, p=2.0):
    """Pairwise p-norm distances between the rows of x1 (.., P, M) and x2 (.., R, M)."""
    diff = _core.sub(_core.unsqueeze(x1, -2), _core.unsqueeze(x2, -3))      # (.., P, R, M)
    return vector_norm(diff, p, dim=-1)


# ---- the registry rows: mt.<name>, and t.<name>(...) calling fn(t, ...) ----------------

register_ops("matmul", globals(), "mm bmm mv dot vdot inner outer ger baddbmm kron")
register_ops("matmul", globals(), "tensordot", method=False)
# einsum of one operand that only moves or picks dims ("ij->ji", "ii->i") is a view, as torch's
register_ops("matmul", globals(), "einsum", method=False, aliasing="view_or_copy")
register_ops("reduction", globals(), "norm dist")
register_ops("reduction", globals(), "cdist", method=False)
register_ops("pointwise", globals(), "cross")


register_ops("reduction", globals(), "vector_norm matrix_norm", scope="linalg")
register_op("norm", linalg_norm, kind="reduction", scope="linalg")
