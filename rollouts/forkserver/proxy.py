"""`python [-u] -m rollouts.forkserver.proxy (-m MODULE | SCRIPT) ARGS...`: the program, forked by
the server at `$ROLLOUTS_FORKSERVER`, behind this small process, for a starter that must hold the
program's own process (torchrun, whose ranks `driver/launch.py` starts through this where a
forkserver runs: a rank's start is then its own work, not 6-7 CPU-seconds of imports).

This process imports nothing heavy (about 0.07 s). The program gets its environment, working
directory, stdin, stdout and stderr, and `-u` where this process had it. SIGTERM, SIGINT, SIGHUP,
SIGQUIT, SIGUSR1 and SIGUSR2 are passed on to it; a SIGKILL of this process kills it too (the
server kills a program whose caller's socket closed); its exit status is this process's (a
signal's death, by the same signal). Where no server takes it, this process becomes the program
(exec), as if started directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import NoReturn

from rollouts.forkserver.client import fork

PASSED_ON = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def main() -> NoReturn:
    program = sys.argv[1:]
    if not program:
        raise SystemExit("usage: python -m rollouts.forkserver.proxy (-m MODULE | SCRIPT) ARGS...")
    options = sys.orig_argv[1 : sys.orig_argv.index("-m")]  # this interpreter's own
    argv = [sys.executable, *(["-u"] if "-u" in options else []), *program]
    proc = fork(argv, dict(os.environ), {0: 0, 1: 1, 2: 2}, cwd=os.getcwd())
    if proc is None:
        sys.stdout.flush()
        os.execv(sys.executable, argv)
    for sig in PASSED_ON:
        signal.signal(sig, lambda sig, _frame: proc.forward(sig))
    code = proc.wait()  # a signal handled meanwhile resumes the wait (PEP 475)
    if code < 0:  # died of a signal: so does this process
        with contextlib.suppress(OSError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
