"""`python -m paisoar_jax.launch`: N local processes of one run, with a stalled rank named.

The tool itself is paisoar_jax/tools/launch/; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.launch.command import main

if __name__ == "__main__":
    sys.exit(main())
