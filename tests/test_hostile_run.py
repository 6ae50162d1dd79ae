"""A run that goes wrong says where and loses nothing (issue 29): checkpoints of a newer
format, older checkpoints without a key, MLflow forks and stores, full disks under the
profiler, the LR range test and the confusion image, a killed trace export."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import FORMAT_1, ROOT, load_test_py, snapshot, tiny_args

import train
from machinery import checkpoint, runtime


def one_error_line(err):
    """The one ``error:`` line of a stderr, asserting there is nothing else."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]




def as_newer_version(path):
    """Rewrites a checkpoint as a newer version of the project would write it: a format
    number above this version's, a valid checksum (save_checkpoint)."""
    state = checkpoint.load_checkpoint(path)
    state.update(format=checkpoint.FORMAT_VERSION + 1, version="9.0.0")
    checkpoint.save_checkpoint(state, path)


# ------------------------------------------------ 1. a newer version's checkpoints

@pytest.fixture
def two_epoch_run(tmp_path):
    """A finished 2-epoch run (last.pt, best.pt, epoch-0001/2.pt)."""
    run = tmp_path / "run"
    assert train.main(tiny_args(run, size=32, image=4, epochs=2)) == 0
    names = sorted(os.listdir(run / "checkpoints"))
    assert names == ["best.pt", "epoch-0001.pt", "epoch-0002.pt", "last.pt"], names
    return run


@pytest.mark.parametrize("newer", [
    ("best.pt", "epoch-0001.pt", "epoch-0002.pt", "last.pt"),  # all: no fresh start
    ("epoch-0002.pt", "last.pt"),  # some: no rewind onto epoch-0001.pt or best.pt
    ("epoch-0002.pt",),            # a rotating one only, last.pt still readable
])
def test_a_newer_versions_checkpoints_are_one_error_and_never_written_over(
        two_epoch_run, newer, capsys):
    run = two_epoch_run
    for name in newer:
        as_newer_version(run / "checkpoints" / name)
    before = snapshot(run)
    capsys.readouterr()
    older = str(run / "checkpoints" / "epoch-0001.pt")
    alone = tiny_args(run, size=32, image=4, epochs=3)
    i = alone.index("--run-dir")
    del alone[i:i + 2]  # --resume PATH alone: the checkpoint's own run directory
    tries = [  # continue it; continue it from an older file, with and without --run-dir
        tiny_args(run, "--resume", "auto", size=32, image=4, epochs=3),
        tiny_args(run, "--resume", older, size=32, image=4, epochs=3),
        [*alone, "--resume", older],
        # another run's file into it
        tiny_args(run, "--resume", FORMAT_1, size=32, image=4, epochs=3),
    ]
    for args in tries:
        assert train.main(args) == 2, args
        line = one_error_line(capsys.readouterr().err)
        assert f"is of format {checkpoint.FORMAT_VERSION + 1} (written by version 9.0.0" \
            in line, line
        assert snapshot(run) == before  # every byte of every file, and no new file


def test_a_newer_checkpoint_elsewhere_does_not_stop_a_fork_from_an_older_file(
        two_epoch_run, capsys):
    as_newer_version(two_epoch_run / "checkpoints" / "last.pt")
    before = snapshot(two_epoch_run)
    fork = two_epoch_run.parent / "fork"
    older = two_epoch_run / "checkpoints" / "epoch-0001.pt"
    assert train.main(tiny_args(fork, "--resume", str(older), size=32, image=4,
                                epochs=2)) == 0
    assert checkpoint.load_checkpoint(fork / "checkpoints" / "last.pt")["epoch"] == 2
    assert snapshot(two_epoch_run) == before


def test_refuse_newer_also_knows_a_newer_checksum(tmp_path):
    d = tmp_path / "run" / "checkpoints"
    d.mkdir(parents=True)
    state = torch.load(FORMAT_1, weights_only=True)
    state["checksum"] = {"algorithm": "sha256-v2", "value": "0" * 64}
    torch.save(state, d / "last.pt")
    with pytest.raises(checkpoint.NewerFormatError, match="checksum of unknown kind"):
        checkpoint.find_latest(tmp_path / "run")


# ------------------------------------------------ 2. an older checkpoint without a key

def without(tmp_path, *keys):
    """The format-1 fixture less ``keys``, as a file (no checksum: an edited file)."""
    state = torch.load(FORMAT_1, weights_only=True)
    state.pop("checksum")
    for key in keys:
        state.pop(key)
    path = tmp_path / f"without-{'-'.join(keys)}.pt"
    torch.save(state, path)
    return path


def fixture_args(run_dir, *extra):
    return tiny_args(run_dir, "--no-augment", *extra, size=32, image=4, batch=16, epochs=2)


@pytest.mark.parametrize("keys, named", [
    (("epoch",), "'epoch' (the finished epochs)"),
    (("rng", "rng_per_rank"), "'rng_per_rank' or 'rng' (the random number generators"),
    (("config",), "'config' (the run's settings)"),
    (("epoch", "rng", "rng_per_rank", "config"), "'epoch' (the finished epochs), "
     "'config' (the run's settings), 'rng_per_rank' or 'rng'"),
    (("step",), "'step' (the optimizer steps)"),
])
def test_an_older_checkpoint_without_a_key_is_one_line_naming_it(tmp_path, keys, named,
                                                                 capsys):
    path = without(tmp_path, *keys)
    assert train.main(fixture_args(tmp_path / "a", "--resume", str(path))) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"checkpoint {str(path)!r} lacks {named}" in line, line
    auto = tmp_path / "auto"
    (auto / "checkpoints").mkdir(parents=True)
    shutil.copy(path, auto / "checkpoints" / "last.pt")
    before = snapshot(auto)
    assert train.main(fixture_args(auto, "--resume", "auto")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "last.pt' lacks " + named in line, line
    assert snapshot(auto) == before
    if "config" in keys:  # test.py reads the config only
        code = load_test_py().main(["--checkpoint", str(path), "--device", "cpu",
                                    "--num-workers", "0"])
        assert code == 2
        assert "lacks 'config' (the run's settings)" in one_error_line(
            capsys.readouterr().err)


def test_a_training_checkpoint_without_weights_is_one_line_everywhere(tmp_path, capsys):
    path = without(tmp_path, "model")
    named = f"checkpoint {str(path)!r} lacks 'model' or 'networks' (the weights)"
    assert train.main(fixture_args(tmp_path / "a", "--resume", str(path))) == 2
    assert named in one_error_line(capsys.readouterr().err)
    assert load_test_py().main(["--checkpoint", str(path), "--device", "cpu"]) == 2
    assert named in one_error_line(capsys.readouterr().err)
    assert train.main(fixture_args(tmp_path / "b", "--pretrained", str(path))) == 2
    assert named in one_error_line(capsys.readouterr().err)
    auto = tmp_path / "auto"
    (auto / "checkpoints").mkdir(parents=True)
    shutil.copy(path, auto / "checkpoints" / "last.pt")
    before = snapshot(auto)
    assert train.main(fixture_args(auto, "--resume", "auto")) == 2  # not skipped
    assert "last.pt' lacks 'model' or 'networks' (the weights)" in \
        one_error_line(capsys.readouterr().err)
    assert snapshot(auto) == before


# ------------------------------------------------ 3-5. MLflow: forks, the bare store

@pytest.fixture(scope="module")
def empty_sqlite_store(tmp_path_factory):
    """An MLflow SQLite store with its tables made (a new one takes some seconds: its
    schema migrations), copied by each test that needs a fresh store."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def mlflow_runs(uri):
    """The runs of the experiment ``synthetic`` in the store at ``uri``, oldest first,
    read with MLflow's own client; and the client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("synthetic")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])
    return client, runs


def curve(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_fork_records_a_new_mlflow_run_tagged_with_its_parent(tmp_path, capsys,
                                                                 monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    assert train.main(tiny_args(run_a, "--mlflow", uri, size=32, image=4, epochs=2)) == 0
    client, (parent,) = mlflow_runs(uri)
    parent_id = parent.info.run_id
    history = {key: curve(client, parent_id, key) for key in ("train/loss", "val_acc")}
    capsys.readouterr()
    older = run_a / "checkpoints" / "epoch-0001.pt"  # the fork the rewind message suggests
    assert train.main(tiny_args(run_b, "--resume", str(older), size=32, image=4,
                                epochs=3)) == 0
    out = capsys.readouterr().out
    client, runs = mlflow_runs(uri)
    assert [r.info.run_id for r in runs][0] == parent_id and len(runs) == 2
    child = runs[1]
    child_id = child.info.run_id
    line = [line for line in out.splitlines() if line.startswith("mlflow:")]
    assert len(line) == 1 and f"recording run {child_id}" in line[0] and \
        f"forked from run {parent_id} (tag parent_run_id)" in line[0], out
    assert child.data.tags["parent_run_id"] == parent_id
    assert child.data.tags["mlflow.parentRunId"] == parent_id
    assert child.data.tags["run_dir"] == str(run_b)
    # A's record is as A left it: nothing of B's appended, still FINISHED
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert {key: curve(client, parent_id, key) for key in history} == history
    assert [s for s, _ in curve(client, child_id, "val_acc")] == [4, 6]
    assert checkpoint.load_checkpoint(run_b / "checkpoints" / "last.pt")[
        "mlflow_run_id"] == child_id
    # B owns its run: continuing B continues it
    capsys.readouterr()
    assert train.main(tiny_args(run_b, "--resume", "auto", size=32, image=4,
                                epochs=4)) == 0
    assert f"mlflow: continuing run {child_id}" in capsys.readouterr().out
    assert len(mlflow_runs(uri)[1]) == 2


def test_a_bare_mlflow_records_into_sqlite_in_the_working_directory(
        tmp_path, empty_sqlite_store, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(empty_sqlite_store, work / "mlflow.db")
    monkeypatch.chdir(work)
    scratch = tmp_path / "scratch" / "x"
    for run_dir in ("exp1", str(scratch)):  # were ../mlruns and <tmp_path>/mlruns
        assert train.main(tiny_args(run_dir, "--mlflow", size=32, image=4)) == 0
    store = f"sqlite:///{work / 'mlflow.db'}"
    out = capsys.readouterr().out
    assert out.count(f"in {store}; look with: mlflow ui --backend-store-uri {store}") == 2
    assert sorted(os.listdir(tmp_path)) == ["scratch", "work"]
    assert sorted(os.listdir(tmp_path / "scratch")) == ["x"]
    assert sorted(os.listdir(work)) == ["exp1", "mlflow.db", "mlruns"]
    client, runs = mlflow_runs(store)  # no MLFLOW_ALLOW_FILE_STORE needed
    assert [r.info.run_name for r in runs] == ["exp1", "x"]
    for run, run_dir in zip(runs, (work / "exp1", scratch)):
        assert run.info.status == "FINISHED"
        assert run.data.params["mlflow"] == store  # the config keeps the store itself
        assert run.info.artifact_uri.startswith(str(work / "mlruns"))
        assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml"}
        state = checkpoint.load_checkpoint(run_dir / "checkpoints" / "last.pt")
        assert state["mlflow_run_id"] == run.info.run_id
        assert state["config"]["mlflow"] == store


def test_a_resume_from_elsewhere_continues_its_run_in_the_sqlite_store(
        tmp_path, empty_sqlite_store, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copy(empty_sqlite_store, work / "mlflow.db")
    monkeypatch.chdir(work)
    run_dir = work / "run"
    assert train.main(tiny_args(run_dir, "--mlflow", "--max-steps", "2", size=32, image=4,
                                epochs=2)) == 0
    store = f"sqlite:///{work / 'mlflow.db'}"
    client, (run,) = mlflow_runs(store)
    first_id = run.info.run_id
    monkeypatch.chdir(elsewhere)  # a requeued job started in another directory
    capsys.readouterr()
    assert train.main(tiny_args(run_dir, "--resume", "auto", "--max-steps", "0", size=32,
                                image=4, epochs=2)) == 0
    assert f"mlflow: continuing run {first_id}" in capsys.readouterr().out
    assert os.listdir(elsewhere) == []
    client, (run,) = mlflow_runs(store)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in curve(client, first_id, "train/loss")] == [1, 2, 3, 4]


# ------------------------------------------------ 6-7. full disks, a killed export

def fill(directory):
    """Fills the file system of ``directory`` to the last byte (a real full disk)."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    try:
        while True:
            os.write(fd, b"\0")
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_trace_on_a_full_disk_is_a_warning_never_announced(tmp_path, mount_tmpfs,
                                                              capfd):
    run = tmp_path / "run"
    profile = mount_tmpfs("size=64k", run / "profile")  # the trace's file system
    fill(profile)
    assert train.main(tiny_args(run, "--profile-steps", "2")) == 0
    out, err = capfd.readouterr()
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "could not write the profiler trace" in warning[0] and \
        "No space left on device" in warning[0], err
    assert "profile: steps" not in out and "tensorboard --logdir" not in out, out
    assert "profile: top operators" in out and "-bound: waited for data" in out
    assert os.listdir(profile) == ["filler"]  # no partial file left behind
    assert "Traceback" not in err


def test_what_a_killed_trace_export_left_goes_at_the_next_start(tmp_path, capfd):
    run = tmp_path / "run"
    assert train.main(tiny_args(run, "--profile-steps", "1", "--max-steps", "2",
                                epochs=2)) == 0
    profile = run / "profile"
    (trace,) = [n for n in os.listdir(profile) if n.endswith(".pt.trace.json")]
    # A process exports under the name profiling.Profile._write gives its temporary file,
    # and is killed (SIGKILL) before it can rename it: what an export cut short leaves.
    code = (f"import os, shutil, signal; from machinery import runtime; "
            f"name = '.tmp-' + runtime.owner_tag() + "
            f"'~rank0.1.pt.trace.json'; shutil.copy({str(profile / trace)!r}, "
            f"os.path.join({str(profile)!r}, name + '.tmp')); "
            f"os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(profile) if n.startswith(".tmp-")]
    assert len(left) == 1 and runtime.orphan(left[0]), left
    mine = profile / f".tmp-{runtime.owner_tag()}~rank0.2.pt.trace.json.tmp"
    mine.write_text("{")  # a live process's export in progress: left alone
    assert train.main(tiny_args(run, "--resume", "auto", epochs=2)) == 0  # no profiling
    assert sorted(os.listdir(profile)) == sorted([trace, mine.name])


def test_the_lr_range_test_on_a_full_disk_warns_per_file_and_still_suggests(
        tmp_path, mount_tmpfs, capfd):
    mount = mount_tmpfs("size=1m")
    run = mount / "run"

    def fill_once_started():  # the disk fills up while the sweep runs
        deadline = time.monotonic() + 60
        while not (run / "summary.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        fill(mount)

    filler = threading.Thread(target=fill_once_started)
    filler.start()
    try:
        code = train.main(tiny_args(run, "--find-lr", "--find-lr-steps", "20"))
    finally:
        filler.join()
    out, err = capfd.readouterr()
    assert code == 0, err
    suggestion = [line for line in out.splitlines() if line.startswith("suggested --lr ")]
    assert len(suggestion) == 1, out
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    for name in ("lr_find.json", "lr_find.png"):
        assert any(f"could not write {run / name}" in w and "No space left on device" in w
                   for w in warnings), err
        assert not (run / name).exists()
    assert "lr_find.png" not in out and "lr_find.json" not in out  # nothing announced
    assert "Traceback" not in err and "error:" not in err
    assert not [n for n in os.listdir(run) if n.startswith(".tmp")]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_tensorboard_image_the_disk_refuses_is_a_warning(tmp_path, mount_tmpfs, capfd):
    import numpy as np

    from ops import RunFailed
    from reporting import runlog

    mount = mount_tmpfs("size=256k")
    log = runlog.RunLog(str(mount), 0, 0, True)
    fill(mount)
    with pytest.raises(RunFailed, match="No space left on device"):  # scalars: the run stops
        for step in range(1, 1000):  # more than the file's last page holds
            log.scalars({"train/loss": 1.0}, step)
        log.flush()
    picture = np.zeros((64, 64, 3), dtype=np.uint8)
    assert log.image("val/confusion", picture, 4) is False
    err = capfd.readouterr().err
    assert f"warning: could not write the TensorBoard image val/confusion (step 4) into " \
        f"{str(mount)!r}: No space left on device" in err
