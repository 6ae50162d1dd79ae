"""A task from outside the project: README's "Add a task" (a regression, one number per
image) in a file of the user's, chosen with ``--task FILE.py:Class``. It trains through
train.py with every promise a built-in task keeps (SIGTERM then ``--resume auto`` bit-exact,
torchrun 2 x 8 == 1 x 16, best.pt on its best figure) and test.py reports it."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    final_state,
    read_metrics,
    stop_at_step,
    tiny_args,
    torchrun,
)

import train


def readme_section():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("## Add a task", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def task_file(tmp_path):
    """README's task, saved as the user would: ``my_tasks.py``; its --task value."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)
    assert len(code) == 1
    (tmp_path / "my_tasks.py").write_text(code[0])
    return f"{tmp_path / 'my_tasks.py'}:Regression"


def test_the_readme_section_runs_as_written(tmp_path, task_file):
    commands = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)[0].splitlines()
    assert [shlex.split(c)[1] for c in commands] == ["train.py", "train.py", "test.py"]
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        argv[:2] = [sys.executable, os.path.join(ROOT, argv[1])]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        outputs.append(done.stdout)
    run = tmp_path / "runs" / "regression"
    records = [r for r in read_metrics(run) if "val_loss" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3] and all("val_r2" in r for r in records)
    config = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert config["task"] == "my_tasks.py:Regression"  # as given: found again from the cwd
    assert (config["optimizer"], config["lr"]) == ("adam", 1e-3)  # the task's defaults
    best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    lowest = min(records, key=lambda r: r["val_loss"])
    assert best["epoch"] == lowest["epoch"]
    report = outputs[2]
    assert f"loss {lowest['val_loss']:.4f}  r2 {lowest['val_r2']:.4f}" in report


def test_best_pt_is_the_lowest_loss_when_it_is_not_the_last(tmp_path, task_file,
                                                             monkeypatch):
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "warm")]) == 0
    import user_task_my_tasks  # as the run above loaded it; patched for the one below
    losses = iter([3.0, 1.0, 2.0])
    compute = user_task_my_tasks.RegressionEvaluation.compute
    monkeypatch.setattr(user_task_my_tasks.RegressionEvaluation, "compute",
                        lambda self: {**compute(self), "loss": next(losses)})
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "run", epochs=3),
                       "--optimizer", "adam", "--lr", "1e-3"]) == 0
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2


RESUMED = ("model", "optimizer", "scaler", "rng", "progress")


def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path,
                                                                         task_file):
    args = ("--task", task_file, "--network", "simple_cnn")
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main([*tiny_args(full, epochs=2), *args]) == 0
    with stop_at_step(3):  # of 8: inside the first epoch
        assert train.main([*tiny_args(stopped, epochs=2), *args]) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3
    assert train.main([*tiny_args(stopped, epochs=2), *args, "--resume", "auto"]) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in RESUMED}, {k: b[k] for k in RESUMED})
    timings = ("compute_efficiency", "data_time", "compute_time", "epoch_time",
               "samples_per_sec", "tflops")
    last_full, last_stopped = read_metrics(full)[-1], read_metrics(stopped)[-1]
    assert {k: v for k, v in last_full.items() if k not in timings} == \
        {k: v for k, v in last_stopped.items() if k not in timings}


def test_two_processes_of_8_equal_one_of_16(tmp_path, task_file):
    args = ("--task", task_file, "--optimizer", "sgd", "--momentum", "0", "--lr", "0.01")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train.main([*tiny_args(one, batch=16, epochs=2), *args]) == 0
    torchrun([*tiny_args(two, batch=8, epochs=2), *args])
    torch.testing.assert_close(final_state(two)["model"], final_state(one)["model"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    assert a["step"] == b["step"] == 8
    for key in ("val_loss", "val_r2", "train_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.parametrize("name, expected", [
    ("missing.py:Regression", "no file 'missing.py'"),
    ("{tasks}:Nope", "has no class 'Nope' (its tasks: Regression)"),
    ("{tasks}:RegressionEvaluation", "no tasks.Task subclass 'RegressionEvaluation'"),
    ("regression", "invalid choice: 'regression'"),
])
def test_a_task_that_cannot_be_found_is_one_error_line(tmp_path, task_file, name, expected):
    name = name.format(tasks=task_file.rsplit(":", 1)[0])
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--task", name,
                           *tiny_args(tmp_path / "run")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], \
        done.stderr
    assert not (tmp_path / "run").exists()


def test_test_py_json_holds_the_tasks_figures(tmp_path, task_file):
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "run")]) == 0
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "test.py"), "--checkpoint",
                           str(tmp_path / "run" / "checkpoints" / "last.pt"), "--json",
                           str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report, record = json.loads(out.read_text()), read_metrics(tmp_path / "run")[-1]
    assert report["loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    assert report["r2"] == pytest.approx(record["val_r2"], rel=1e-6, abs=1e-9)
    assert report["count"] == 12  # the synthetic set's validation fifth of 64
