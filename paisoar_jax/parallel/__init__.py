"""Parallelism: how a step splits over the mesh (data, stage, fsdp, expert, context, tensor).

- `sharding`: the mesh, the logical-axis table for parameters and activations, `constrain`.
- `rules`: where each parameter lives (config rules, its logical names, or the default).
- `pipeline`: pipeline stages (`mesh.stage`): the stack of blocks split into cells.
- `grad_comm`: the gradients' exchange across the data axes in bf16 or int8.
- `context`: attention over sequences split across `mesh.context` (gather, ring).

The mixture-of-experts layer, whose experts split over `mesh.expert`, is a model layer
(models/moe.py): it only pins its token buffers to the expert axis through `constrain`.
"""
