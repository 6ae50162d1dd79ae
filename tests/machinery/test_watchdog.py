"""The hang watchdog (--hang-timeout): its default rule, what it times and what not, and
a hung process that says where (alone, and under torchrun with a peer that stalls)."""

import contextlib
import os
import pickle
import sys
import time

import pytest
from helpers import (
    FLAGS,
    ROOT,
    assert_exit_codes,
    ckpt,
    finish,
    fork_run,
    start_torchrun,
    tiny_args,
    write_launcher,
)

from config import check_config, parse_config
from machinery import checkpoint, watchdog
from ops import UserError

# After ``after`` finished optimizer steps, the MLP's training forward sleeps (validation's
# does not: it is not timed), in a frame of its own name, so that the stacks can be told
# apart. (RANK limits it to one torchrun process.)
STALL = """
import time
import networks
from torch.optim.optimizer import register_optimizer_step_post_hook
taken = [0]
register_optimizer_step_post_hook(lambda o, a, k: taken.__setitem__(0, taken[0] + 1))
original = networks.MLP.forward
def stalled_forward(self, x):
    if self.training and taken[0] >= {after} and os.environ.get("RANK", "0") in {ranks!r}:
        time.sleep(120)
    return original(self, x)
networks.MLP.forward = stalled_forward
"""

# Slow, but not hung: the first step (set-up), each validation and each save take longer
# than the timeout.
SLOW_BUT_ALIVE = """
import time
import networks
from machinery import engine, saving
original_forward, original_evaluate = networks.MLP.forward, engine.evaluate
original_save = saving.Saver.save
first = [True]
def slow_first_forward(self, x):
    if first[0]:
        first[0] = False
        time.sleep({pause})
    return original_forward(self, x)
def slow_evaluate(*args, **kwargs):
    time.sleep({pause})
    return original_evaluate(*args, **kwargs)
def slow_save(*args, **kwargs):
    time.sleep({pause})
    return original_save(*args, **kwargs)
networks.MLP.forward = slow_first_forward
engine.evaluate = slow_evaluate
saving.Saver.save = slow_save
"""


def run_launcher(path, args, timeout=120):
    return fork_run([sys.executable, path, *map(str, args)], cwd=ROOT,
                    capture_output=True, text=True, timeout=timeout,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_default_rule():
    assert watchdog.timeout_for(None, []) == watchdog.FLOOR == 300
    assert watchdog.timeout_for(None, [100.0] * 4) == 300  # too few step times: the floor
    assert watchdog.timeout_for(None, [0.2] * 50) == 300  # 20 x 0.2 s is below the floor
    assert watchdog.timeout_for(None, [30.0] * 9 + [9999.0]) == 600  # the median: 20 x 30
    assert watchdog.timeout_for(45, [30.0] * 10) == 45  # given: as given
    assert watchdog.timeout_for(0, [30.0] * 10) == 0  # off


def test_flag_default_and_checks():
    config, _ = parse_config([])
    assert config["hang_timeout"] is None  # the automatic rule
    assert parse_config(["--hang-timeout", "90"])[0]["hang_timeout"] == 90.0
    for bad in ("-1", "nan", "inf"):  # refused by check_config, in one line each
        with pytest.raises(UserError, match="--hang-timeout"):
            check_config(parse_config(["--hang-timeout", bad])[0])


def test_timed_only_between_steps(tmp_path):
    dog = watchdog.Watchdog(0.05, str(tmp_path))
    dog.resume()
    time.sleep(0.1)
    assert dog.overdue()[0] is None  # no step finished yet: set-up is not timed
    dog.step()
    time.sleep(0.1)
    assert dog.overdue()[0] > 0.05
    with dog.paused():  # validation, a save
        time.sleep(0.1)
        assert dog.overdue()[0] is None
    assert dog.overdue()[0] is None  # timed again from the pause's end
    time.sleep(0.1)
    assert dog.overdue()[0] > 0.05
    dog.pause()
    assert dog.overdue()[0] is None


def test_off_starts_no_thread(tmp_path):
    dog = watchdog.Watchdog(0, str(tmp_path))
    with dog:
        assert dog._thread is None
        dog.step()
    assert list(dog._times) == []


def test_a_hung_step_writes_its_stack_and_exits_3(tmp_path):
    run_dir = tmp_path / "run"
    launcher = write_launcher(tmp_path / "stall.py", STALL.format(after=2, ranks=("0",)))
    start = time.monotonic()
    done = run_launcher(launcher, tiny_args(run_dir, "--epochs", "3", "--ckpt-every-steps",
                                            "1", "--hang-timeout", "1.5"))
    assert done.returncode == watchdog.EXIT_HUNG == 3, done.stderr[-3000:]
    assert time.monotonic() - start < 60  # not the 120 s sleep
    stacks = (run_dir / "hang-rank0.txt").read_text()
    assert "no optimizer step finished" in stacks and "the last was step 2" in stacks
    assert "in stalled_forward" in stacks  # the sleeping frame, and the step that called it
    assert "engine.py" in stacks and "run_epoch" in stacks
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("error: no step finished in ")
    assert f"stacks in {run_dir / 'hang-rank0.txt'}" in errors[0]
    assert "--resume auto" in errors[0]
    saved = checkpoint.load_checkpoint(ckpt(run_dir, "last.pt"))  # intact, the last step's
    assert saved["step"] == 2
    assert not (run_dir / "hang-flight-recorder").exists()  # one process: no collectives


def test_slow_set_up_validation_and_saves_are_no_hang(tmp_path):
    run_dir = tmp_path / "run"
    launcher = write_launcher(tmp_path / "slow.py", SLOW_BUT_ALIVE.format(pause=2))
    done = run_launcher(launcher, tiny_args(run_dir, "--ckpt-every-steps", "2",
                                            "--hang-timeout", "1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run_dir / "hang-rank0.txt").exists()
    assert "no step finished" not in done.stderr


def test_torchrun_peer_stalls_both_say_where(tmp_path):
    run_dir = tmp_path / "run"
    launcher = write_launcher(tmp_path / "stall.py", STALL.format(after=2, ranks=("1",)))
    proc = start_torchrun([*tiny_args(run_dir, *FLAGS, "--epochs", "3", "--hang-timeout",
                                      "4")], script=launcher)
    rc, out = finish(proc)
    assert rc != 0
    assert_exit_codes(out, watchdog.EXIT_HUNG)
    rank0, rank1 = ((run_dir / f"hang-rank{r}.txt").read_text() for r in (0, 1))
    assert "in stalled_forward" in rank1  # the sleep
    main0 = rank0.split("Thread ")  # rank 0's main thread: in DDP's backward, waiting for
    waiting = [t for t in main0 if "in run_epoch" in t]  # the all-reduce of rank 1's part
    assert len(waiting) == 1 and "in backward" in waiting[0] and "in stalled_forward" \
        not in waiting[0], rank0
    assert "in _engine_run_backward" in waiting[0]
    assert out.count("error: no step finished") == 2, out[-3000:]  # both said so, then
    last = {}                                                       # exited with 3
    for rank in (0, 1):  # the flight recorder: rank 0 issued an all-reduce in its backward
        with open(run_dir / "hang-flight-recorder" / f"rank_{rank}", "rb") as f:
            last[rank] = pickle.load(f)["entries"][-1]  # that rank 1 never reached
    assert "all_reduce" in last[0]["profiling_name"], last[0]
    assert "_engine_run_backward" in [frame["name"] for frame in last[0]["frames"]]
    assert last[1]["collective_seq_id"] < last[0]["collective_seq_id"], last
    saved = checkpoint.load_checkpoint(ckpt(run_dir, "last.pt"))  # what came before the hang
    assert (saved["epoch"], saved["step"]) == (1, 2), (saved["epoch"], saved["step"])


def test_a_recompile_under_compile_is_no_hang(tmp_path):
    """The CUDA review's L3: torch.compile recompiling inside the timed loop (the epoch's
    smaller last batch, a step after --unfreeze-at) is not timed; timing starts again
    when the compilation ends."""
    import torch

    seen = []
    dog = watchdog.Watchdog(0.3, str(tmp_path))

    def slow_backend(gm, example_inputs):  # a compilation of 0.6 s
        time.sleep(0.6)
        seen.append(dog.overdue())
        return gm.forward

    dog._watch = lambda: None  # (the thread would exit the process: asked by hand here)
    with dog:
        dog.resume()
        dog.step()
        torch.compile(lambda x: x * 2 + 1, backend=slow_backend)(torch.ones(3))
        after = dog.overdue()
    assert seen == [(None, None)]  # compiling: not timed
    assert after[0] is None and after[1] == 0.3  # timed again, from the compile's end
    torch._dynamo.reset()


STOPPED_WORKERS = """
import os, signal, torch.utils.data
from torch.optim.optimizer import register_optimizer_step_post_hook
taken = []
def stop_the_workers(optimizer, args, kwargs):  # after step 2, every DataLoader worker stops
    taken.append(1)
    if len(taken) == 2:
        import multiprocessing
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGSTOP)
        with open(os.environ["WORKERS_FILE"], "w") as f:
            f.write(" ".join(str(c.pid) for c in multiprocessing.active_children()))
register_optimizer_step_post_hook(stop_the_workers)
"""


def test_a_hang_in_the_dataloader_workers_ends_with_one_line_and_no_worker_left(tmp_path):
    """Round 5's F13: DataLoader workers stopped mid-epoch (SIGSTOP): exit 3 with the one
    ``error:`` line last, no traceback after it, and no worker left behind."""
    run_dir, pids = tmp_path / "run", tmp_path / "workers.txt"
    launcher = write_launcher(tmp_path / "stop.py", STOPPED_WORKERS)
    env = dict(os.environ, WORKERS_FILE=str(pids))
    done = fork_run([sys.executable, launcher, *tiny_args(
        run_dir, "--synthetic-size", "2000", "--num-workers", "2", "--data-on-device", "off",
        "--hang-timeout", "2")], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=env)
    assert done.returncode == watchdog.EXIT_HUNG, done.stderr[-3000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("error: no step finished") and "Traceback" not in \
        done.stderr, done.stderr[-3000:]
    workers = [int(p) for p in pids.read_text().split()]
    assert len(workers) == 2
    time.sleep(0.5)
    for pid in workers:  # killed (a zombie at most, until init reaps it)
        state = None
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        assert state in (None, "Z"), (pid, state)
