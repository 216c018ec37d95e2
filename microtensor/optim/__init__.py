"""mt.optim: optimizers and learning-rate schedules."""
