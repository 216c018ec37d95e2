# cython: embedsignature=True, wraparound=True
# (wraparound stays on for this Python-level code: shape[-1] must mean the last
#  dim. The kernels turn it off one by one.)
"""microtensor's core: the Tensor, the graph Node, the autograd engine, and the ops.

The source is split by concept into include files beside this one, all compiled
into this one extension so that ops reach tensors' fields at C speed:

  errors.pxi          ShapeError and the dim / argument validators
  kernels.pxi         Cython kernels (typed memoryviews, nogil, prange) of the core ops
  autograd_engine.pxi Node, grad mode, the backward traversal (iterative, topological)
  tensor.pxi          Tensor, Parameter, creation functions, the random generator
  ops_pointwise.pxi   + - * / ** and unary ops, where, masked_fill, comparisons
  ops_reduce.pxi      sum, mean, var, amax/max, argmax, softmax, log_softmax
  ops_shape.pxi       reshape/view, permute, expand, cat/stack, split, indexing
  ops_matmul.pxi      matmul (every product goes to BLAS through microtensor._blas)

Each op is a Backward node class (its rule, math in the first docstring line) with
the forward function right below it.
"""
import numpy as np
cimport numpy as cnp

cnp.import_array()

include "errors.pxi"
include "kernels.pxi"
include "autograd_engine.pxi"
include "tensor.pxi"
include "ops_pointwise.pxi"
include "ops_reduce.pxi"
include "ops_shape.pxi"
include "ops_matmul.pxi"
