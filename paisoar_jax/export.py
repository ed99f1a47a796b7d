"""`python -m paisoar_jax.export`: a run's trained weights only, for inference or init_from.

The tool itself is paisoar_jax/tools/export.py; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
