"""The model runner: a `SchedulerOutput` in, a `ForwardBatch` through the model, sampled tokens out."""
