"""The process a run lives in: joining peers, signals, heartbeats, locks, files, the platform.

Owns: jax.distributed start-up (distributed), the launcher's heartbeats (heartbeat) and the
collectives' chatter (chatter), SIGTERM/Ctrl-C (preemption), the hang watchdog, a full
disk, the run directory's lock, the platform and GPU flags, and reading a user's files
(user_files). May import: config, errors, output. Everything above it may import it.
"""
