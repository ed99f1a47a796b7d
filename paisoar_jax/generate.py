"""`python -m paisoar_jax.generate`: a trained or imported model continues a prompt.

The tool itself is paisoar_jax/tools/generate.py; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
