"""Imported only inside the verifier pool's fork server (`VerifierPool` preloads it there).

It makes the fork server, and every worker forked from it, ignore SIGTERM and SIGINT: a scheduler
(systemd, Slurm, a TPU VM's maintenance event) signals the whole process group, and the trainer
handles those signals by finishing its step, saving and exiting; if the signal also killed the
verifier processes, the step being scored would lose its workers (and, before the pool restarted
its fork server, the run). The pool's processes still end with the trainer: workers exit when
their pipe to it closes, and the fork server when its last client is gone.

Never import this module in the trainer's own process.
"""

import signal

for _signal in (signal.SIGTERM, signal.SIGINT):
  signal.signal(_signal, signal.SIG_IGN)
