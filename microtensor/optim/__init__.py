"""mt.optim: optimizers and learning-rate schedules.

    opt = mt.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = mt.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()

`flatten_state_dict` / `unflatten_state_dict` carry an optimizer's state through a
safetensors checkpoint (arrays + a JSON string in the metadata).
"""
from microtensor.optim.optimizer import (
    Optimizer, flatten_state_dict, unflatten_state_dict, required,
)
from microtensor.optim.sgd import SGD
from microtensor.optim.adam import Adam, AdamW
from microtensor.optim import lr_scheduler
# (mt.compile records an optimizer's step and zero_grad, and a scheduler's step, as
# single calls: see Optimizer.__init_subclass__ and capture.recorded_call)

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler",
           "flatten_state_dict", "unflatten_state_dict"]
