"""`python -m paisoar_jax.plan [--config FILE.yaml] [section.key=value ...]`: memory and traffic.

Compiles one train step for the config's mesh from abstract arrays (no weights are ever
built; `--devices N` simulates N devices on CPU) and reports, per device:

- bytes of params, optimizer state and gradients (from the shardings), and XLA's own
  account of the compiled step (compiled.memory_analysis()): temporaries, inputs, outputs
  not donated, generated code and their total;
- the collectives one step runs, by kind and element type (f32; u16 and s8 for the bf16
  and int8 gradient exchange of mesh.grad_comm), with their bytes, read from the compiled
  HLO (paisoar_jax/tools/plan/hlo.py says how they are counted);
- a projected step time on a given link: compute from the model's FLOPs at an assumed share
  of the peak, communication from NCCL's ring-algorithm costs, with no overlap and with
  perfect overlap, and the scaling efficiency compute / (compute + exposed communication).

`--compare-grad-comm` compiles the step for mesh.grad_comm fp32, bf16 and int8 and puts
their step times and scaling efficiencies on each of LINKS (1gbe .. nvlink) side by side.

The model is bandwidth only: no per-collective latency, and every collective runs over the
one link given (no ici/dcn split), so many small collectives look cheaper than they are. The
collectives are those of the platform that compiles the step: on CPU, XLA keeps an
all-reduce followed by a slice where XLA GPU emits a reduce-scatter, so the gradient
reduction of FSDP and ZeRO is counted (and timed) as an all-reduce there, at twice the
ring cost. XLA CPU also runs bf16 collectives in f32 (it converts around them), so the
FSDP all-gathers of a bf16 run, which move bf16 weights on a GPU (step.params_for_compute),
count twice their GPU bytes here. Temporaries come from the CPU compiler too (other fusions,
no cuDNN attention).

`--target h200|h100` compiles for that GPU instead, without one (tools/plan/gpu_target.py): the
memory and collectives are then the GPU compiler's, and the plan adds its kernels
(tools/plan/gpu_kernels.py) and whether the step fits the device. The table is table.py's.

`--context-for LENGTH` compiles the step at LENGTH tokens for each mesh.context size and
proposes the smallest that fits (context_split.py; the table's context section shows
any split's tokens per device, K/V bytes per step and whether the ring can hide them).

`--output RUN_DIR/plan.json` also writes the plan (the `--json` object) beside a run, where
`python -m paisoar_jax.doctor RUN_DIR` reads it to tell whether communication bounds the step.

Modules: core.py compiles the step and makes the numbers, command.py is the command line
(`main`, imported from there: the package itself is the library side),
table.py prints them, reports.py adds the pipeline's and experts' sections, variants.py
compiles the step in variants side by side, fit_search.py looks for the smallest change
that fits.
"""

from paisoar_jax.tools.plan.core import (
    DEFAULT_EFFICIENCY,
    DEFAULT_PEAK_TFLOPS,
    GRAD_COMMS,
    LINKS,
    compile_step,
    cpu_devices,
    parse_link,
    plan,
    plan_and_collectives,
    request_cpu_devices,
    step_times,
)
from paisoar_jax.tools.plan.table import format_table

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_PEAK_TFLOPS",
    "GRAD_COMMS",
    "LINKS",
    "compile_step",
    "cpu_devices",
    "format_table",
    "parse_link",
    "plan",
    "plan_and_collectives",
    "request_cpu_devices",
    "step_times",
]
