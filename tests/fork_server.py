"""``popen([sys.executable, SCRIPT, ...], ...)``: subprocess.Popen for a Python script, started
as a fork of a server that has imported train.py, not as a new interpreter.

A test that signals train.py, kills it or reads its output as it comes needs a process of its
own, but not the 3.3 s of CPU a new interpreter spends importing torch, torchvision and
train.py before its first line runs: the suite started some forty of them. The server (one
per test process, started at its first use) is a ``python`` that imported train.py and does
nothing else; for each ``popen`` it forks a child that

* takes the call's working directory, environment (``os.environ``), stdin/stdout/stderr
  (``subprocess.PIPE``: a pipe, as Popen's; ``DEVNULL``; a file; ``None``: /dev/null) and,
  with ``start_new_session``, a session of its own;
* runs the script as ``__main__`` with ``sys.argv`` (``-c CODE`` and ``-m MODULE`` too), and
  ends as the interpreter would: SystemExit's code, 1 and the traceback for an exception,
  the exit handlers run, a signal's death a signal's death.

The object returned has Popen's ``pid``, ``stdout``/``stderr``, ``poll``, ``wait``,
``communicate``, ``send_signal``, ``terminate``, ``kill`` and ``returncode``; the child is a
real process (signals, process groups, its own DataLoader workers), though not the test's
child (the server reaps it and says how it ended).

What differs from a new interpreter, so where that is the thing tested a test keeps
``subprocess``: what happens while the interpreter starts and imports (a signal then, the
exit code of an import error), what a module reads from the environment at import (read
when the server started: PYTHONIOENCODING, PYTHONHASHSEED...), and str hashes (every child
shares the server's seed).
"""

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The executable ``client`` writes: a ``python`` whose runs are forks of this test
# process's server (tests/fork_client.py).
CLIENT = """#!{python} -IS
import sys
sys.path.append({here!r})
import fork_client
fork_client.main({socket!r})
"""


class _Server:
    def __init__(self, root):
        self.dir = tempfile.mkdtemp(prefix="fork-server-")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fork_serve.py"), root, self.dir], cwd=root,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))
        self.lock = threading.Lock()
        self.count = 0

    def alive(self):
        return self.proc.poll() is None

    def fork(self, request):
        with self.lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server ended")
        return json.loads(line)

    def close(self):
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server = None
WAIT_BOUND = 1200  # seconds: the longest a wait without a timeout of its own waits


def _the_server(root):
    global _server
    if _server is None or not _server.alive():
        _server = _Server(root)
        atexit.register(_server.close)
    return _server


class ForkedProcess:
    """subprocess.Popen's interface for a child of the fork server (module docstring)."""

    def __init__(self, root, args, cwd=None, env=None, stdin=None, stdout=None, stderr=None,
                 text=False, universal_newlines=False, start_new_session=False,
                 encoding=None, errors=None):
        if args[0] != sys.executable:
            raise ValueError(f"fork_server runs Python scripts only, not {args[0]!r}")
        server = _the_server(root)
        server.count += 1
        self.args, self.returncode = list(args), None
        self._dir = tempfile.mkdtemp(prefix=f"p{server.count}-", dir=server.dir)
        text = text or universal_newlines or encoding is not None or errors is not None
        stdio, pipes = [], {}
        for fd, spec in enumerate((stdin, stdout, stderr)):
            if spec == subprocess.PIPE and fd > 0:
                path = os.path.join(self._dir, str(fd))
                os.mkfifo(path)
                pipes[fd] = path
                stdio.append((path, os.O_WRONLY))
            elif spec == subprocess.STDOUT and fd == 2:
                stdio.append(stdio[1])
            elif hasattr(spec, "fileno"):
                stdio.append((f"/proc/{os.getpid()}/fd/{spec.fileno()}",
                              os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_APPEND))
            elif spec in (None, subprocess.DEVNULL):
                stdio.append((os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY))
            else:
                raise ValueError(f"fork_server: unsupported stdio {spec!r}")
        self._server = server
        self.pid = server.fork({
            "argv": [str(a) for a in args[1:]], "cwd": str(cwd or os.getcwd()),
            "env": dict(os.environ if env is None else env), "session": start_new_session,
            "stdio": stdio})
        self._status = os.path.join(server.dir, f"{self.pid}.status")
        self.stdin = None
        mode = {"mode": "r", "encoding": encoding or "utf-8", "errors": errors or "strict"} \
            if text else {"mode": "rb"}
        self.stdout = open(pipes[1], **mode) if 1 in pipes else None  # (the child opens its
        self.stderr = open(pipes[2], **mode) if 2 in pipes else None  # ends in this order)

    def poll(self):
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout=None):
        """The child's exit code. Every wait has a bound (``WAIT_BOUND`` when none is
        given), and a server that died is an error at once, its child killed: no test
        waits on a status file nobody will write (design review 7)."""
        timeout = WAIT_BOUND if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if not self._server.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)  # (an orphan now: it would run on)
                if self.poll() is None:
                    raise RuntimeError(f"the fork server died; its child {self.pid} "
                                       f"({' '.join(self.args[1:3])} ...) was killed")
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        """Both pipes read to their end (and the child's end waited for), as Popen's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not hasattr(self, "_read"):
            self._read = {}
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:  # [the reading thread, then what it read]
                    chunks = self._read[name] = [None]
                    chunks[0] = threading.Thread(target=lambda s=stream, c=chunks: c.append(
                        s.read()), daemon=True)
                    chunks[0].start()
        for chunks in self._read.values():
            chunks[0].join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if chunks[0].is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        out = [None if self._read.get(n) is None else self._read[n][1]
               for n in ("stdout", "stderr")]
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return tuple(out)

    def send_signal(self, signum):
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def client(root, path):
    """Writes ``CLIENT`` (a ``python`` whose runs are this test process's server's forks:
    tests/fork_client.py) to ``path``; returns its path."""
    server = _the_server(root)
    sock, deadline = os.path.join(server.dir, "socket"), time.monotonic() + 120
    while not os.path.exists(sock):  # (bound once the server has imported train.py)
        if not server.alive() or time.monotonic() > deadline:
            raise RuntimeError("the fork server did not start")
        time.sleep(0.02)
    with open(path, "w") as f:
        f.write(CLIENT.format(python=sys.executable, here=HERE, socket=sock))
    os.chmod(path, 0o755)
    return str(path)


def popen(root, args, **kwargs):
    return ForkedProcess(root, args, **kwargs)


def run(root, args, timeout=None, capture_output=False, **kwargs):
    """subprocess.run's counterpart: a CompletedProcess; the child killed on timeout."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = popen(root, args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)

