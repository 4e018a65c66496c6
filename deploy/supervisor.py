"""The parent of a local stack: `moectl demo` and `moectl serve` run the stack in a child process
of a session of its own, and this process forwards the stop signals to it.

    code = supervise(["demo", "--keep"])   # in the parent: the child's exit status
    if code is not None:                   # None: this process is the child; run the stack
        raise typer.Exit(code)

Why: a process group gets one signal for all its members (Ctrl-C in a terminal, `kill -TERM
-PGID`, a supervisor stopping a job). A local Ray's GCS, raylet, agents and workers are children
of the driver and would share its group: on SIGTERM to the group they exit at once (Ray workers
exit on SIGTERM), the Serve controller is gone before the driver can drain it, and the driver
waits for it, then dies with its raylet before its own cleanup (the demo's Redis namespace)
runs. In a session of their own only the driver hears the signal, from this parent, and
shuts down in order (Serve drained within its graceful timeout, Ray, the cache and its
namespace), as when the driver alone is signalled.

Step 1: the child is `moectl ARGV` (`python -m deploy.cli`) with MOE_STACK_PARENT=<this pid>, started with
        `start_new_session`; stdin, stdout and stderr are shared.
Step 2: SIGTERM, SIGINT and SIGHUP to this process are sent on to the child (SIGHUP as SIGTERM);
        the child's exit status is returned (128 + N when a signal N ended it).
Step 3: in the child, `supervise` asks the kernel for SIGTERM when the parent dies
        (PR_SET_PDEATHSIG), so a parent killed with SIGKILL still leads to an orderly stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

PARENT_ENV = "MOE_STACK_PARENT"
_PR_SET_PDEATHSIG = 1


def supervise(argv: list[str], *, module: str = "deploy.cli") -> int | None:
    """Steps 1-3 (see the module docstring): None in the child, else the child's exit status.
    The child is `python -m MODULE ARGV`."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        _term_on_parent_death(int(parent))
        return None
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    command = [sys.executable, "-m", module, *argv]
    child = subprocess.Popen(command, env=env, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sent)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _term_on_parent_death(parent: int) -> None:
    """PR_SET_PDEATHSIG(SIGTERM) for this process (Linux; elsewhere nothing happens), then a
    check that the parent did not die before the request took effect."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
