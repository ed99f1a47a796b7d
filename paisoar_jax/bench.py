"""`python -m paisoar_jax.bench`: speed against the PyTorch peers, and the loop's overhead.

The tool itself is paisoar_jax/tools/bench.py; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
