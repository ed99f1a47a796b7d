"""Which dtype each matmul and convolution of a model of one's own runs in (issue 30).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/own_model_dtypes.py

For the plain-NNX CNN, MLP and transformer of tests/numerics/test_precision.py under bf16 and fp16
on data=8: the train step's dot_general and conv_general_dilated equations, forward and
backward, counted by their operands' dtypes. The CPU proxy of the precision change is the
step's program, not a timing.
"""

import collections
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's package and test models

import conftest  # noqa: E402, F401  (8 CPU devices before jax starts)
from test_precision import HEAVY, OWN_MODELS, equations, own_step_jaxpr  # noqa: E402


def main() -> None:
    """Prints one markdown row per model and policy."""
    print("| model | policy | op | operand dtypes | count (forward + backward) |")
    print("|---|---|---|---|---|")
    for kind in OWN_MODELS:
        for policy in ("fp32", "bf16", "fp16"):
            jaxpr = own_step_jaxpr(kind, [f"precision.policy={policy}", "mesh.data=8"])
            counts = collections.Counter(
                (e.primitive.name, " x ".join(str(v.aval.dtype) for v in e.invars))
                for e in equations(jaxpr.jaxpr)
                if e.primitive.name in HEAVY
            )
            for (op, dtypes), count in sorted(counts.items()):
                print(f"| {kind} | {policy} | {op} | {dtypes} | {count} |")


if __name__ == "__main__":
    main()
