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

SERVER = r"""
import atexit, contextlib, io, json, os, runpy, select, signal, sys, traceback
sys.path.insert(0, {root!r})
import train  # (and through it torch, torchvision, the project)
STDIO = (sys.stdout.encoding, sys.stdout.errors)

def print_exc(e):  # the traceback from the script's frames on, as the interpreter's
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == "<server>":
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)

def child(req, fds=None, close=()):
    try:
        for fd in close:  # the server's sockets
            os.close(fd)
        if fds is not None:  # a client's own stdin, stdout and stderr
            for fd, new in enumerate(fds):
                os.dup2(new, fd)
            for new in set(fds) - {{0, 1, 2}}:
                os.close(new)
        for fd, (path, flags) in enumerate(req.get("stdio", ())):  # first (the test waits
            new = os.open(path, flags)                # on its ends of them): stdout's pipe
            os.dup2(new, fd)                          # before stderr's
            os.close(new)
        if req.get("session"):
            os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        # The server's own streams' encoding (a new interpreter in this environment), or
        # PYTHONIOENCODING's "encoding:errors" as the interpreter reads it.
        encoding, _, errors = os.environ.get("PYTHONIOENCODING", "").partition(":")
        encoding, errors = encoding or STDIO[0], errors or STDIO[1]
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=encoding,
                                     errors=errors)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                      errors=errors, line_buffering=unbuffered,
                                      write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                      errors="backslashreplace", line_buffering=True)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv, code = req["argv"] or ["-"], 0
        sys.argv = list(argv)
        try:
            if argv[0] == "-":  # the program on stdin
                sys.argv = argv
                exec(compile(sys.stdin.read(), "<stdin>", "exec"), {{"__name__": "__main__"}})
            elif argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {{"__name__": "__main__"}})
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt as e:
            print_exc(e)
            code = -signal.SIGINT
        except BaseException as e:
            print_exc(e)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
    with contextlib.suppress(BaseException):
        sys.stderr.flush()
    if code < 0:  # died of the signal, as the interpreter does for SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)

import socket
listener = socket.socket(socket.AF_UNIX)
listener.bind(os.path.join({queue!r}, "socket"))  # CLIENT's requests
listener.listen(64)
requests, pending, clients = sys.stdin.buffer, b"", {{}}  # clients: pid -> connection
while True:
    waiting = [requests, listener, *clients.values()]
    ready, _, _ = select.select(waiting, [], [], 0.02)
    if requests in ready:
        chunk = os.read(requests.fileno(), 65536)
        if not chunk:
            break  # the test process is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                child(json.loads(line), close=[listener.fileno(),
                                               *(c.fileno() for c in clients.values())])
            os.write(1, (json.dumps(pid) + "\n").encode())
    if listener in ready:  # a CLIENT: its request and its stdin, stdout and stderr
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 22)
        pid = os.fork()
        if pid == 0:
            child(json.loads(message), fds, close=[listener.fileno(), conn.fileno(),
                                                  *(c.fileno() for c in clients.values())])
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{{pid}}\n".encode())
        clients[pid] = conn
    for pid, conn in list(clients.items()):  # a client gone (killed): so is its child
        if conn in ready and not conn.recv(1, socket.MSG_PEEK):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    while True:  # the children that ended: how, in a file each (and to their client)
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        code = os.waitstatus_to_exitcode(status)
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{{code}}\n".encode())
            conn.close()
            continue
        path = os.path.join({queue!r}, f"{{pid}}.status")
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)
"""

# An executable that stands for ``python`` (bench/gpu.sh's $PYTHON): it hands its arguments,
# working directory, environment, stdin, stdout and stderr to the server, which forks the
# run; it passes on the signals it gets and ends as the run ends. Killed, its run is too.
CLIENT = r"""#!{python} -IS
import json, os, signal, socket, sys
conn = socket.socket(socket.AF_UNIX)
conn.connect({socket!r})
request = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}})
socket.send_fds(conn, [request.encode() + b"\n"], [0, 1, 2])
replies = conn.makefile("rb")
pid = int(replies.readline())
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), forward)
line = replies.readline()
code = int(line) if line.strip() else 1
if code < 0:  # the run died of a signal: so does this
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class _Server:
    def __init__(self, root):
        self.dir = tempfile.mkdtemp(prefix="fork-server-")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"exec(compile({SERVER.format(root=root, queue=self.dir)!r}, "
             f"'<server>', 'exec'))"], cwd=root,
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
    """Writes ``CLIENT`` (a ``python`` whose runs are this test process's server's forks) to
    ``path``; returns its path."""
    server = _the_server(root)
    sock, deadline = os.path.join(server.dir, "socket"), time.monotonic() + 120
    while not os.path.exists(sock):  # (bound once the server has imported train.py)
        if not server.alive() or time.monotonic() > deadline:
            raise RuntimeError("the fork server did not start")
        time.sleep(0.02)
    with open(path, "w") as f:
        f.write(CLIENT.format(python=sys.executable, socket=sock))
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

