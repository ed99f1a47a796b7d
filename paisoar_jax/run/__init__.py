"""A training run from start to end: start-up, the loop, resume, records, the OOM report.

Owns: the one linear loop with its explicit actions (loop), the start of every run
(startup), the run built from its config and workload (setup: mesh, optimizer, state
layout), where a run starts and what a save keeps (resume), metrics records and the
summary (run_records), the out-of-memory report (oom) and a vanished run directory
(run_directory). May import every wing below it; nothing of the core imports it but the
faces (api), the doors and inference (a decoder is placed as setup builds a run).
"""
