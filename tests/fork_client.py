"""The fork server's client: what the executable ``fork_server.client`` writes runs
(``main(SOCKET)``), an executable that stands for ``python`` (bench/gpu.sh's $PYTHON).

It hands its arguments, working directory, environment, stdin, stdout and stderr to the
server (tests/fork_serve.py) over the socket, which forks the run; it passes on the
signals it gets and ends as the run ends: its exit code, or death by the signal the run
died of. Killed, its run is too (the server sees the connection close).
"""

import json
import os
import signal
import socket
import sys

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def main(path):
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)})
    socket.send_fds(conn, [request.encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile("rb")
    pid = int(replies.readline())

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    line = replies.readline()
    code = int(line) if line.strip() else 1
    if code < 0:  # the run died of a signal: so does this
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
