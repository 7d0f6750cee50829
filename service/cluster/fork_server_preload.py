"""Imported first by the fork server (:data:`.fork_server.PRELOAD`), and by nothing else: it leaves SIGTERM and
SIGINT to the supervisor. A signal sent to the server's whole process group (Ctrl-C in a terminal, ``timeout``,
systemd's default ``KillMode=control-group``) reaches the fork server too; if it died of it, every child would read
as exited at once, in the middle of its drain and its final snapshot, while the supervisor stops them in order.
The fork server exits when the supervisor is gone (the pipe it reads closes).

SIGTERM is blocked rather than ignored: a blocked signal is kept pending, not dropped, and a child inherits the
mask. Each child unblocks it as it is forked, so a SIGTERM the supervisor sends however early (even before that)
stops it. SIGINT stays ignored in the children too: the supervisor stops them in order on Ctrl-C.

It also takes the working directory off ``sys.path`` before the preloads: the fork server runs as ``python -c``,
which puts it first, so a file there named like a module torch imports (``grp.py``, say) would shadow it. (A
child's own imports use the supervisor's ``sys.path``, which multiprocessing sets in each child.)"""

import os
import signal
import sys

sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}))
