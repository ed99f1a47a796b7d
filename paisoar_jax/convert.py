"""`python -m paisoar_jax.convert`: text and image folders into ArrayRecord datasets.

The tool itself is paisoar_jax/tools/convert.py; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.convert import main

if __name__ == "__main__":
    sys.exit(main())
