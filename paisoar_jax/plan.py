"""`python -m paisoar_jax.plan`: the memory and collectives of a compiled step, before any run.

The tool itself is paisoar_jax/tools/plan/ (command.py); this module is its command-line door.
"""

import sys

from paisoar_jax.tools.plan.command import main

if __name__ == "__main__":
    sys.exit(main())
