"""The fork server's own process (tests/fork_server.py starts it by path):
``python tests/fork_serve.py ROOT QUEUE``.

It imports train.py from ROOT (and through it torch, torchvision, the project), then
forks a child for each request: a JSON line on its stdin (``fork_server.ForkedProcess``;
the child's pid goes back on its stdout, how it ended into ``QUEUE/<pid>.status``) or a
connection on ``QUEUE/socket`` (a ``fork_client``: its stdin, stdout and stderr come with
the request, the pid and then the exit code go back on the connection). A child
(``child``) runs the request's script as the interpreter would and ends as it would.
"""

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

STDIO = (sys.stdout.encoding, sys.stdout.errors)  # (the server's: a new interpreter's)


def print_exc(e):
    """The traceback from the script's frames on, as the interpreter prints it (this
    file's frames left out)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def child(req, fds=None, close=()):
    """In the forked child: takes the request's stdio, session, working directory and
    environment, runs its ``argv`` (a script, ``-c CODE``, ``-m MODULE`` or ``-`` for the
    program on stdin) as ``__main__`` and ends as the interpreter would: SystemExit's
    code, 1 and the traceback for an exception, the exit handlers run, death by SIGINT
    for a KeyboardInterrupt. Never returns."""
    try:
        for fd in close:  # the server's sockets
            os.close(fd)
        if fds is not None:  # a client's own stdin, stdout and stderr
            for fd, new in enumerate(fds):
                os.dup2(new, fd)
            for new in set(fds) - {0, 1, 2}:
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
        code = run_main(req["argv"] or ["-"])
    except BaseException:
        traceback.print_exc()
        code = 1
    end(code)


def run_main(argv):
    """Runs ``argv`` as ``python ARGV`` runs its program; its exit code (negative: the
    signal it dies of)."""
    sys.argv = list(argv)
    try:
        if argv[0] == "-":  # the program on stdin
            exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print_exc(e)
        return -signal.SIGINT
    except BaseException as e:
        print_exc(e)
        return 1
    return 0


def end(code):
    """The interpreter's end: the exit handlers, the streams flushed, then ``code`` (a
    negative one: death by that signal)."""
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


def serve(queue):
    """The server's loop, until its stdin (the test process) closes."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(queue, "socket"))  # fork_client's requests
    listener.listen(64)
    requests, pending, clients = sys.stdin.buffer, b"", {}  # clients: pid -> connection
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
        if listener in ready:  # a client: its request and its stdin, stdout and stderr
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
            while not message.endswith(b"\n"):
                message += conn.recv(1 << 22)
            pid = os.fork()
            if pid == 0:
                child(json.loads(message), fds, close=[
                    listener.fileno(), conn.fileno(), *(c.fileno() for c in clients.values())])
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            clients[pid] = conn
        for pid, conn in list(clients.items()):  # a client gone (killed): so is its child
            if conn in ready and not conn.recv(1, socket.MSG_PEEK):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reap(queue, clients)


def reap(queue, clients):
    """The children that ended: how, to their client or in a file each
    (``QUEUE/<pid>.status``, written whole)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{code}\n".encode())
            conn.close()
            continue
        path = os.path.join(queue, f"{pid}.status")
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    root, queue = sys.argv[1:3]
    sys.path[0:1] = [root, ""]  # (as ``python -c`` from ROOT: the project, then the cwd)
    import train  # noqa: F401  (and through it torch, torchvision, the project)
    serve(queue)
