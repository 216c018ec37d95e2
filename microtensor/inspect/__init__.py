"""mt.inspect: instruments for seeing backprop.

The tools, all built on the engine's public pieces (`t.register_hook`,
`t.retain_grad()`, `grad_fn.name()`, `node.inputs`, Module's forward hooks and the
engine's per-node backward hook):

- `GradientRecorder` (recorder.py): for one backward pass, the norm of the gradient
  arriving at chosen tensors, or at the input and output of every module call, with a
  residual block's input gradient split into the part that came through the skip path
  and the part that came through the branch (residual.py).
- `track_modules` (calls.py): remembers which module call created which graph node
  (the recorder and the graph exporter use it to name and group things).
- `to_dot` / `render` / `build_graph` (graph.py): the computation graph behind a tensor
  as Graphviz DOT text, and as a PNG (through `dot` when Graphviz is installed,
  otherwise drawn with matplotlib as a layered DAG: drawing.py).
- `compare_grads` (compare.py): gradients worked out by hand against the engine's, one
  line per tensor in backward order, the first wrong one named with its rule's math.
- `BackwardTrace` / `backward_order` (visits.py): the order the engine visits the
  nodes, watched while backward runs or worked out from the graph; `GradientFlow`
  (flow.py) draws such a pass on its graph, step by step.
- `explore` (explore.py): one training step's graph, values, gradients and backward
  order in a self-contained HTML page to click through (`examples/explore.py`).
  Each tensor in it is a few numbers whatever its size (summary.py).

    import microtensor as mt
    from microtensor import inspect as mti

    rec = mti.GradientRecorder(model)
    with rec:                                # module calls in here get hooks
        logits, loss = model(idx, targets)
    loss.backward()                          # the hooks fill in the records
    print(rec.table())
    rec["transformer.h.3"].input_norm, rec["transformer.h.3"].skip_norm

    print(mti.to_dot(loss, module=model))    # parameters labelled by their names
"""
from microtensor.inspect.calls import ModuleCall, ModuleCalls, track_modules
from microtensor.inspect.recorder import GradientRecorder, GradRecord, ResidualUnit
from microtensor.inspect.graph import (
    GraphNode, Graph, build_graph, to_dot, render, dot_available,
)
from microtensor.inspect.drawing import save_small_png
from microtensor.inspect.visits import BackwardTrace, backward_order
from microtensor.inspect.flow import GradientFlow
from microtensor.inspect.explore import explore, Explorer
from microtensor.inspect.compare import (
    compare_grads, GradReport, GradLine, retain_grads, math_line, math_rule,
)

__all__ = ["GradientRecorder", "GradRecord", "ResidualUnit", "track_modules", "ModuleCalls",
           "Graph", "build_graph", "to_dot", "render", "dot_available", "save_small_png",
           "BackwardTrace", "backward_order", "compare_grads", "GradReport", "GradLine",
           "retain_grads", "math_line", "math_rule", "GradientFlow", "explore", "Explorer"]
