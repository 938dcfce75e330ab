"""Run control: what keeps a run safe to stop, resume and share a directory.

    lock.py         the run directory's lock (one trainer per directory; a stale holder is taken over)
    preemption.py   SIGTERM/SIGINT/SIGUSR1: agree on the signal, save, stop with the exit code a scheduler expects
    watchdog.py     the step watchdog: a rank stuck in one phase stops the run naming the phase and the laggard
    io_failures.py  a failed write of the run directory stops every rank with one line, the step's checkpoint
                    saved first
    nonfinite.py    non-finite updates skipped, and the run stopped when they repeat
"""
