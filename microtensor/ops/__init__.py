"""The ops, one file per family, and the registry that lists them.

The families compiled into the core are the .pxi files here (pointwise, unary, logical,
reduce, shape, matmul, creation); the families written in Python are the .py modules
(extra, compare, creation_extra, index, inplace, linalg, nan). Each family file closes
with its registry rows: one row per op, which makes `mt.<name>` and `t.<name>()` and says
the op's class and whether its result is a view of its input or a copy (as torch's same
op). `mt.ops.registry()` lists the rows:

    >>> [row.name for row in mt.ops.registry("matmul")][:3]
    ['matmul', 'addmm', 'mm']
"""
from microtensor.core._core import registered_ops, KINDS, ALIASINGS

__all__ = ["registry", "KINDS", "ALIASINGS"]


def registry(kind=None, aliasing=None):
    """The op registry's rows, in the order they were registered: each has `name`,
    `function` (mt.<name>, when `export`), `method` (what t.<name>(...) calls, or None),
    `operator` (the symbol Python spells it with, or None), `kind` (one of KINDS),
    `aliasing` (one of ALIASINGS: "view", "copy", "view_or_copy", "inplace", "none") and
    `module` (where its rule lives). With `kind` or `aliasing`, those rows only."""
    return registered_ops(kind, aliasing)
