"""What a run measures and reports: metrics.jsonl, trackers, timers, health, memory.

Owns: the metrics writer and its trackers (TensorBoard, W&B, MLflow), the interval timer,
the profiler and the loss's health checks (monitor). May import: config, errors, output,
runtime, numerics.
"""
