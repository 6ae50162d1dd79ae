"""--preflight (issue 38): every stage of the run once before its first step, then all put
back: the run that follows is bit for bit the run without it (checkpoint, metrics.jsonl but
its time figures, TensorBoard); `--preflight` alone exits 0 with no checkpoint; a failing
stage is one error line naming it, exit 1."""

import functools
import os
import re
import shlex
import signal
import types

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    events,
    final_state,
    read_metrics,
    run_as_written,
    seg_args,
    stop_at_step,
    tiny_args,
    torchrun,
)

import tasks
import tasks.gan
import train
from machinery import checkpoint, files, preflight

# metrics.jsonl's figures of time and speed: the only ones a preflight may change
TIMED = {"compute_efficiency", "data_time", "compute_time", "epoch_time", "samples_per_sec",
         "tflops", "mfu"}

GLOBAL_DROPOUT = '''
import torch
from tasks.classification import Classification


class GlobalDropout(Classification):
    """A classifier whose dropout draws from torch's global RNG."""

    @classmethod
    def build_networks(cls, config, dataset):
        return torch.nn.Sequential(torch.nn.Dropout(0.3), super().build_networks(config, dataset))
'''


def classifier(run_dir, *extra, workers=0, batch=16):
    """Accumulation (2 micro-batches), EMA, MixUp, flip TTA, clipping, the DataLoader path."""
    return tiny_args(run_dir, "--virtual-batch-size", "32", "--ema-decay", "0.9",
                     "--mixup-alpha", "0.2", "--tta", "flip", "--grad-clip", "1.0",
                     "--data-on-device", "off", "--num-workers", str(workers), *extra,
                     batch=batch, size=80, epochs=2)


def twice(tmp_path, args, *extra):
    """The run without and with ``--preflight train``: their run directories."""
    plain, checked = tmp_path / "plain", tmp_path / "checked"
    assert train.main(args(plain, *extra)) == 0
    assert train.main(args(checked, *extra, "--preflight", "train")) == 0
    return plain, checked


def assert_same_run(a, b, tensorboard=True):
    """The final checkpoints (every tensor and value but the config), metrics.jsonl but
    its time figures, and every TensorBoard scalar (steps and values; the speed figures:
    steps) and image (steps) of two runs are the same."""
    states = [final_state(d) for d in (a, b)]
    for state in states:
        del state["config"], state["checksum"]  # the flags differ by --preflight
    assert_states_equal(*states)
    records = [[{k: v for k, v in r.items() if k not in TIMED} for r in read_metrics(d)]
               for d in (a, b)]
    assert records[0] == records[1] and records[0]
    if not tensorboard:
        return
    ea, eb = events(a), events(b)
    assert ea.Tags()["scalars"] == eb.Tags()["scalars"]
    for tag in ea.Tags()["scalars"]:
        got = [[(s.step, s.value) for s in e.Scalars(tag)] for e in (ea, eb)]
        if tag.startswith("z_perf/"):  # speed: the steps only
            got = [[step for step, _ in g] for g in got]
        assert got[0] == got[1], tag
    assert ea.Tags()["images"] == eb.Tags()["images"]
    for tag in ea.Tags()["images"]:
        assert [s.step for s in ea.Images(tag)] == [s.step for s in eb.Images(tag)], tag


def said(capsys):
    out = capsys.readouterr()
    return out.out + out.err


# ------------------------------------------------------------- the run is the same

def test_a_classifier_with_accumulation_ema_and_mixup_ends_as_without(tmp_path, capsys):
    """(With DataLoader workers: the preflight's loaders have workers of their own.)"""
    plain, checked = twice(tmp_path, functools.partial(classifier, workers=2),
                           "--sample-ledger")
    assert_same_run(plain, checked)
    ledgers = [(d / "samples" / "rank0.jsonl").read_text() for d in (plain, checked)]
    assert ledgers[0] == ledgers[1]  # the run's samples only, none of the preflight's
    line = re.search(r"preflight: (\d+) stages ok in [0-9.]+ s \((.*)\)", said(capsys))
    assert line and line.group(1) == "5", line
    assert "the evaluation of the moving average" in line.group(2)


def test_a_dropout_drawing_from_the_global_rng_ends_as_without(tmp_path, monkeypatch):
    """The preflight's step draws dropout masks from torch's RNG: put back, the run's
    masks are the ones it would have drawn (the device path: no DataLoader)."""
    (tmp_path / "dropped.py").write_text(GLOBAL_DROPOUT)
    monkeypatch.chdir(tmp_path)

    def args(run_dir, *extra):
        return tiny_args(run_dir, "--task", "dropped.py:GlobalDropout", *extra, epochs=2)
    assert_same_run(*twice(tmp_path, args))


def test_segmentation_with_fp16_ends_as_without(tmp_path):
    """(fp16 on the CPU: the GradScaler's scale and growth tracker are put back too.)"""
    assert_same_run(*twice(tmp_path, seg_args, "--ema-decay", "0.9", "--epochs", "2",
                           "--amp", "fp16"))


def test_a_resumed_run_ends_as_resumed_without(tmp_path):
    """Stopped inside an epoch (--max-steps), then resumed with and without the preflight:
    its step starts at the run's position, which stays the run's."""
    plain, checked = tmp_path / "plain", tmp_path / "checked"
    for run_dir in (plain, checked):
        assert train.main(classifier(run_dir, "--max-steps", "2")) == 0
    assert final_state(plain)["progress"]["epoch_samples"] == 64  # inside epoch 1 of 80
    assert train.main(classifier(plain, "--resume", "auto", "--max-steps", "0")) == 0
    assert train.main(classifier(checked, "--resume", "auto", "--max-steps", "0",
                                 "--preflight", "train")) == 0
    assert final_state(checked)["step"] == 6  # 3 steps an epoch
    assert_same_run(plain, checked, tensorboard=False)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A small classifier: --fid-features (Inception's weights cannot be downloaded)."""
    run_dir = tmp_path_factory.mktemp("features")
    assert train.main(tiny_args(run_dir, size=32)) == 0
    return str(run_dir / "checkpoints" / "last.pt")


def gan(features):
    def args(run_dir, *extra):
        return ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", "48",
                "--gan-width", "8", "--latent-dim", "16", "--fid-samples", "8",
                "--fid-features", features, "--batch-size", "8", "--epochs", "2",
                "--optimizer", "adam", "--lr", "0.0002", "--scheduler", "none",
                "--warmup-epochs", "0", "--num-workers", "0", "--log-every", "1",
                "--ema-decay", "0.9", "--device", "cpu", "--run-dir", str(run_dir), *extra]
    return args


def test_a_gan_with_its_fid_ends_as_without(tmp_path, features, capsys):
    assert_same_run(*twice(tmp_path, gan(features)))
    assert "preflight: 5 stages ok" in said(capsys)


def test_a_diffusion_model_with_its_fid_ends_as_without(tmp_path, features):
    def args(run_dir, *extra):
        return ["--task", "diffusion", "--dataset", "synthetic", "--synthetic-size", "48",
                "--image-size", "8", "--batch-size", "8", "--epochs", "1", "--fid-samples",
                "8", "--fid-features", features, "--diffusion-width", "8", "--sample-steps",
                "2", "--ema-decay", "0.9", "--num-workers", "0", "--log-every", "1",
                "--device", "cpu", "--run-dir", str(run_dir), *extra]
    assert_same_run(*twice(tmp_path, args))


def test_a_gan_whose_fid_needs_more_than_one_batch(tmp_path, features, capsys,
                                                  monkeypatch):
    """--fid-samples above the validation batch (8 of the 9 images): the preflight
    measures FID on the batch's 8 (the same code on fewer images, not the whole set's
    worth: --fid-samples 10000 would take minutes); a task that refuses one batch anyway
    is evaluated on the whole validation set."""
    from reporting import gan_metrics

    real_measure, measured = gan_metrics.measure, []  # (real images, generated images)
    monkeypatch.setattr(gan_metrics, "measure", lambda f, real, fake, *args, **kw: (
        measured.append((len(real), len(fake))), real_measure(f, real, fake, *args, **kw))[1])
    assert train.main(gan(features)(tmp_path / "run", "--fid-samples", "9",
                                    "--preflight")) == 0
    out = said(capsys)
    assert "preflight: the evaluation: FID and KID on one batch's 8 images (the run's: 9)" \
        in out and "on the whole validation set" not in out
    assert "preflight: 5 stages ok" in out
    assert measured == [(8, 8), (8, 8)]  # the network's and its moving average's

    monkeypatch.setattr(tasks.gan.GAN, "evaluating_on", tasks.Task.evaluating_on)
    measured.clear()
    assert train.main(gan(features)(tmp_path / "whole", "--fid-samples", "9",
                                    "--preflight")) == 0
    out = said(capsys)
    assert "preflight: the evaluation: one batch is too few (--fid-samples 9: the " \
        "validation set has 8 images" in out and "on the whole validation set" in out
    assert "preflight: 5 stages ok" in out and (9, 9) in measured


def test_torchrun_ends_as_without(tmp_path):
    """2 processes: each takes its share of the step and the batch, process 0 writes and
    compares the checkpoint (every process's RNG gathered), all put back."""
    plain, checked = tmp_path / "plain", tmp_path / "checked"
    torchrun(classifier(plain, "--data-on-device", "on", batch=8))
    out = torchrun(classifier(checked, "--data-on-device", "on", "--preflight", "train",
                              batch=8))
    assert out.count("preflight: 5 stages ok") == 1  # process 0 says it
    assert_same_run(plain, checked)


def test_a_run_resumed_at_an_epochs_end_preflights_and_ends_as_never_stopped(tmp_path,
                                                                           capsys):
    """SIGTERM right after an epoch's last step: last.pt holds the whole epoch's samples,
    its validation not yet done. The preflight of the resume takes its step from the next
    epoch (this one has no batch left), and the run then ends where the run that never
    stopped ends."""
    full, run = tmp_path / "full", tmp_path / "run"
    assert train.main(tiny_args(full, epochs=2)) == 0
    with stop_at_step(4):  # 64 samples of 16: the first epoch's last step
        assert train.main(tiny_args(run, epochs=2)) == 128 + signal.SIGTERM
    saved = checkpoint.load_checkpoint(str(run / "checkpoints" / "last.pt"))
    assert (saved["epoch"], saved["progress"]["epoch_samples"]) == (0, 64)
    capsys.readouterr()
    assert train.main(tiny_args(run, "--resume", "auto", "--preflight", "train",
                                epochs=2)) == 0
    assert "preflight: 4 stages ok" in said(capsys)
    states = [final_state(d) for d in (full, run)]
    for state in states:
        del state["config"], state["checksum"]
    assert_states_equal(*states)


# ------------------------------------------------------------ --preflight alone

def test_preflight_alone_exits_0_and_leaves_no_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train.main(classifier(run_dir, "--preflight")) == 0
    out = said(capsys)
    assert "preflight: 5 stages ok" in out and "everything put back" in out
    assert "training mlp" not in out  # no training
    assert "BatchNorm" not in out  # an mlp: accumulation is exactly the large batch
    assert os.listdir(run_dir / "checkpoints") == []
    assert read_metrics(run_dir) == []
    assert "train/loss" not in events(run_dir).Tags()["scalars"]
    assert not [n for n in os.listdir(run_dir) if n.startswith(".tmp-")]
    # the directory then takes the run itself, which is the run without it (TensorBoard
    # holds the first set-up's summary and first batch too: set-up, not preflight)
    assert train.main(classifier(run_dir)) == 0
    assert train.main(classifier(tmp_path / "plain")) == 0
    assert_same_run(run_dir, tmp_path / "plain", tensorboard=False)


def test_the_put_back_is_what_makes_the_run_the_same(tmp_path, monkeypatch):
    """Without the put back the run is another one: the comparison above sees it."""
    (tmp_path / "dropped.py").write_text(GLOBAL_DROPOUT)
    monkeypatch.chdir(tmp_path)

    def args(run_dir, *extra):
        return tiny_args(run_dir, "--task", "dropped.py:GlobalDropout", *extra)
    def the_saver_only(self):  # (else the run's checkpoints go to the preflight's)
        self.training.saver.dir, self.training.saver.last_saved = self.saver
    monkeypatch.setattr(preflight.Snapshot, "put_back", the_saver_only)
    plain, checked = twice(tmp_path, args)
    with pytest.raises(AssertionError):
        assert_same_run(plain, checked)


# --------------------------------------------------- a failing stage: one error line

def fails(args, capsys):
    code = train.main(args)
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1, (code, out.out[-2000:], out.err[-2000:])
    assert "Traceback" not in out.err
    return lines[0]


def test_a_checkpoint_that_reads_back_different_is_named(tmp_path, monkeypatch, capsys):
    real = checkpoint.load_checkpoint

    def altered(path, **kwargs):
        state = real(path, **kwargs)
        state["model"]["fc.weight"] = state["model"]["fc.weight"] + 1e-3
        return state
    monkeypatch.setattr(checkpoint, "load_checkpoint", altered)
    line = fails(classifier(tmp_path / "run", "--preflight"), capsys)
    assert line.startswith("error: preflight: the checkpoint read back differs at "
                           "model/fc.weight (")
    assert not (tmp_path / "run").exists()  # a fresh run that failed: its directory goes


def test_an_unwritable_run_directory_is_named(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    real = files.probe_writable

    def refused(directory):
        if os.path.samefile(directory, run_dir):
            raise PermissionError(13, "Permission denied", os.path.join(directory, ".tmp-x"))
        real(directory)
    monkeypatch.setattr(preflight, "files", types.SimpleNamespace(probe_writable=refused))
    line = fails(classifier(run_dir, "--preflight", "train"), capsys)
    assert line == (f"error: preflight: the output directories: {run_dir}: Permission "
                    f"denied ({run_dir / '.tmp-x'})")
    assert not run_dir.exists()


def test_an_evaluation_that_raises_is_named(tmp_path, monkeypatch, capsys):
    from tasks import classification

    def broken(model, x, tta=False):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x3 and 4x5)")
    monkeypatch.setattr(classification.Classification, "predict", staticmethod(broken))
    line = fails(classifier(tmp_path / "run", "--preflight", "train"), capsys)
    assert line == ("error: preflight: the evaluation failed: RuntimeError: mat1 and mat2 "
                    "shapes cannot be multiplied (16x3 and 4x5)")


def test_a_damaged_validation_file_is_its_own_line_not_one_batch_too_few(tmp_path,
                                                                          monkeypatch, capsys):
    """Review 6's F12: an error of the one-batch evaluation other than ``TooFewImages`` (a
    GAN's --fid-samples) is named at once, as the run would name it (a mistake in the
    data: exit 2); the whole validation set is not evaluated first."""
    from ops import UserError
    from tasks import classification

    calls = []

    def damaged(model, x, tta=False):
        calls.append(len(x))
        raise UserError("cannot read val/a/im000.jpg (OSError: image file is truncated)")
    monkeypatch.setattr(classification.Classification, "predict", staticmethod(damaged))
    assert train.main(classifier(tmp_path / "run", "--preflight")) == 2
    out = said(capsys)
    assert [line for line in out.splitlines() if "error" in line or "preflight" in line] \
        == ["error: preflight: the evaluation: cannot read val/a/im000.jpg (OSError: image "
            "file is truncated)"]
    assert calls == [16]  # one batch, once


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_preflight_alone_ends_it_at_once(tmp_path, capsys, signum):
    """Review 6's F8: Ctrl-C or SIGTERM in --preflight's training step (check only) ends it
    there, 128 + the signal's number, one line saying nothing was saved; not "stages ok"
    and exit 0, as if a script could go on."""
    run_dir = tmp_path / "run"
    with stop_at_step(1, signum):
        assert train.main(classifier(run_dir, "--preflight")) == 128 + signum
    out = capsys.readouterr()
    name = signal.Signals(signum).name
    assert out.err.strip().splitlines() == [
        f"{name}: stopped during the preflight; no step was taken, so nothing was saved and "
        f"nothing half-written is left"]
    assert "stages ok" not in out.out and not run_dir.exists()


def test_a_step_whose_loss_is_not_finite_is_named(tmp_path, monkeypatch, capsys):
    from tasks import classification
    real = classification.Classification.loss

    def diverged(self, model, x, y):
        return real(self, model, x, y) * float("nan")
    monkeypatch.setattr(classification.Classification, "loss", diverged)
    line = fails(classifier(tmp_path / "run", "--preflight"), capsys)
    assert line == "error: preflight: the training step: the loss of step 1 is not finite"


def test_preflight_is_refused_with_what_trains_no_run(tmp_path, capsys):
    assert train.main(classifier(tmp_path / "a", "--preflight", "--find-lr")) == 2
    assert "error: --preflight checks a run, --find-lr trains none" in said(capsys)
    assert train.main(classifier(tmp_path / "b", "--preflight", "--verify-resume")) == 2
    assert "--verify-resume starts and resumes runs of its own: drop --preflight" \
        in said(capsys)


# -------------------------------------------------------------------------- README

def readme_section():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("### Check every stage before the first hour: `--preflight`", 1)[1] \
        .split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_the_readme_section_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)[0].splitlines()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # --verify-resume's runs: two on two cores
    outputs = []
    for command in commands:
        code, out, err = run_as_written(shlex.split(command.split("  #")[0]), tmp_path,
                                        monkeypatch, capsys)
        assert code == 0, out[-2000:] + err[-2000:]
        outputs.append(out)
    assert all("preflight: 5 stages ok in" in out for out in outputs)
    assert "training simple_cnn" not in outputs[0] and "done:" in outputs[1]
    assert os.listdir(tmp_path / "runs" / "check" / "checkpoints") == []
    assert "last.pt" in os.listdir(tmp_path / "runs" / "checked" / "checkpoints")
    assert torch.load(tmp_path / "runs" / "checked" / "checkpoints" / "last.pt",
                      weights_only=True)["epoch"] == 2


def test_preflight_says_batchnorm_makes_accumulation_close_not_exact(tmp_path, capsys):
    """Design review 7: accumulation equals one large batch only without BatchNorm;
    --preflight says so where a run has both (simple_cnn, 2 micro-batches of 16)."""
    assert train.main(tiny_args(tmp_path / "run", "--network", "simple_cnn",
                                "--virtual-batch-size", "32", "--preflight")) == 0
    notes = [line for line in said(capsys).splitlines() if "BatchNorm" in line]
    assert len(notes) == 1 and "is close to, not exactly, one batch of 32" in notes[0]
