"""The ops, one file per family. The families compiled into the core are the .pxi files
here (pointwise, unary, logical, reduce, shape, matmul, creation); the families written in
Python are the .py modules (extra, compare, creation_extra, index, inplace, linalg, nan).
Every op has one registry row, made where the op is defined."""
