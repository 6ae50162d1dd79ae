"""The tests' fork server (tests/fork_server.py): a server that died is an error at once
in every wait on its children, and they are killed, not left running (design review 7)."""

import os
import subprocess
import sys
import time

import fork_server
import pytest
from helpers import fork_popen, fork_run, python_client


@pytest.mark.slow
def test_a_dead_server_is_an_error_at_once_and_its_child_is_killed(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    child = fork_popen([sys.executable, str(script)])
    server = fork_server._server
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(RuntimeError, match="the fork server died; its child"):
        child.wait(timeout=120)  # (at the bound it would be TimeoutExpired)
    for _ in range(100):  # (the kill is asynchronous)
        if not os.path.exists(f"/proc/{child.pid}") or _zombie(child.pid):
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child.pid}") or _zombie(child.pid)
    assert fork_popen([sys.executable, "-c", "pass"]).wait(timeout=120) == 0  # a new one


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_ends_as_the_interpreter_would_and_its_client_with_it(tmp_path):
    """The server's code (tests/fork_serve.py) and the client's (tests/fork_client.py),
    modules now: a script's exception is its own traceback (no frame of the server's) and
    exit 1; SystemExit's code is the exit code, through the client too; a KeyboardInterrupt
    is death by SIGINT, which the client dies of as well."""
    script = tmp_path / "raises.py"
    script.write_text("def f():\n    raise ValueError('bad')\nf()\n")
    out = fork_run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("Traceback") and "fork_serve" not in out.stderr
    assert out.stderr.rstrip().endswith("ValueError: bad") and str(script) in out.stderr
    python = python_client(tmp_path / "python")
    out = subprocess.run([python, "-c", "import sys; print(sys.argv); sys.exit(3)", "a"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (3, "['-c', 'a']\n")
    out = subprocess.run([python, "-c", "raise KeyboardInterrupt"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -2 and out.stderr.rstrip().endswith("KeyboardInterrupt")
