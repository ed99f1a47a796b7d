"""`python -m paisoar_jax.doctor`: what holds a finished or running run back, and the fix.

The tool itself is paisoar_jax/tools/doctor/; this module is its command-line door.
"""

import sys

from paisoar_jax.tools.doctor.command import main

if __name__ == "__main__":
    sys.exit(main())
