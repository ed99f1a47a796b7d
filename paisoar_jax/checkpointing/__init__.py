"""Saved state: Orbax checkpoints that resume exactly, exports, and reading either back.

Owns: the checkpointer (atomic async saves, checksums, restore onto any mesh), what a saved
item holds (saved_trees), a run's weights without its optimizer (weights) and how Orbax's
failures read (orbax_errors). May import: config, errors, output, runtime, numerics.
"""
