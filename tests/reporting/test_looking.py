"""What a run shows and what a user reaches for: gradient norms, per-class results and the
confusion image, early stopping, out-of-memory errors and the memory flags (issue 20)."""

import io
import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    events,
    final_state,
    load_test_py,
    read_metrics,
    tiny_args,
)
from PIL import Image

from machinery import engine, meters

# ------------------------------------------------------------------- gradient norm

def _one_step(scaled, clip):
    """A model after one backward pass, the norm of its true gradients, and the norm
    engine's optimizer step counted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled, init_scale=1024.0)
    loop = engine.LoopSettings(device=torch.device("cpu"), scaler=scaler, grad_clip=clip,
                               counters=meters.Counters(torch.device("cpu"), clip))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    grads = [p.grad / (1024.0 if scaled else 1.0) for p in model.parameters()]
    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    engine._optimizer_step(model.parameters(), optimizer, loop)
    return expected, loop.counters.read()


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "fp16-scaler"])
@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e3], ids=["no-clip", "clipped", "not-clipped"])
def test_gradient_norm_is_the_true_norm_before_clipping(scaled, clip):
    expected, counted = _one_step(scaled, clip)
    assert counted["grad_norm_count"] == 1
    assert counted["grad_norm_sum"] == pytest.approx(expected, rel=1e-5)
    assert counted["grad_clipped"] == (1 if 0 < clip < expected else 0)


def test_gradient_norm_logged_at_each_log_step_and_as_the_epochs_mean(tmp_path, train_main):
    clipped, plain = tmp_path / "clipped", tmp_path / "plain"
    assert train_main(tiny_args(clipped, "--grad-clip", "0.01", epochs=2)) == 0
    acc = events(clipped)
    norms = acc.Scalars("train/grad_norm")
    assert [e.step for e in norms] == list(range(1, 9))  # --log-every 1: every step
    assert all(e.value > 0.01 for e in norms)  # before clipping: above the clip
    assert [e.value for e in acc.Scalars("train/grad_clipped")] == [1.0] * 8
    for record in read_metrics(clipped):  # the epoch's mean of its 4 steps
        steps = [e.value for e in norms if record["step"] - 4 < e.step <= record["step"]]
        assert record["grad_norm"] == pytest.approx(sum(steps) / 4, rel=1e-5)
        assert record["grad_clipped"] == 4

    assert train_main(tiny_args(plain, epochs=1)) == 0  # without --grad-clip: no count
    assert "train/grad_clipped" not in events(plain).Tags()["scalars"]
    assert "grad_clipped" not in read_metrics(plain)[0] and read_metrics(plain)[0]["grad_norm"] > 0


# --------------------------------------------------- per-class results, confusion image

def test_confusion_images_and_per_class_accuracy_match_test_py(tmp_path, train_main):
    run_dir = tmp_path / "run"
    assert train_main(tiny_args(run_dir, "--ema-decay", "0.5", "--num-classes", "4",
                                "--lr", "0.002", epochs=2)) == 0
    acc = events(run_dir)
    for tag in ("val/confusion", "val_ema/confusion"):
        shown = acc.Images(tag)
        assert [e.step for e in shown] == [4, 8]  # every validation
        picture = Image.open(io.BytesIO(shown[-1].encoded_image_string))
        assert picture.format == "PNG" and min(picture.size) > 200
        pixels = picture.convert("RGB").getcolors(1 << 20)
        assert len(pixels) > 20  # drawn, not a blank canvas
    last = read_metrics(run_dir)[-1]
    assert list(last["val_class_acc"]) == ["class0", "class1", "class2", "class3"]
    assert list(last["val_class_acc_ema"]) == list(last["val_class_acc"])
    per_sample = sum(last["val_class_acc"].values()) / 4  # balanced classes: 3 each
    assert per_sample == pytest.approx(last["val_acc"])

    report_path = tmp_path / "report.json"
    test_py = load_test_py()
    assert test_py.main(["--checkpoint", str(run_dir / "checkpoints" / "last.pt"),
                         "--weights", "raw",
                         "--num-workers", "0", "--device", "cpu",
                         "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert sorted(set(last["val_class_acc"].values())) != [1.0], last  # not all right
    assert report["per_class"] == pytest.approx(last["val_class_acc"])


def test_confusion_image_for_few_many_and_empty_classes():
    import numpy as np

    from reporting import plots

    few = plots.confusion_image(torch.eye(3, dtype=torch.long) * 4, ["cat", "dog", "emu"])
    many = plots.confusion_image(torch.eye(100, dtype=torch.long), [str(i) for i in range(100)])
    assert few.dtype == many.dtype == np.uint8 and few.shape[2] == many.shape[2] == 3
    assert many.shape[0] > few.shape[0]  # the matrix grows with the classes
    blank = plots.confusion_image(np.zeros((3, 3)), ["a", "b", "c"])  # no sample: no crash
    assert blank.shape == few.shape


# ----------------------------------------------------------------------- early stopping

EARLY = ("--early-stop-patience", "2", "--early-stop-min-delta", "0.5")


def test_early_stop_ends_the_run_with_its_best_epoch(tmp_path, capsys, train_main):
    run_dir = tmp_path / "run"
    assert train_main(tiny_args(run_dir, *EARLY, epochs=8)) == 0
    out = capsys.readouterr().out
    # epoch 1 sets the best; epochs 2 and 3 improve by less than 0.5: stop after epoch 3
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2, 3]
    line = next(line for line in out.splitlines() if line.startswith("early stop"))
    best_epoch = max(read_metrics(run_dir), key=lambda r: r["val_acc"])["epoch"]
    assert f"the best was epoch {best_epoch} " in line
    assert line.endswith(os.path.join(str(run_dir), "checkpoints", "best.pt"))
    progress = final_state(run_dir)["progress"]
    assert progress["early_stop_waited"] == 2 and progress["best_epoch"] == best_epoch

    # resumed after it stopped: it stops again at once, the weights untouched
    before = final_state(run_dir)
    assert train_main(tiny_args(run_dir, *EARLY, "--resume", "auto", epochs=8)) == 0
    assert "early stop at epoch 3" in capsys.readouterr().out
    assert_states_equal(before["model"], final_state(run_dir)["model"])


def test_early_stop_after_a_resume_matches_the_run_that_never_stopped(tmp_path, train_main):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    flags = (*EARLY, "--scheduler", "none")  # --max-steps would shorten a schedule
    assert train_main(tiny_args(whole, *flags, epochs=8)) == 0
    assert train_main(tiny_args(parts, *flags, "--max-steps", "6", epochs=8)) == 0
    assert train_main(tiny_args(parts, *flags, "--resume", "auto", "--max-steps", "0",
                                epochs=8)) == 0
    # (1.5: the --max-steps stop's final validation, a record of its own)
    assert [r["epoch"] for r in read_metrics(parts)] == [1, 1.5, 2, 3]
    # the epoch's gradient norm survives the resume inside epoch 2
    epochs = [r for r in read_metrics(parts) if not r.get("final")]
    assert [r["grad_norm"] for r in epochs] == pytest.approx(
        [r["grad_norm"] for r in read_metrics(whole)], rel=1e-9)
    a, b = final_state(whole), final_state(parts)
    assert a["epoch"] == b["epoch"] == 3
    assert_states_equal(a["model"], b["model"])
    assert a["progress"]["early_stop_waited"] == b["progress"]["early_stop_waited"]


def test_early_stop_patience_off_trains_every_epoch(tmp_path, train_main):
    run_dir = tmp_path / "run"
    assert train_main(tiny_args(run_dir, "--early-stop-min-delta", "0.5", epochs=4)) == 0
    assert len(read_metrics(run_dir)) == 4


# ------------------------------------------------------------------------------ memory

OOM_RUN = ["--dataset", "synthetic", "--synthetic-size", "512", "--image-size", "32",
           "--network", "resnet18", "--epochs", "1", "--num-workers", "0", "--device", "cpu",
           "--log-every", "1"]
ADDRESS_SPACE = int(4.5 * 2**30)  # torch and a resnet18 at batch 4 fit; at batch 512 not


def _limited(*args):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "train.py", *OOM_RUN, *args], cwd=ROOT, env=env,
                          preexec_fn=limit, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS as Linux counts it")
def test_out_of_memory_is_one_line_and_the_checkpoint_survives(tmp_path, train_main):
    run_dir = str(tmp_path / "run")  # (the first run in this process: it fits)
    assert train_main([*OOM_RUN, "--batch-size", "4", "--max-steps", "2", "--run-dir",
                       run_dir]) == 0
    before = os.listdir(os.path.join(run_dir, "checkpoints"))

    proc = _limited("--batch-size", "512", "--resume", "auto", "--max-steps", "4",
                    "--run-dir", run_dir)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = errors[0]
    assert "out of memory in the forward pass at batch size" in line
    assert "--batch-size 256 --virtual-batch-size 512" in line
    for advice in ("--grad-checkpointing", "--amp bf16", "--channels-last"):
        assert advice in line
    assert os.path.join(run_dir, "checkpoints", "last.pt") in line
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == before  # nothing half-written
    saved = torch.load(os.path.join(run_dir, "checkpoints", "last.pt"), weights_only=True)
    assert saved["step"] == 2
    assert not os.path.exists(os.path.join(run_dir, "train.lock"))


def test_out_of_memory_in_evaluation_names_it(tmp_path, monkeypatch, capsys, train_main):
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                           " can't allocate memory: you tried to allocate 4294967296 bytes.")

    real = engine.evaluate

    def evaluate(model, *args, **kwargs):
        monkeypatch.setattr(model, "forward", no_memory)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine, "evaluate", evaluate)
    assert train_main(tiny_args(tmp_path / "run", "--virtual-batch-size", "32",
                                "--grad-checkpointing")) == 1
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "out of memory in evaluation at batch size 12" in line  # the 12 validation images
    assert "it tried to allocate 4.00 GiB more" in line
    assert "--batch-size 8 --virtual-batch-size 32" in line  # 16 / 2, a divisor of 32
    assert "--grad-checkpointing" not in line  # already on


def test_memory_flags_warn_without_cuda(tmp_path, capsys, train_main):
    assert train_main(tiny_args(tmp_path / "run", "--gpu-memory-fraction", "0.5",
                                "--memory-snapshot")) == 0
    err = capsys.readouterr().err
    assert "warning: --gpu-memory-fraction is for CUDA devices" in err
    assert "warning: --memory-snapshot is for CUDA devices" in err


def test_gpu_memory_fraction_must_be_a_share(tmp_path, capsys, train_main):
    assert train_main(tiny_args(tmp_path / "run", "--gpu-memory-fraction", "1.5")) == 2
    assert "--gpu-memory-fraction must be in [0, 1]" in capsys.readouterr().err


def test_early_stop_under_ddp_stops_every_process_with_one_process(tmp_path, train_main):
    """Two processes of 16 stop at the epoch one process of 32 stops at, all of them: the
    validation figures are all-reduced, so each process decides the same."""
    from helpers import torchrun

    flags = (*EARLY, "--no-augment", "--scheduler", "none")
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    out = torchrun(tiny_args(ddp, *flags, batch=16, epochs=8))  # asserts exit 0
    assert train_main(tiny_args(single, *flags, batch=32, epochs=8)) == 0
    assert [r["epoch"] for r in read_metrics(ddp)] == [r["epoch"] for r in read_metrics(single)] \
        == [1, 2, 3]
    assert out.count("early stop at epoch 3") == 1  # said once, by process 0
    # the all-reduced gradients of 2 x 16 have the norm of one process's 32
    assert [r["grad_norm"] for r in read_metrics(ddp)] == pytest.approx(
        [r["grad_norm"] for r in read_metrics(single)], rel=1e-5)
    torch.testing.assert_close(final_state(ddp)["model"], final_state(single)["model"])
