# cython: embedsignature=True, wraparound=True, boundscheck=True
# (wraparound and bounds checks stay on for this Python-level code: shape[-1] must mean
#  the last dim, and shape[d] of a wrong d must raise, not read past the tuple. The
#  kernels in kernels/core_kernels.pxi turn both off one by one, after checking their arguments.)
"""microtensor's core: the Tensor, the graph Node, the autograd engine, and the ops.

The source is split by concept into include files (the core's own beside this one, the
op families in ../ops, the kernels in ../kernels), all compiled into this one extension
so that ops reach tensors' fields at C speed:

  core/errors.pxi           ShapeError and the dim / argument validators
  kernels/core_kernels.pxi  Cython kernels (typed memoryviews, nogil, prange) of the core ops
  core/grad_mode.pxi        grad mode and anomaly mode, per thread (no_grad, enable_grad)
  core/versions.pxi         version counters: in-place changes to saved tensors are caught
  core/slice_grads.pxi      the gradients of slices, built into one buffer per tensor
  core/broadcast.pxi        a gradient summed down to its input's shape: broadcasting undone once
  core/engine.pxi           Node, the backward traversal (iterative, topological)
  core/leaf_grads.pxi       a leaf's gradients summed as they arrive, then .grad (taken over, not copied, when unshared)
  core/numpy_dtypes.pxi     the numpy dtypes of the core, devices, torch-style dtype names
  core/capture_hook.pxi     the one door mt.compile watches: value reads, writes, new tensors
  core/tensor.pxi           Tensor, Parameter
  core/registry.pxi         the op registry: one row makes mt.<op>, t.<op>() and the operator
  ops/creation.pxi          creation functions, the random generator
  core/graph_helpers.pxi    what the create-graph rules (each node's create_graph) share
  ops/pointwise.pxi         + - * / **, where, masked_fill, casts
  ops/unary.pxi             exp, log, sqrt, tanh, sigmoid, relu, abs, clamp
  ops/logical.pxi           comparisons, logical ops, isnan/isfinite (bool results, no gradient)
  ops/reduce.pxi            sum, mean, var, amax/max, argmax, logsumexp
  ops/shape.pxi             reshape/view, permute, expand, cat/stack, split, diagonal
  ops/indexing.pxi          x[key] and index_select (views for basic keys)
  ops/matmul.pxi            matmul (2-D and 3-D float products through microtensor.kernels._blas)

Each op is a Backward node class (its rule, math in the first docstring line) with
the forward function right below it.
"""
import numpy as np
cimport numpy as cnp

cnp.import_array()

include "errors.pxi"
include "../kernels/core_kernels.pxi"
include "grad_mode.pxi"
include "versions.pxi"
include "slice_grads.pxi"
include "broadcast.pxi"
include "engine.pxi"
include "leaf_grads.pxi"
include "numpy_dtypes.pxi"
include "capture_hook.pxi"
include "tensor.pxi"
include "registry.pxi"
include "../ops/creation.pxi"
include "graph_helpers.pxi"
include "../ops/pointwise.pxi"
include "../ops/unary.pxi"
include "../ops/logical.pxi"
include "../ops/reduce.pxi"
include "../ops/shape.pxi"
include "../ops/indexing.pxi"
include "../ops/matmul.pxi"
