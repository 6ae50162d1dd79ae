"""Checkpoints you can trust: exact resume, atomic saves, pre-emption (issue 3)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, assert_states_equal, final_state, fork_popen, stop_at_step, tiny_args

import networks
import train
from machinery import checkpoint

# simple_cnn (BatchNorm) with augmentation: 96 samples, 6 steps an epoch, 2 epochs; the
# per-sample DataLoader (with workers, or not), which the device path's own tests mirror.
CNN = dict(network="simple_cnn", size=96, image=16, batch=16, epochs=2)


def cnn_args(run_dir, *extra, workers=0, epochs=2):
    args = tiny_args(run_dir, "--data-on-device", "off", *extra,
                     **{**CNN, "epochs": epochs})
    args[args.index("--num-workers") + 1] = str(workers)
    return args


def assert_same_training_state(a, b):
    assert_states_equal(a["model"], b["model"])
    assert_states_equal(a["optimizer"], b["optimizer"])
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    assert train.main(cnn_args(run_dir)) == 0
    return final_state(run_dir)


@pytest.mark.parametrize("stop_step, workers", [(3, 0), (6, 0), (8, 2)])
def test_stopped_and_resumed_equals_uninterrupted(tmp_path, capsys, uninterrupted,
                                                  stop_step, workers):
    # step 3: mid-epoch; 6: the last step of epoch 1; 8: mid-epoch 2 with 2 workers
    with stop_at_step(stop_step):
        assert train.main(cnn_args(tmp_path, workers=workers)) == 143
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert f"python train.py --resume auto --run-dir {tmp_path}" in out.out
    stopped = final_state(tmp_path)
    assert stopped["step"] == stop_step
    assert train.main(cnn_args(tmp_path, "--resume", "auto", workers=workers)) == 0
    assert_same_training_state(final_state(tmp_path), uninterrupted)
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1, 2]


class DropoutCNN(torch.nn.Module):
    """A small CNN with dropout: its training steps draw from the global RNG."""

    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Dropout(0.5))
        self.fc = torch.nn.Linear(8 * ((image_size + 1) // 2) ** 2, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


@pytest.fixture
def dropout_network(monkeypatch):
    monkeypatch.setitem(networks.NETWORKS, "dropout_cnn", DropoutCNN)
    return "dropout_cnn"


def test_resume_with_dropout_is_exact(tmp_path, dropout_network):
    # Dropout draws its masks from the global RNG, which the checkpoint restores: whatever
    # runs between the restore and the first step (e.g. the FLOP count's forward) must not
    # draw from it, or the resumed run drops other units than the uninterrupted one.
    def args(run_dir, *extra):
        return cnn_args(run_dir, "--network", dropout_network, *extra)

    assert train.main(args(tmp_path / "whole")) == 0
    with stop_at_step(3):  # mid-epoch 1
        assert train.main(args(tmp_path / "run")) == 143
    stopped = final_state(tmp_path / "run")
    assert (stopped["step"], stopped["progress"]["epoch_samples"]) == (3, 48)
    assert train.main(args(tmp_path / "run", "--resume", "auto")) == 0
    assert_same_training_state(final_state(tmp_path / "run"), final_state(tmp_path / "whole"))


def test_mid_epoch_resume_loads_only_unseen_samples(tmp_path, monkeypatch):
    with stop_at_step(4):
        assert train.main(cnn_args(tmp_path, epochs=1)) == 143
    seen = []
    original = train.data.SeededDataset.__getitem__

    def getitem(self, key):
        if isinstance(key, tuple):
            seen.append(key)
        return original(self, key)

    monkeypatch.setattr(train.data.SeededDataset, "__getitem__", getitem)
    assert train.main(cnn_args(tmp_path, "--resume", "auto", epochs=1)) == 0
    assert len(seen) == 96 - 4 * 16  # the 64 samples before the stop are never loaded


def test_tensorboard_after_resume_has_no_duplicated_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with stop_at_step(4):
        assert train.main(cnn_args(tmp_path, "--log-every", "1")) == 143
    # Event files are read in name order: a name holds the second it was made, then the
    # pid and a per-process counter. Two runs of one process in one second would sort
    # by that counter as text ("10" before "9"); real runs are separate processes.
    time.sleep(1.1)
    assert train.main(cnn_args(tmp_path, "--resume", "auto")) == 0
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in ("train/loss", "val/acc", "z_perf/samples_per_sec"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))


def test_resume_restores_config_and_prints_overrides(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, "--lr", "0.02", epochs=1)) == 0
    assert train.main(["--resume", "auto", "--run-dir", str(tmp_path), "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "override: epochs = 2 (checkpoint had 1)" in out
    state = final_state(tmp_path)
    assert state["config"]["lr"] == 0.02 and state["config"]["network"] == "mlp"
    assert state["epoch"] == 2


def test_a_checkpoint_from_before_newer_flags_resumes_with_their_defaults(tmp_path):
    # A checkpoint whose config lacks flags added since (amp, tta, ...) continues exactly
    # as the same checkpoint with them: those flags take their defaults, which it ran with.
    run, whole = tmp_path / "old", tmp_path / "whole"
    assert train.main(tiny_args(run, epochs=1)) == 0
    shutil.copytree(run, whole)
    assert train.main(tiny_args(whole, "--resume", "auto", epochs=2)) == 0
    state = final_state(run)
    state.pop("checksum")
    for key in ("amp", "tta", "channels_last", "data_on_device", "ema_decay", "mixup_alpha",
                "virtual_batch_size", "unfreeze_lr_scale", "prefetch"):
        del state["config"][key]
    for name in os.listdir(run / "checkpoints"):
        os.unlink(run / "checkpoints" / name)
    checkpoint.save_checkpoint(state, run / "checkpoints" / "last.pt")
    assert train.main(tiny_args(run, "--resume", "auto", epochs=2)) == 0
    assert_same_training_state(final_state(run), final_state(whole))
    assert final_state(run)["config"]["amp"] == "none"


def test_resume_auto_without_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, "--resume", "auto")) == 0
    assert "no valid checkpoint" in capsys.readouterr().out
    assert final_state(tmp_path)["epoch"] == 1


def test_truncated_last_falls_back_to_the_newest_valid(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, "--keep-last", "5", epochs=2)) == 0
    done = final_state(tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    blob = last.read_bytes()
    os.unlink(last)  # last.pt is a hard link to epoch-0002.pt: damage only this name
    last.write_bytes(blob[: len(blob) // 2])
    for name in ("epoch-0002.pt", "best.pt"):  # the other names of epoch 2's state
        if (tmp_path / "checkpoints" / name).exists():
            os.unlink(tmp_path / "checkpoints" / name)
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=2)) == 0
    out = capsys.readouterr().out
    assert "warning: skipping" in out and "last.pt" in out
    assert "resuming from" in out and "epoch-0001.pt" in out
    assert_same_training_state(final_state(tmp_path), done)


def test_resume_path_on_a_truncated_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not really a checkpoint")
    assert train.main(tiny_args(tmp_path / "run", "--resume", str(bad))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint") and "bad.pt" in err


def test_checkpoint_of_another_network_lists_the_keys(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path / "mlp")) == 0
    other = tmp_path / "mlp" / "checkpoints" / "last.pt"
    code = train.main(tiny_args(tmp_path / "cnn", "--resume", str(other),
                                "--network", "simple_cnn"))
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit this network" in err and "missing: fc.1.bias" in err
    assert "features.0.block.0.weight" in err and "unexpected: fc.bias" in err


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickled_object_is_refused_and_never_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": {}, "step": 0, "evil": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be loaded safely"):
        checkpoint.load_checkpoint(tmp_path / "evil.pt")
    assert train.main(tiny_args(tmp_path / "run", "--resume", str(tmp_path / "evil.pt"))) == 2
    assert not (tmp_path / "PWNED").exists()


def test_interrupted_save_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk yanked")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk yanked"):
        checkpoint.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path,
                                   also=[tmp_path / "best.pt"])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left


def test_keep_last_rotates_step_and_epoch_files(tmp_path):
    assert train.main(tiny_args(tmp_path, "--ckpt-every-steps", "1", "--keep-last", "3",
                                epochs=2)) == 0
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    # steps 1-3, epoch-0001 (step 4: an epoch's last step saves as epoch-NNNN), steps 5-7,
    # epoch-0002: the newest three of them stay
    assert names == ["best.pt", "epoch-0002.pt", "last.pt", "step-00000006.pt",
                     "step-00000007.pt"]


def test_nonfinite_loss_stops_with_an_error_and_keeps_the_last_good(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    good = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    code = train.main(tiny_args(tmp_path, "--resume", "auto", "--lr", "1e30",
                                "--max-nonfinite", "2", epochs=5))
    err = capsys.readouterr().err
    assert code == 1
    assert "not finite for" in err and "last.pt" in err
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == good
    assert torch.isfinite(final_state(tmp_path)["model"]["fc.weight"]).all()


# ------------------------------------------------------------- real processes, signals

def launch(run_dir, *extra, workers=0):
    """train.py in its own process group (as a shell or a scheduler would start it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return fork_popen([sys.executable, "train.py", *cnn_args(run_dir, *extra,
                                                             workers=workers)],
                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, start_new_session=True, env=env)


def wait_for(path, proc, timeout=120, output=None):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, output() if output else proc.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


SLOW = ("--synthetic-size", "960", "--ckpt-every-steps", "1")  # 60 steps an epoch


@pytest.fixture(scope="module")
def slow_uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slow")
    assert train.main(cnn_args(run_dir, *SLOW)) == 0
    return final_state(run_dir)


# train.py's own __main__, with an optimizer hook that stops after step ``at``: it writes
# the file ``ready`` and waits until the file ``go`` exists. The test signals the process
# group in between, so the signal arrives at a known step, mid-epoch, in a real process.
PAUSED_AT_STEP = """
import os, runpy, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook

ready, go, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
taken = 0

def pause(optimizer, args, kwargs):
    global taken
    taken += 1
    if taken == at:
        open(ready, "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the signal handler has run by now

register_optimizer_step_post_hook(pause)
sys.argv = ["train.py", *sys.argv[4:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_process_group_saves_and_resumes_exactly(tmp_path, signum, code,
                                                               uninterrupted):
    run_dir, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    # No --ckpt-every-steps: a checkpoint inside an epoch can only be the signal's.
    argv = [sys.executable, "-c", PAUSED_AT_STEP, str(ready), str(go), "3",
            *cnn_args(run_dir, workers=2)]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = fork_popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True,
                          start_new_session=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            wait_for(ready, proc, timeout=300, output=(tmp_path / "err").read_text)
            assert not os.path.exists(run_dir / "checkpoints" / "last.pt")
            os.killpg(proc.pid, signum)  # the workers get it too, as with Ctrl-C
            go.touch()
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    name = signal.Signals(signum).name
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Error" not in err, err
    assert f"{name}: stopping after this step" in err
    assert f"{name}: saved " in out
    assert f"Resume with:\n  python train.py --resume auto --run-dir {run_dir}" in out
    names = os.listdir(run_dir / "checkpoints")
    assert "last.pt" in names
    assert not [n for n in names if n.startswith(("step-", "epoch-", "best", ".tmp"))], names
    stopped = final_state(run_dir)
    assert (stopped["epoch"], stopped["step"]) == (0, 3)
    assert stopped["progress"]["epoch_samples"] == 3 * 16  # half of epoch 1's 96 samples
    assert train.main(cnn_args(run_dir, "--resume", "auto", workers=2)) == 0
    assert_same_training_state(final_state(run_dir), uninterrupted)


def test_sigkill_at_random_moments_then_resume_auto(tmp_path, slow_uninterrupted):
    rng = random.Random(0)
    last = tmp_path / "checkpoints" / "last.pt"
    for _ in range(3):
        before = os.stat(last).st_mtime_ns if last.exists() else None
        proc = launch(tmp_path, *SLOW, "--resume", "auto")
        wait_for(last, proc)
        while os.stat(last).st_mtime_ns == before:  # this process is training now
            assert proc.poll() is None
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    assert train.main(cnn_args(tmp_path, *SLOW, "--resume", "auto")) == 0
    assert_same_training_state(final_state(tmp_path), slow_uninterrupted)
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".tmp")]


def test_background_writer_saves_a_snapshot_and_reports_failures(tmp_path, monkeypatch):
    weights = torch.zeros(1000)
    writer = checkpoint.BackgroundWriter()
    writer.submit(checkpoint.to_cpu({"w": weights}), tmp_path / "last.pt")
    weights += 1  # training goes on while the thread writes
    writer.wait()
    assert torch.equal(checkpoint.load_checkpoint(tmp_path / "last.pt")["w"], torch.zeros(1000))

    def full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", full)
    writer.submit({"w": weights}, tmp_path / "last.pt")
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert torch.equal(checkpoint.load_checkpoint(tmp_path / "last.pt")["w"], torch.zeros(1000))


def test_a_failed_checkpoint_write_is_one_error_line(tmp_path, monkeypatch, capsys):
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    # exit 1: the run failed (a disk that refused a write), not a user error
    assert train.main(tiny_args(tmp_path, "--resume", "auto", epochs=2)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: writing a checkpoint") and "No space left" in err[-1]
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


def test_a_resume_onto_a_changed_training_set_says_so_and_continues(tmp_path, capsys):
    from helpers import write_image_folder

    images = write_image_folder(tmp_path / "images", per_class=6, size=(8, 8))
    args = ("--dataset", "imagefolder", "--data-dir", str(images))
    run = tmp_path / "run"
    assert train.main(tiny_args(run, *args, image=8, batch=4, epochs=1)) == 0
    saved = final_state(run)["data"]["train"]
    assert saved["size"] == 18 and len(saved["fingerprint"]) == 64
    capsys.readouterr()
    assert train.main(tiny_args(run, *args, "--resume", "auto", image=8, batch=4,
                                epochs=2)) == 0
    assert "warning: the training set" not in capsys.readouterr().err  # the same set
    (images / "train" / "cat" / "0.png").unlink()  # deleted between a stop and a resume
    assert train.main(tiny_args(run, *args, "--resume", "auto", image=8, batch=4,
                                epochs=3)) == 0
    err = capsys.readouterr().err
    changed = [line for line in err.splitlines() if "warning: the training set" in line]
    assert len(changed) == 1 and "(18 samples then, 17 now)" in changed[0], err
    assert changed[0].endswith("continuing") and final_state(run)["epoch"] == 3
    assert final_state(run)["data"]["train"]["size"] == 17


def test_an_older_checkpoint_saved_before_any_validation_has_no_best_yet():
    """Review 7's S7-27: a checkpoint of before the rename (``best_val_acc``) saved before
    its first validation (``best_epoch`` 0) has no best: -inf, not an accuracy's floor of
    -1, so a task whose figure is below -1 (an R2, a negated FID) still gets its best.pt;
    one that had validated keeps its figure."""
    from machinery import engine

    state = engine.TrainState()
    state.load_state_dict({"epoch": 0, "step": 3, "best_val_acc": -1.0, "best_epoch": 0})
    assert state.best == -float("inf") and state.early_stop_best == -float("inf")
    state = engine.TrainState()
    state.load_state_dict({"epoch": 2, "step": 8, "best_val_acc": 0.625, "best_epoch": 2})
    assert state.best == 0.625
