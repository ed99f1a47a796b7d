"""What is learned: the workload (model, task, optimizer) a run trains.

Owns: the Task protocol and the run's set-up from a workload (workload), the built-in tasks
(builtin: language modelling, image classification), a model and loss of one's own
(custom), the model zoo (zoo), the closing sample, and the trained model as a plain module
(trained). May import: config, errors, output, runtime, numerics, parallel, models, data,
observe, engine, checkpointing.
"""
