"""The step itself: train state, the jitted train and eval steps, optimizers, LoRA, eval.

Owns: the sharded train state and its layout (state), the pure (state, batch) -> (state,
metrics) step (step), compiling it once (compilation), the optimizer chain (optim), LoRA
adapters (lora), evaluation, and a step's device memory (memory). May import: config,
errors, output, runtime, numerics, parallel, models, data, observe.
"""
