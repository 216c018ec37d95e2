# cython: embedsignature=True, wraparound=True, boundscheck=True
# (wraparound and bounds checks stay on for this Python-level code: shape[-1] must mean
#  the last dim, and shape[d] of a wrong d must raise, not read past the tuple. The
#  kernels in kernels.pxi turn both off one by one, after checking their arguments.)
"""microtensor's core: the Tensor, the graph Node, the autograd engine, and the ops.

The source is split by concept into include files beside this one, all compiled
into this one extension so that ops reach tensors' fields at C speed:

  errors.pxi          ShapeError and the dim / argument validators
  kernels.pxi         Cython kernels (typed memoryviews, nogil, prange) of the core ops
  grad_mode.pxi       grad mode and anomaly mode, per thread (no_grad, enable_grad)
  versions.pxi        version counters: in-place changes to saved tensors are caught
  autograd_engine.pxi Node, the backward traversal (iterative, topological)
  dtypes.pxi          the numpy dtypes of the core, devices, torch-style dtype names
  capture_hook.pxi    the one door mt.compile watches: value reads, writes, new tensors
  tensor.pxi          Tensor, Parameter
  registry.pxi        the op registry: one row makes mt.<op>, t.<op>() and the operator
  creation.pxi        creation functions, the random generator
  graph_helpers.pxi   what the create-graph rules (each node's create_graph) share
  ops_pointwise.pxi   + - * / **, where, masked_fill, casts
  ops_unary.pxi       exp, log, sqrt, tanh, sigmoid, relu, abs, clamp
  ops_logical.pxi     comparisons, logical ops, isnan/isfinite (bool results, no gradient)
  ops_reduce.pxi      sum, mean, var, amax/max, argmax, logsumexp
  ops_shape.pxi       reshape/view, permute, expand, cat/stack, split, indexing
  ops_matmul.pxi      matmul (2-D and 3-D float products through microtensor._blas)

Each op is a Backward node class (its rule, math in the first docstring line) with
the forward function right below it.
"""
import numpy as np
cimport numpy as cnp

cnp.import_array()

include "errors.pxi"
include "kernels.pxi"
include "grad_mode.pxi"
include "versions.pxi"
include "autograd_engine.pxi"
include "dtypes.pxi"
include "capture_hook.pxi"
include "tensor.pxi"
include "registry.pxi"
include "creation.pxi"
include "graph_helpers.pxi"
include "ops_pointwise.pxi"
include "ops_unary.pxi"
include "ops_logical.pxi"
include "ops_reduce.pxi"
include "ops_shape.pxi"
include "ops_matmul.pxi"
