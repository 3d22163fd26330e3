"""Runs argv[1:] as an interactive shell starts a command: SIGINT and SIGQUIT at their defaults and
no signal blocked, whatever the test process had when it forked.

glibc's system(), called by any thread of the test process (a library's), ignores SIGINT and
SIGQUIT and blocks SIGCHLD while its command runs; a daemon forked in that window inherits the
ignored signals, and a shell script cannot trap a signal ignored when it started: launch.sh so
started never sees a Ctrl-C.
"""

import os
import signal
import sys

for signum in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(signum, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_SETMASK, [])
os.execvp(sys.argv[1], sys.argv[1:])
