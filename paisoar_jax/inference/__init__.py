"""Using a trained model: batched generation with a key/value cache, text in and out.

Owns: `Generator` (a run's, a step's or an export's decoder placed on the devices, batched
prompts, sampling as transformers' warpers) and `Text` (tokenizing as transformers does).
May import run/setup.py (a decoder is placed on its devices as a run is built) and every
wing below run/: checkpointing, tasks, models, parallel, numerics, data, runtime, config.
"""
