"""Nothing lost, nothing silent (issue 10): non-finite weights, damaged metrics, forks
of a run, file systems that refuse writes, concurrent runs, signals, pipes and logs."""

import errno
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    final_state,
    fork_popen,
    fork_run,
    read_metrics,
    tiny_args,
    write_image_folder,
)

import train
from machinery import checkpoint, meters
from machinery.saving import Kind
from reporting import runlog


def ckpt(run_dir, name="last.pt"):
    return torch.load(os.path.join(run_dir, "checkpoints", name), weights_only=True)


def finite(state):
    return all(torch.isfinite(t).all() for t in state["model"].values()
               if t.is_floating_point())


def one_error_line(err):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith("error: "), err
    return lines[-1]




# ------------------------------------------------------------ 1. non-finite weights

def test_exploding_weights_are_never_saved_and_the_named_checkpoint_is_good(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path, "--lr", "1e30", "--ckpt-every-steps", "1",
                                "--keep-last", "2", "--max-nonfinite", "1000", epochs=3))
    err = capsys.readouterr().err
    assert code == 1
    line = one_error_line(err)
    assert "weights are not finite" in line
    named = line.split("The last good checkpoint is ")[1].strip()
    assert named != "none" and finite(torch.load(named, weights_only=True))
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    assert saved and all(finite(ckpt(tmp_path, name)) for name in saved if name.endswith(".pt"))
    assert any(name.startswith("step-") for name in saved)  # rotation kept finite ones


def test_weights_gone_non_finite_after_a_finite_loss_are_never_saved(tmp_path, capsys):
    # The loss of a step is computed before its update: the update that makes a weight
    # NaN comes with a finite loss, and the save after that step must still refuse.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def poison(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == 3:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[0] = float("nan")

    handle = register_optimizer_step_post_hook(poison)
    try:
        code = train.main(tiny_args(tmp_path, "--ckpt-every-steps", "1", "--keep-last", "5",
                                    epochs=2))
    finally:
        handle.remove()
    assert code == 1
    line = one_error_line(capsys.readouterr().err)
    assert "the weights are not finite at step 3" in line
    assert line.endswith(str(tmp_path / "checkpoints" / "last.pt"))  # step 2's, named
    names = [n for n in os.listdir(tmp_path / "checkpoints") if n.endswith(".pt")]
    assert ckpt(tmp_path)["step"] == 2 and all(finite(ckpt(tmp_path, n)) for n in names)


def test_nonfinite_losses_are_left_out_of_the_logged_mean():
    counters = meters.Counters(torch.device("cpu"))
    counters.add_loss(torch.tensor(float("nan")), 4)
    counters.add_loss(torch.tensor(2.0), 4)
    counters.add_loss(torch.tensor(float("inf")), 4)
    values = counters.read()
    assert values["loss_sum"] == 8.0 and values["loss_count"] == 4 and values["samples"] == 12
    assert values["streak"] == 1 and values["worst_streak"] == 1


# --------------------------------------------------------------- 4. metrics.jsonl

def test_damaged_metrics_lines_are_dropped_with_a_warning(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'[1, 2]\nnull\n{"epoch": "2"}\n\xff\xfe\n{"epoch": true}\n{"epoch": 1, "st')
    capsys.readouterr()
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=2)) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "metrics.jsonl" in err and "Traceback" not in err
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]


# ------------------------------------------------------- 6. --resume PATH, no --run-dir

def test_resuming_an_old_checkpoint_without_run_dir_refuses_to_rewind(tmp_path, capsys):
    run = tmp_path / "run"
    assert train.main(tiny_args(run, "--keep-last", "5", epochs=3)) == 0
    last, lines = (run / "checkpoints" / "last.pt").read_bytes(), read_metrics(run)
    argv = tiny_args(run, "--resume", str(run / "checkpoints" / "epoch-0001.pt"), epochs=3)
    del argv[argv.index("--run-dir"):argv.index("--run-dir") + 2]
    capsys.readouterr()
    assert train.main(argv) == 2
    assert "--run-dir" in one_error_line(capsys.readouterr().err)
    assert (run / "checkpoints" / "last.pt").read_bytes() == last and read_metrics(run) == lines
    # An explicit --run-dir forks the run; the original stays as it was.
    assert train.main(argv + ["--run-dir", str(tmp_path / "fork")]) == 0
    assert ckpt(tmp_path / "fork")["epoch"] == 3 and read_metrics(run) == lines
    # The newest checkpoint continues its own run.
    argv = tiny_args(run, "--resume", str(run / "checkpoints" / "last.pt"), epochs=4)
    del argv[argv.index("--run-dir"):argv.index("--run-dir") + 2]
    assert train.main(argv) == 0
    assert ckpt(run)["epoch"] == 4


def test_an_older_step_checkpoint_of_the_newest_epoch_does_not_rewind_the_run(tmp_path,
                                                                               capsys):
    # The newest checkpoint and an older one of the same epoch (steps 7 and 5, both in
    # the second epoch): comparing epochs would take step 5 for the newest.
    run = tmp_path / "run"
    assert train.main(tiny_args(run, "--ckpt-every-steps", "1", "--keep-last", "10",
                                "--max-steps", "7", size=64, epochs=3)) == 0
    assert ckpt(run)["step"] == 7 and ckpt(run, "step-00000005.pt")["epoch"] == \
        ckpt(run)["epoch"] == 1  # 4 steps an epoch: both in the second one
    last = (run / "checkpoints" / "last.pt").read_bytes()
    argv = tiny_args(run, "--resume", str(run / "checkpoints" / "step-00000005.pt"),
                     size=64, epochs=3)
    del argv[argv.index("--run-dir"):argv.index("--run-dir") + 2]
    capsys.readouterr()
    assert train.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "(step 5) is not the newest checkpoint" in line and "(step 7)" in line
    assert (run / "checkpoints" / "last.pt").read_bytes() == last


def test_a_checkpoint_from_another_machine_needs_a_run_dir(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path / "run", epochs=1)) == 0
    state = ckpt(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere" / "run"
    state["config"]["run_dir"] = str(elsewhere)
    checkpoint.save_checkpoint(state, str(tmp_path / "copied.pt"))  # a new checksum
    argv = tiny_args("x", "--resume", str(tmp_path / "copied.pt"), epochs=2)
    del argv[argv.index("--run-dir"):argv.index("--run-dir") + 2]
    assert train.main(argv) == 2
    assert "--run-dir" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "elsewhere").exists()


# ------------------------------------------------------------------- 8. file systems

@pytest.mark.parametrize("case", ["file", "under_a_file", "checkpoints_is_a_file"])
def test_run_dirs_that_cannot_be_used_are_one_error_line(tmp_path, capsys, case):
    (tmp_path / "f").write_text("a file")
    run = {"file": tmp_path / "f", "under_a_file": tmp_path / "f" / "run",
           "checkpoints_is_a_file": tmp_path / "run"}[case]
    if case == "checkpoints_is_a_file":
        run.mkdir()
        (run / "checkpoints").write_text("a file")
    assert train.main(tiny_args(run)) == 2
    assert str(run) in one_error_line(capsys.readouterr().err)
    assert (tmp_path / "f").read_text() == "a file"


def test_a_run_dir_the_file_system_refuses_creates_nothing(tmp_path, capsys):
    too_long = tmp_path / "a" / "b" / "c" / ("x" * 300) / "run"  # NAME_MAX is 255 here
    assert train.main(tiny_args(too_long)) == 2
    assert "File name too long" in one_error_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []  # not one of the parents it would have made


def test_a_run_that_fails_before_a_checkpoint_removes_the_parents_it_made(tmp_path, capsys):
    run = tmp_path / "new" / "runs" / "exp"
    args = tiny_args(run, "--dataset", "imagefolder", "--data-dir", str(tmp_path / "none"))
    assert train.main(args) == 2
    one_error_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []


def test_a_read_only_run_dir_is_one_error_line(mount_tmpfs, capsys):
    mount = mount_tmpfs("ro,size=1m")
    assert train.main(tiny_args(mount / "run")) == 2
    assert str(mount / "run") in one_error_line(capsys.readouterr().err)


def test_a_full_disk_mid_run_is_one_error_line_and_keeps_the_checkpoints(mount_tmpfs, capsys):
    mount = mount_tmpfs("size=2m")
    run = mount / "run"
    assert train.main(tiny_args(run, epochs=1)) == 0
    before = (run / "checkpoints" / "last.pt").read_bytes()
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last byte
        while True:
            os.write(fd, b"\0" * 512)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    capsys.readouterr()
    code = train.main(tiny_args(run, "--resume", "auto", "--ckpt-every-steps", "1",
                                epochs=3))
    err = capsys.readouterr().err
    assert code == 1, err
    assert "No space left" in one_error_line(err)
    assert (run / "checkpoints" / "last.pt").read_bytes() == before
    assert not [n for n in os.listdir(run / "checkpoints") if n.startswith(".tmp")]


def test_a_failed_background_write_stops_the_run_at_once(tmp_path, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code = train.main(tiny_args(tmp_path, "--ckpt-every-steps", "1", epochs=3))
    err = capsys.readouterr().err
    assert code == 1
    assert "No space left" in one_error_line(err)
    assert len(calls) == 2  # nothing was trained and saved after the failure
    assert ckpt(tmp_path)["step"] == 1


# ------------------------------------------------------------ 9. one run per run dir

def launch(run_dir, *extra):
    args = tiny_args(run_dir, "--synthetic-size", "4000", "--log-every", "5", *extra,
                     epochs=50)
    return fork_popen([sys.executable, "train.py", *args], cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_for_line(proc, text, timeout=120):
    deadline = time.time() + timeout
    seen = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return
    proc.kill()
    raise AssertionError(f"{text!r} never appeared: {''.join(seen)[-2000:]}")


def test_a_second_run_in_the_same_run_dir_is_refused(tmp_path, capsys):
    proc = launch(tmp_path)
    try:
        wait_for_line(proc, "training mlp")
        code = train.main(tiny_args(tmp_path, "--resume", "auto"))
        line = one_error_line(capsys.readouterr().err)
        assert code == 2 and f"pid {proc.pid}" in line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    # The killed run left a stale lock: the next run takes it over with a warning.
    assert (tmp_path / ".lock").exists()
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=1)) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.out + captured.err and str(proc.pid) in captured.out + \
        captured.err
    assert not (tmp_path / ".lock").exists()


# --------------------------------------------------- 10. failures before the first step

def test_a_run_that_fails_before_training_leaves_no_run_dir(tmp_path, monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", offline)
    monkeypatch.chdir(tmp_path)
    argv = tiny_args("unused", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                     "--network", "simple_cnn")
    del argv[argv.index("--run-dir"):argv.index("--run-dir") + 2]
    assert train.main(argv) == 2
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
    assert train.main(tiny_args(tmp_path / "explicit", "--dataset", "imagefolder",
                                "--data-dir", str(tmp_path / "nowhere"))) == 2
    assert not (tmp_path / "explicit").exists()


# ----------------------------------------------------------- 12. pretrained files

@pytest.mark.parametrize("payload", [{"fc.1.weight": 1}, {"model": [1]}, [1, 2], {}])
def test_pretrained_files_without_weights_are_one_error_line(tmp_path, capsys, payload):
    torch.save(payload, tmp_path / "weights.pt")
    code = train.main(tiny_args(tmp_path / "run", "--pretrained", str(tmp_path / "weights.pt")))
    assert code == 2
    assert "weights.pt" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------- 13. signals, pipes, terminals

def test_sighup_saves_and_exits_129_then_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    args = ("--synthetic-size", "640", "--log-every", "1")
    assert train.main(tiny_args(full, *args, epochs=2)) == 0
    proc = fork_popen([sys.executable, "train.py",
                       *tiny_args(tmp_path / "run", *args, epochs=2)],
                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, start_new_session=True,
                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wait_for_line(proc, "training mlp")
    os.killpg(proc.pid, signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 129, err
    assert "SIGHUP: saved" in out and "--resume auto" in out and "Traceback" not in err
    assert train.main(tiny_args(tmp_path / "run", *args, "--resume", "auto", epochs=2)) == 0
    assert_states_equal(final_state(tmp_path / "run")["model"], final_state(full)["model"])


def test_a_closed_stdout_pipe_does_not_stop_the_training(tmp_path):
    proc = fork_popen([sys.executable, "train.py", *tiny_args(tmp_path, epochs=2)],
                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `python train.py | head -0`: the reader is gone
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert ckpt(tmp_path)["epoch"] == 2


def _loading_torch(pid):
    """Whether process ``pid`` has begun to map torch's libraries (train.py sets its Ctrl-C
    handler before it imports torch)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "torch" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("script", ["train.py", "test.py", "sweep.py"])
def test_ctrl_c_while_importing_exits_quietly_with_130(tmp_path, script):
    """Each script sets its Ctrl-C handler before it imports torch (test.py's too: round
    7's F12 script, its signal landing as test.py loads or exits, saw a traceback or a
    death by SIGINT)."""
    args = {"train.py": tiny_args(tmp_path), "test.py": ["--checkpoint", str(tmp_path)],
            "sweep.py": [str(tmp_path / "sweep.yaml")]}[script]
    proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # python is up and torch is loading: its handler is set
    while not _loading_torch(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out == ""  # it stopped during the imports


# ------------------------------------------------------- 14, 15. logs, loss curves

def test_a_log_file_gets_plain_lines_not_bar_redraws(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = fork_run([sys.executable, "train.py",
                         *tiny_args(tmp_path / "run", "--synthetic-size", "256",
                                    epochs=2)],
                        cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0
    text = log.read_text()
    assert "\r" not in text
    assert "epoch 1/2" in text and "done:" in text


def test_plain_progress_lines_follow_log_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runlog.Progress, "PLAIN_EVERY", 0.0)
    assert train.main(tiny_args(tmp_path, "--log-every", "2", epochs=1)) == 0
    err = capsys.readouterr().err
    assert err.count("epoch 1/1  2/4 batches") == 1 and err.count("epoch 1/1  4/4 batches") == 1
    assert "1/4 batches" not in err and "\r" not in err


def test_a_run_shorter_than_log_every_still_draws_its_loss_curve(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert train.main(tiny_args(tmp_path, "--log-every", "1000", epochs=2)) == 0
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8]
    assert [e.step for e in events.Scalars("train/lr")] == [4, 8]
    mean = [r["train_loss"] for r in read_metrics(tmp_path)]
    torch.testing.assert_close([e.value for e in events.Scalars("train/loss")], mean)


def test_unreadable_images_are_counted_in_the_epoch_summary(tmp_path, capsys):
    write_image_folder(tmp_path / "data", classes=("a", "b"), per_class=4, size=(16, 16))
    bad = tmp_path / "data" / "train" / "a" / "broken.png"
    bad.write_bytes(b"")
    code = train.main(tiny_args(tmp_path / "run", "--dataset", "imagefolder", "--data-dir",
                                str(tmp_path / "data"), "--image-size", "16", "--batch-size",
                                "4", epochs=2))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert str(bad) in captured.err
    assert "1 unreadable image(s) skipped so far" in captured.out
    assert [r.get("unreadable_images") for r in read_metrics(tmp_path / "run")] == [1, 1]


def test_a_directory_named_last_pt_is_found_before_training(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    os.replace(tmp_path / "checkpoints" / "last.pt", tmp_path / "checkpoints" / "old.pt")
    (tmp_path / "checkpoints" / "last.pt").mkdir()
    capsys.readouterr()
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=2)) == 2
    captured = capsys.readouterr()
    assert "is a directory" in one_error_line(captured.err)
    assert "training mlp" not in captured.out  # before a step was lost


def test_a_tensorboard_write_the_disk_refuses_is_one_error_line(tmp_path, monkeypatch, capsys):
    from tensorboard.summary.writer import record_writer

    real_write, calls = record_writer.RecordWriter.write, []

    def write(self, data):
        calls.append(1)
        if len(calls) > 20:  # in the second epoch
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    code = train.main(tiny_args(tmp_path, epochs=3))
    err = capsys.readouterr().err
    assert code == 1
    line = one_error_line(err)
    assert "TensorBoard" in line and "No space left" in line and str(tmp_path) in line
    assert finite(ckpt(tmp_path))  # what was saved stays usable


# ------------------------------------ round 5's F7: a signal or a kill during validation

def _epoch_records(run_dir):
    """metrics.jsonl's epoch records without the figures of time."""
    timed = ("samples_per_sec", "compute_efficiency", "data_time", "compute_time",
             "epoch_time", "time", "tflops", "mfu", "wall_time")
    return [{k: v for k, v in r.items() if k not in timed and not k.endswith("_s")}
            for r in read_metrics(run_dir) if "val_loss" in r]


def test_sigterm_during_a_long_validation_stops_at_once_and_resumes_exactly(tmp_path,
                                                                              monkeypatch):
    """F7: the epoch's checkpoint is written before its validation, and a stop signal
    during a long validation (a GAN's FID) ends it at once, not when it ends (SIGTERM's
    grace period is 30 s under SLURM); the resume validates again and ends where a run
    that never stopped ends."""
    full = tmp_path / "full"
    assert train.main(tiny_args(full, epochs=2)) == 0
    validate, calls = train.validate, []

    def long_validation(training):
        calls.append(training.state.step)
        if len(calls) == 1:  # the first epoch's: the signal comes 0.1 s into a minute
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            time.sleep(60)
        return validate(training)

    old = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(train, "validate", long_validation)
    started = time.monotonic()
    try:
        assert train.main(tiny_args(tmp_path / "run", epochs=2)) == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - started < 30  # not the minute of the validation
    saved = ckpt(tmp_path / "run")
    assert (saved["epoch"], saved["progress"]["epoch_samples"]) == (0, 64)  # all trained
    monkeypatch.setattr(train, "validate", validate)
    assert train.main(tiny_args(tmp_path / "run", "--resume", "auto", epochs=2)) == 0
    assert_states_equal(final_state(tmp_path / "run")["model"], final_state(full)["model"])
    assert _epoch_records(tmp_path / "run") == _epoch_records(full)


def test_a_kill_during_validation_costs_no_step_of_the_epoch(tmp_path):
    """F7: SIGKILL in the middle of the first epoch's validation: the resume starts from
    the epoch's training, saved before the validation (not from scratch), and ends where a
    run that never stopped ends."""
    full = tmp_path / "full"
    assert train.main(tiny_args(full, epochs=2)) == 0
    script = tmp_path / "kill.py"
    script.write_text(f"import os, signal, sys\nsys.path.insert(0, {ROOT!r})\nimport train\n"
                      f"train.validate = lambda training: os.kill(os.getpid(), "
                      f"signal.SIGKILL)\nsys.exit(train.main(sys.argv[1:]))\n")
    proc = fork_run([sys.executable, str(script), *tiny_args(tmp_path / "run",
                                                             epochs=2)],
                    cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert ckpt(tmp_path / "run")["progress"]["epoch_samples"] == 64
    assert train.main(tiny_args(tmp_path / "run", "--resume", "auto", epochs=2)) == 0
    assert_states_equal(final_state(tmp_path / "run")["model"], final_state(full)["model"])
    assert _epoch_records(tmp_path / "run") == _epoch_records(full)


# ---------------------------------------- round 6's F4, F11: a stop during a validation

def test_a_signal_during_the_save_before_a_validation_ends_the_run_before_it(tmp_path,
                                                                             monkeypatch):
    """F7: a SIGTERM that comes while the epoch's last.pt is written (before its
    validation, a long FID) ends the run there: the validation does not start."""
    save, validate, calls = train.save, train.validate, []

    def save_then_signal(training, kind, best=False):
        save(training, kind, best)
        if kind is Kind.STOP and not calls:  # the save before the first validation
            calls.append("saved")
            os.kill(os.getpid(), signal.SIGTERM)

    def long_validation(training):
        calls.append("validated")
        time.sleep(20)
        return validate(training)

    monkeypatch.setattr(train, "save", save_then_signal)
    monkeypatch.setattr(train, "validate", long_validation)
    started = time.monotonic()
    assert train.main(tiny_args(tmp_path, epochs=2)) == 128 + signal.SIGTERM
    assert calls == ["saved"] and time.monotonic() - started < 15
    assert ckpt(tmp_path)["progress"]["epoch_samples"] == 64  # the epoch's training, saved


def test_a_max_steps_stop_saves_before_its_final_validation_and_a_signal_ends_it(
        tmp_path, monkeypatch):
    """F4: a --max-steps stop inside an epoch writes last.pt before its final validation
    (a SIGKILL there loses no step), and a SIGTERM during that validation (a long FID)
    ends it at once (exit 143), not when it ends."""
    validate, saved = train.validate, []
    last = os.path.join(tmp_path, "checkpoints", "last.pt")

    def long_validation(training):
        saved.append(os.path.exists(last) and ckpt(tmp_path)["step"])  # what a kill leaves
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        return validate(training)

    monkeypatch.setattr(train, "validate", long_validation)
    started = time.monotonic()
    code = train.main(tiny_args(tmp_path, "--max-steps", "3", epochs=2))  # 4 steps an epoch
    assert (code, saved) == (128 + signal.SIGTERM, [3])
    assert time.monotonic() - started < 15  # not the validation's 20 s
    assert ckpt(tmp_path)["progress"]["epoch_samples"] == 3 * 16
    # Round 7's F1: the command it prints (--resume auto, the same flags) takes no step: the
    # final validation the signal cut, once; and again, the same (each start no step more).
    monkeypatch.setattr(train, "validate", validate)
    saved_state, written = ckpt(tmp_path), os.stat(last).st_mtime_ns
    for _ in range(2):
        assert train.main(tiny_args(tmp_path, "--max-steps", "3", "--resume", "auto",
                                    epochs=2)) == 0
        assert_states_equal(ckpt(tmp_path), saved_state)
        assert os.stat(last).st_mtime_ns == written  # not even saved again
        records = read_metrics(tmp_path)
        assert [(r["step"], r.get("final")) for r in records] == [(3, True)]


def test_an_epoch_resumed_at_its_validation_reports_no_speed(tmp_path, monkeypatch, capsys):
    """F11: stopped in an epoch's validation, then resumed, the epoch trains no step: its
    record has no time keys (not 0 samples/s) and its line says so, with no advice on
    workers; the next epoch's record has them all, as ever."""
    validate = train.validate

    def stopped(training):  # the first epoch's validation: a SIGTERM
        monkeypatch.setattr(train, "validate", validate)
        os.kill(os.getpid(), signal.SIGTERM)
        return validate(training)

    monkeypatch.setattr(train, "validate", stopped)
    assert train.main(tiny_args(tmp_path, epochs=2)) == 128 + signal.SIGTERM
    capsys.readouterr()
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=2)) == 0
    timed = {"compute_efficiency", "data_time", "compute_time", "epoch_time",
             "samples_per_sec", "tflops"}
    first, second = read_metrics(tmp_path)
    assert not timed & set(first) and "val_acc" in first and timed <= set(second)
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("epoch 1/2"))
    assert lines[at].endswith("speed not measured (no step since the resume)"), lines[at]
    assert not lines[at + 1].startswith("  "), lines[at + 1]  # no advice
