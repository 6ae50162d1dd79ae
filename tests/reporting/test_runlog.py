"""The run directory's lock (runlog.RunLock): one run per run directory."""

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import ROOT

from machinery import runtime
from ops import UserError
from reporting import runlog

HOLD_LOCK = ("import sys; sys.path.insert(0, {root!r}); from reporting import runlog; "
             "runlog.RunLock(sys.argv[1]).acquire(); print('locked', flush=True); "
             "sys.stdin.read()")


def test_run_lock_refuses_a_live_run_then_takes_over_when_it_is_gone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=ROOT),
                             str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as e:
            runlog.RunLock(tmp_path).acquire()
        message = str(e.value)
        assert f"is used by another run (pid {proc.pid} on host {socket.gethostname()}, " \
               f"started " in message
        assert "wait for it or choose another --run-dir" in message
    finally:
        proc.kill()
        proc.wait()
    warnings = []
    lock = runlog.RunLock(tmp_path, warn=warnings.append).acquire()
    assert len(warnings) == 1 and warnings[0].startswith("warning: taking over")
    assert f"pid {proc.pid}" in warnings[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".lock").exists()


def write_lock(run_dir, **record):
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": "2020-01-01T00:00:00", **record}
    (run_dir / ".lock").write_text(json.dumps(record))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_takes_over_a_dead_pid_with_a_warning(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    warnings = []
    with runlog.RunLock(tmp_path, warn=warnings.append) as lock:
        assert lock.held
        assert warnings == [f"warning: taking over {str(tmp_path / '.lock')!r} from a run "
                            f"that is gone (pid {pid} on host {socket.gethostname()}, "
                            f"started 2020-01-01T00:00:00)"]
        record = json.loads((tmp_path / ".lock").read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert "started" in record
    assert not (tmp_path / ".lock").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".lock.tmp")]


def test_run_lock_treats_a_reused_pid_as_gone(tmp_path):
    # Our own pid, but a process that started at another time: the pid was reused.
    start = runtime.process_start(os.getpid())
    if start is None:
        pytest.skip("no /proc here")
    write_lock(tmp_path, proc_start=start - 1)
    warnings = []
    runlog.RunLock(tmp_path, warn=warnings.append).acquire().release()
    assert len(warnings) == 1


def test_run_lock_refuses_a_live_lock_of_this_process(tmp_path):
    with runlog.RunLock(tmp_path):
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            runlog.RunLock(tmp_path).acquire()
        assert (tmp_path / ".lock").exists()


def test_run_lock_of_another_host_is_refused(tmp_path):
    write_lock(tmp_path, host="elsewhere.invalid", pid=dead_pid())
    with pytest.raises(UserError) as e:
        runlog.RunLock(tmp_path).acquire()
    assert "on host elsewhere.invalid" in str(e.value)
    assert f"delete {str(tmp_path / '.lock')!r}" in str(e.value)
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "elsewhere.invalid"


@pytest.mark.parametrize("content", ["", "{\"pid\": 12", "[1, 2]"])
def test_run_lock_takes_over_an_empty_or_unreadable_lock(tmp_path, content):
    (tmp_path / ".lock").write_text(content)
    warnings = []
    lock = runlog.RunLock(tmp_path, warn=warnings.append).acquire()
    assert len(warnings) == 1 and "empty or unreadable" in warnings[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_run_lock_release_is_idempotent_and_leaves_another_runs_lock(tmp_path):
    lock = runlog.RunLock(tmp_path / "new")  # the directory is created
    lock.acquire()
    assert lock.held and (tmp_path / "new" / ".lock").exists()
    lock.release()
    assert not lock.held and not (tmp_path / "new" / ".lock").exists()
    lock.release()  # harmless
    lock.acquire()
    write_lock(tmp_path / "new", pid=1, started="other")  # someone replaced it
    lock.release()
    assert json.loads((tmp_path / "new" / ".lock").read_text())["pid"] == 1


def test_a_run_of_another_user_that_this_user_may_not_signal_stays_locked():
    # os.kill(pid, 0) on another user's live process raises PermissionError: it runs.
    # Here this process (root) holds the lock; a child that became user "nobody" tries.
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user")
    import pwd
    import tempfile

    nobody = pwd.getpwnam("nobody")
    shared = tempfile.mkdtemp(prefix="lock-other-user-")  # tmp_path is private to root
    try:
        os.chmod(shared, 0o777)
        with runlog.RunLock(shared):
            read, write = os.pipe()
            child = os.fork()
            if child == 0:  # the other user's run
                os.close(read)
                try:
                    os.setgid(nobody.pw_gid)
                    os.setuid(nobody.pw_uid)
                    try:
                        runlog.RunLock(shared, warn=lambda message: None).acquire()
                        outcome = "taken"
                    except UserError as e:
                        outcome = f"refused: {e}"
                except BaseException as e:  # reported to the parent
                    outcome = f"failed: {e!r}"
                os.write(write, outcome.encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as f:
                outcome = f.read()
            os.waitpid(child, 0)
            assert outcome.startswith("refused:") and f"pid {os.getpid()}" in outcome, outcome
            assert json.loads(open(os.path.join(shared, ".lock")).read())["pid"] == \
                os.getpid()  # not taken over
    finally:
        subprocess.run(["rm", "-rf", shared])
