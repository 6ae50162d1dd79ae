"""The LR range test (--find-lr, lr_finder.py): real sweeps on tiny synthetic runs, their
files read back (PNG, JSON, TensorBoard events), the run directory used again afterwards,
divergence, SIGTERM and --resume."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, events, fork_popen, tiny_args
from PIL import Image

import train
from reporting import lr_finder

SUGGESTED = re.compile(r"suggested --lr (\S+) \(steepest fall of the smoothed loss; "
                       r"the minimum / 10 is (\S+)\)")


def read_json(run_dir):
    with open(run_dir / "lr_find.json") as f:
        return json.load(f)


def checkpoint_files(run_dir):
    folder = run_dir / "checkpoints"
    return sorted(os.listdir(folder)) if folder.exists() else []


def smoothed(losses, beta=0.98):
    """fastai's bias-corrected moving average, computed here on its own."""
    out, average = [], 0.0
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** (i + 1)))
    return out


def test_find_lr_writes_the_plot_the_curve_and_tensorboard_and_leaves_the_dir_usable(
        tmp_path, capsys):
    run_dir = tmp_path / "run"
    low, high, steps = 1e-4, 0.5, 30
    code = train.main(tiny_args(run_dir, "--find-lr", "--find-lr-steps", str(steps),
                                "--find-lr-min", str(low), "--find-lr-max", str(high)))
    out = capsys.readouterr().out
    assert code == 0

    with Image.open(run_dir / "lr_find.png") as image:  # a real PNG of a plot's size
        assert image.format == "PNG"
        width, height = image.size
        assert 300 <= width <= 3000 and 200 <= height <= 3000
        image.verify()
    with Image.open(run_dir / "lr_find.png") as image:
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10  # something drawn on it

    record = read_json(run_dir)
    lrs = record["lrs"]
    assert not record["stopped_early"] and len(lrs) == steps  # this sweep stays below 0.5
    assert all(b > a for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == pytest.approx(low) and lrs[-1] == pytest.approx(high)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]  # exponential: a constant ratio
    assert ratios == pytest.approx([(high / low) ** (1 / (steps - 1))] * (steps - 1))
    assert len(record["losses"]) == len(record["smoothed"]) == steps
    assert all(math.isfinite(v) and v > 0 for v in record["losses"])
    assert record["smoothed"] == pytest.approx(smoothed(record["losses"]))
    assert (record["min"], record["max"], record["steps"]) == (low, high, steps)
    assert record["rule"] == "steepest fall of the smoothed loss"
    suggestion = record["suggested_lr"]
    assert low <= suggestion <= high and suggestion in lrs
    best = lrs[int(np.argmin(record["smoothed"]))]
    assert record["min_loss_lr_div10"] == pytest.approx(best / 10)
    printed = SUGGESTED.search(out)
    assert printed, out
    assert float(printed.group(1)) == pytest.approx(suggestion, rel=1e-2)
    assert float(printed.group(2)) == pytest.approx(best / 10, rel=1e-2)
    assert str(run_dir / "lr_find.png") in out and str(run_dir / "lr_find.json") in out

    acc = events(run_dir)
    curve = acc.Scalars("z_lr_find/loss")
    assert [e.step for e in curve] == list(range(steps))
    assert [e.value for e in curve] == pytest.approx(record["smoothed"], rel=1e-5)
    assert [e.value for e in acc.Scalars("z_lr_find/lr")] == pytest.approx(lrs, rel=1e-5)
    plot = acc.Images("z_lr_find/plot")
    assert len(plot) == 1 and (plot[0].width, plot[0].height) == (width, height)

    assert checkpoint_files(run_dir) == []  # nothing to resume from, and no lock left
    assert not (run_dir / ".lock").exists()
    assert "training mlp" not in out  # no epoch was run

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    assert train.main(tiny_args(copy, "--resume", "auto")) == 0  # starts fresh there
    out = capsys.readouterr().out
    assert f"no valid checkpoint in {copy}: starting fresh" in out
    assert train.main(tiny_args(run_dir)) == 0  # a fresh run in the same directory
    assert "last.pt" in checkpoint_files(run_dir) and "last.pt" in checkpoint_files(copy)


def test_a_huge_max_lr_diverges_and_stops_early(tmp_path, capsys):
    steps, high = 60, 1e6
    code = train.main(tiny_args(tmp_path, "--find-lr", "--find-lr-steps", str(steps),
                                "--find-lr-min", "1e-4", "--find-lr-max", str(high)))
    out = capsys.readouterr().out
    assert code == 0
    record = read_json(tmp_path)
    assert record["stopped_early"] and record["stopped_by"] == "diverged"
    lrs, curve = record["lrs"], record["smoothed"]
    assert 3 <= len(lrs) < steps and lrs[-1] < high
    last = curve[-1]  # the reason: not finite, or above 4x the minimum before it
    assert last is None or last > 4 * min(v for v in curve[:-1] if v is not None)
    assert "diverged" in out and f"stopped at step {len(lrs)} of {steps}" in out
    assert record["min"] <= record["suggested_lr"] <= lrs[-1]
    assert SUGGESTED.search(out)
    with Image.open(tmp_path / "lr_find.png") as image:
        assert image.format == "PNG"
    assert checkpoint_files(tmp_path) == []


def test_find_lr_with_resume_is_one_error_line(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path / "run", "--find-lr", "--resume", "auto"))
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --find-lr") and "--resume" in \
        lines[0]
    assert not (tmp_path / "run").exists()


def test_sigterm_during_the_sweep_writes_what_there_is_and_exits_143(tmp_path):
    steps = 100000  # far more than it takes before the signal
    args = tiny_args(tmp_path, "--find-lr", "--find-lr-steps", str(steps),
                     "--find-lr-max", "1e-3")
    proc = fork_popen([sys.executable, "train.py", *args], cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen = []
    try:
        for line in proc.stdout:  # the progress line comes after the first step
            seen.append(line)
            if line.startswith("lr range test  "):
                break
        else:
            pytest.fail(f"the sweep never started: {''.join(seen)[-2000:]}")
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out
    assert "SIGTERM: stopped the LR range test after" in out
    record = read_json(tmp_path)
    assert record["stopped_by"] == "signal" and record["stopped_early"]
    assert 1 <= len(record["lrs"]) < steps
    with Image.open(tmp_path / "lr_find.png") as image:
        assert image.format == "PNG"
    assert checkpoint_files(tmp_path) == []
    assert not (tmp_path / ".lock").exists()


def test_the_suggestion_is_the_steepest_fall_and_the_minimum_over_10():
    lrs = lr_finder.sweep_lrs(1e-6, 1.0, 61)  # a step down centred on lr 1e-3, up after 0.1
    curve = [2.0 - math.tanh(2 * (math.log10(lr) + 3)) + (50 * (lr - 0.1) if lr > 0.1 else 0)
             for lr in lrs]
    steepest, min_over_10 = lr_finder.suggest(lrs, curve)
    assert steepest == pytest.approx(1e-3)
    assert min_over_10 == pytest.approx(lrs[int(np.argmin(curve))] / 10)
    assert lr_finder.suggest(lrs[:2], curve[:2]) == (None, None)  # too few points
    assert lr_finder.suggest(lrs, curve[:30] + [math.nan] * 31)[0] < lrs[30]  # finite part


def test_the_curve_diverges_above_four_times_its_best_or_when_not_finite():
    curve = lr_finder.Curve()
    assert not any(curve.add(1e-3, loss) for loss in [1.0, 0.9, 0.8])
    assert curve.smoothed == pytest.approx(smoothed([1.0, 0.9, 0.8]))
    assert curve.add(1e-2, 500.0)  # smoothed: far above 4x its best
    nan_curve = lr_finder.Curve()
    assert not nan_curve.add(1e-3, 1.0) and nan_curve.add(1e-2, math.nan)
