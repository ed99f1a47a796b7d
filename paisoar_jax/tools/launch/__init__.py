"""`python -m paisoar_jax.launch`: N processes of a run on this machine, joined and watched.

Modules: command.py starts, watches and stops the processes (`main`), rank_output.py prefixes
and logs each rank's lines, restarts.py runs the job again from its newest checkpoint after a
crash (`--max-restarts`).
"""
