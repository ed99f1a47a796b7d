"""`python -m paisoar_jax.doctor`: what holds a run back, and the fix.

Modules: command.py is the command line (`main`, `diagnose`, the list of checks), findings.py
the checks that read a run's records and config (with `Run` and `Finding`),
memory_findings.py those of device memory, moe_findings.py those of a mixture's experts;
the context split's check is the plan's (tools/plan/context_split.py).
"""
