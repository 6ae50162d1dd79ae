"""The tests' fork server (tests/fork_server.py): a server that died is an error at once
in every wait on its children, and they are killed, not left running (design review 7)."""

import os
import sys
import time

import fork_server
import pytest
from helpers import fork_popen


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
