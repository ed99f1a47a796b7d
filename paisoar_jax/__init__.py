"""paisoar_jax: one YAML config turns a model and an optax optimizer into a fast JAX run.

Sharded over a device mesh, mixed precision, checkpointed; see README.md for the tour.
"""

__version__ = "0.1.0"
