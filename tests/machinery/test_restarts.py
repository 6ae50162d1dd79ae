"""torchrun's restarts (``--max-restarts``): the restarted group comes up every time and
ends as the run that never failed; a worker whose peer died ends with one line.

The promises (docs/cluster.md): each round joins under its own prefix of the agent's
store and waits for its peers while answering signals (elastic.join_process_group); the
restarted group's process 0 takes the run directory's lock over from the round before it
and an unrelated run is still refused (runlog.RunLock); a dead peer is one ``error:``
line, and the survivor answers torchrun's SIGTERM. The torchrun runs are real, and so
is every SIGKILL.
"""

import datetime
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import helpers as distributed
import pytest
import torch
from helpers import assert_states_equal, final_state, tiny_args

import train
from machinery import elastic
from ops import Interrupted, UserError
from reporting import runlog

RESTARTS = ("--max-restarts", "3", "--monitor-interval", "0.1")
RECIPE = (*distributed.FLAGS, "--resume", "auto")  # 64 samples, 2 x 16 a step: 2 steps an epoch

# The last round's process 0 holds the run directory (and its lock) once it has trained,
# until the test says so: the unrelated run below must meet a group that still runs.
HOLD_AT_THE_END = """
import time
real_fit = train.fit
def fit(*args, **kwargs):
    code = real_fit(*args, **kwargs)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "3" and os.environ["RANK"] == "0":
        open({held!r}, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists({release!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
    return code
train.fit = fit
"""


def _epoch_files(run_dir):
    found = set()
    for path in glob.glob(distributed.ckpt(run_dir, "epoch-*.pt")):
        try:
            found.add((path, os.stat(path).st_mtime_ns))
        except FileNotFoundError:  # rotated away meanwhile
            pass
    return found


def kill_each_new_group(proc, run_dir, ranks):
    """For each rank in ``ranks``: waits for a group of new workers to save an epoch
    checkpoint, then SIGKILLs that rank's worker. Returns the groups' ``{rank: pid}``."""
    groups, old, deadline = [], set(), time.monotonic() + distributed.TIMEOUT
    for rank in ranks:
        up = None
        while True:
            assert proc.poll() is None, f"torchrun ended after {len(groups)} kill(s)"
            assert time.monotonic() < deadline, f"no new group saved after {groups}"
            workers = distributed.worker_pids(proc.pid)
            if len(workers) == 2 and not set(workers.values()) & old:
                up = up or time.time_ns()  # this group runs: wait for its own save
                if any(mtime >= up for _, mtime in _epoch_files(run_dir)):
                    break
            time.sleep(0.02)
        os.kill(workers[rank], signal.SIGKILL)
        groups.append(workers)
        old = set(workers.values())
    return groups


def test_three_sigkills_in_a_row_each_restart_resumes_and_ends_as_if_none(tmp_path, capsys):
    run_dir, fresh = tmp_path / "run", tmp_path / "fresh"
    held, release = tmp_path / "held", tmp_path / "release"
    launcher = distributed.write_launcher(tmp_path / "launch.py",
                              HOLD_AT_THE_END.format(held=str(held), release=str(release)))
    args = tiny_args(run_dir, *RECIPE, size=64, batch=16, epochs=12)
    proc = distributed.start_torchrun(args, script=launcher, torchrun_args=RESTARTS)
    output = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        # Rank 1, then rank 0 (its lock is left behind), then rank 1 again.
        groups = kill_each_new_group(proc, run_dir, ranks=(1, 0, 1))
        deadline = time.monotonic() + distributed.TIMEOUT
        while not held.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no fourth group"
            time.sleep(0.05)
        # The fourth group holds the run directory: an unrelated run (this process, outside
        # the torchrun job) is refused.
        capsys.readouterr()
        other_code = train.main([str(a) for a in args])
        other_err = capsys.readouterr().err
        release.touch()
        rc, _ = distributed.finish(proc)
    finally:
        release.touch()
        if proc.poll() is None:
            distributed._kill(proc)
    reader.join(timeout=60)
    out = "".join(output)
    assert rc == 0, out[-3000:]
    assert len({pid for group in groups for pid in group.values()}) == 6  # three groups
    assert other_code == 2, other_err
    assert f"error: run directory {str(run_dir)!r} is used by another run (pid " \
        in other_err, other_err
    # The group after the killed process 0 took its lock over; every group resumed.
    assert f"note: taking over {str(run_dir / '.lock')!r} from restart round 1 of this " \
           f"torchrun job" in out, out[-3000:]
    resumed = [line for line in out.splitlines() if line.startswith("resuming from ")]
    assert len(resumed) == 3, out[-3000:]
    assert "Traceback" not in out and "Connection refused" not in out, out[-3000:]

    # The same recipe under torchrun, never interrupted: the same weights, bit for bit.
    fresh_args = tiny_args(fresh, *RECIPE, size=64, batch=16, epochs=12)
    distributed.torchrun(fresh_args, script=launcher)  # (asserts exit 0)
    restarted, uninterrupted = final_state(run_dir), final_state(fresh)
    assert restarted["step"] == uninterrupted["step"] == 24
    assert_states_equal(restarted["model"], uninterrupted["model"])
    assert_states_equal(restarted["optimizer"]["state"], uninterrupted["optimizer"]["state"])


def test_without_restarts_the_survivor_of_a_sigkill_ends_with_one_error_line(tmp_path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"  # each worker's stderr, a file
    rc, out, _ = distributed.signal_a_worker_once_an_epoch_is_saved(
        run_dir, tiny_args(run_dir, *distributed.FLAGS, size=256, batch=16, epochs=1000),
        signal.SIGKILL, rank=0, torchrun_args=("--max-restarts", "0", "--monitor-interval",
                                               "0.1", "--redirects", "3", "--log-dir", logs))
    assert rc != 0
    [stderr] = glob.glob(str(logs / "*" / "attempt_0" / "1" / "stderr.log"))
    with open(stderr) as f:
        lines = f.read().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: process 1 lost another process of the run ("), lines
    assert lines[-1] == errors[0], lines  # its last line
    assert not any("Traceback" in line or "gloo" in line for line in lines[:-1]), lines
    assert "forcefully exiting via 9" not in out, out[-3000:]  # it answered the SIGTERM


# Process 0 dies once process 1 waits for it in this round's store, before the group is made.
DIE_WHILE_THE_OTHER_WAITS = """
import datetime, time
import torch.distributed as dist
from machinery import runtime
real_setup = runtime.setup_processes
def setup_processes(config, stop=None):
    if os.environ["RANK"] == "0":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=60))
        while store.add("styleguide/round-0/arrived", 0) < 1:
            time.sleep(0.05)
        os.kill(os.getpid(), 9)
    return real_setup(config, stop)
runtime.setup_processes = setup_processes
"""


def test_a_process_waiting_for_a_dead_peer_answers_torchruns_sigterm(tmp_path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    launcher = distributed.write_launcher(tmp_path / "launch.py", DIE_WHILE_THE_OTHER_WAITS)
    rc, out = distributed.finish(distributed.start_torchrun(
        tiny_args(run_dir, *distributed.FLAGS), script=launcher,
        torchrun_args=("--monitor-interval", "0.1", "--redirects", "3", "--log-dir", logs)))
    assert rc != 0
    [stderr] = glob.glob(str(logs / "*" / "attempt_0" / "1" / "stderr.log"))
    with open(stderr) as f:
        lines = f.read().splitlines()
    assert lines[-1] == ("SIGTERM: stopped while waiting for the other processes of the run; "
                         "no step was taken, so nothing was saved and nothing half-written "
                         "is left"), lines
    assert not any("Traceback" in line or line.startswith("error:") for line in lines), lines
    assert "forcefully exiting via 9" not in out, out[-3000:]  # not left to torchrun's SIGKILL
    assert re.search(r"exitcode\s*:\s*143 ", out), out[-3000:]
    assert not glob.glob(distributed.ckpt(run_dir, "*.pt"))


# ------------------------------------------------------ joining a round, in-process

@pytest.fixture
def agent_store(monkeypatch):
    """A real TCPStore served here, named as torchrun names its agent's store."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=10))
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    return store


def test_a_stop_signal_ends_the_wait_for_the_others(agent_store):
    # The round before left its arrivals in the store: they do not count for this round.
    agent_store.add("styleguide/round-0/arrived", 2)
    looks = []

    def stop():
        looks.append(1)
        return signal.SIGTERM if len(looks) > 3 else None

    with pytest.raises(Interrupted) as caught:
        elastic.join_process_group("gloo", 1, 2, stop=stop)
    assert caught.value.signum == signal.SIGTERM
    assert agent_store.add("styleguide/round-1/arrived", 0) == 1  # this round: itself only
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------- the run directory lock

def _lock_held_by(run_dir, **record):
    run_dir.mkdir(exist_ok=True)
    holder = {"pid": 999999, "host": "another-host", "started": "2026-01-01T00:00:00",
              "proc_start": None, **record}
    (run_dir / ".lock").write_text(json.dumps(holder))


@pytest.mark.parametrize("restart", ["1", "3"])
def test_the_restarted_group_takes_the_lock_of_an_earlier_round(tmp_path, monkeypatch,
                                                                restart):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    _lock_held_by(tmp_path, job={"run_id": "job-a", "restart": 0})  # on another host
    said = []
    with runlog.RunLock(tmp_path, warn=said.append):
        record = json.loads((tmp_path / ".lock").read_text())
        assert record["pid"] == os.getpid()
        assert record["job"] == {"run_id": "job-a", "restart": int(restart)}
    assert len(said) == 1 and said[0].startswith(
        f"note: taking over {str(tmp_path / '.lock')!r} from restart round 0 of this "
        f"torchrun job (pid 999999 on host another-host"), said


@pytest.mark.parametrize("job", [
    None,                                  # a run outside torchrun
    {"run_id": "job-b", "restart": 0},     # another torchrun job
    {"run_id": "job-a", "restart": 2},     # this round (or a later one)
])
def test_any_other_run_on_another_host_is_still_refused(tmp_path, monkeypatch, job):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    _lock_held_by(tmp_path, job=job)
    with pytest.raises(UserError, match="is locked by a run on another host"):
        runlog.RunLock(tmp_path).acquire()


def test_an_earlier_round_that_still_runs_here_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_held_by(tmp_path, pid=sleeper.pid, host=socket.gethostname(),
                      job={"run_id": "job-a", "restart": 0})
        with pytest.raises(UserError, match="is used by another run"):
            runlog.RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
