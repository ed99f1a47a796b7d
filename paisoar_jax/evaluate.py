"""`python -m paisoar_jax.evaluate`: lm-evaluation-harness on a run, a step or an export.

The tool itself is paisoar_jax/tools/evaluate.py; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
