"""The ops, one file per family, and the registry that lists them.

The families compiled into the core are the .pxi files here (pointwise, unary, logical,
reduce, shape, matmul, creation); the families written in Python are the .py modules
(extra, compare, creation_extra, index, inplace, linalg, nan). Each family file closes
with its registry rows: one row per op, which makes `mt.<name>` and `t.<name>()` and says
the op's class. `mt.ops.registry()` lists the rows:

    >>> [row.name for row in mt.ops.registry("matmul")][:3]
    ['matmul', 'addmm', 'mm']
"""
from microtensor.core._core import registered_ops, KINDS

__all__ = ["registry", "KINDS"]


def registry(kind=None):
    """The op registry's rows, in the order they were registered: each has `name`,
    `function` (mt.<name>, when `export`), `method` (what t.<name>(...) calls, or None),
    `operator` (the symbol Python spells it with, or None), `kind` (one of KINDS) and
    `module` (where its rule lives). With `kind`, the rows of that class only."""
    return registered_ops(kind)
