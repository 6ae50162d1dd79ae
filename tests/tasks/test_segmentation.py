"""--task segmentation through train.py and test.py: the promises a classifier keeps."""

import glob
import json
import math
import os
import signal

import pytest
import torch
from helpers import (
    assert_states_equal,
    events,
    final_state,
    load_test_py,
    put_in_torch_hub,
    read_metrics,
    seg_args,
    stop_at_step,
    torchrun,
    update,
    watch_training,
)

import tasks
import train
from machinery import engine
from tasks.segmentation import Segmentation


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A unet trained for four epochs on the synthetic shapes."""
    run_dir = tmp_path_factory.mktemp("seg")
    assert train.main(seg_args(run_dir, "--lr", "0.1", size=64, epochs=4)) == 0
    return run_dir


def test_a_unet_learns_the_shapes_and_logs_the_figures(learned):
    records = read_metrics(learned)
    assert len(records) == 4
    last = records[-1]
    for key in ("val_loss", "val_miou", "val_pixel_acc", "val_class_iou"):
        assert key in last, key
    assert "val_acc" not in last and "val_acc5" not in last
    assert set(last["val_class_iou"]) == {"background", "rectangle1", "disc2"}
    assert last["val_miou"] > records[0]["val_miou"] and last["val_miou"] > 0.3, records
    assert 0 <= last["val_pixel_acc"] <= 1
    acc = events(learned)
    assert {"val/miou", "val/pixel_acc", "val/loss", "train/loss"} <= set(acc.Tags()["scalars"])
    assert "val/masks" in acc.Tags()["images"]
    miou = [e.value for e in acc.Scalars("val/miou")]
    assert miou == pytest.approx([r["val_miou"] for r in records])
    best = torch.load(os.path.join(learned, "checkpoints", "best.pt"), weights_only=True)
    assert best["progress"]["best"] == max(r["val_miou"] for r in records)
    assert best["config"]["task"] == "segmentation"


def test_test_py_reports_the_logged_miou_and_class_ious(learned, tmp_path):
    out = tmp_path / "report.json"
    test_py = load_test_py()
    assert test_py.main(["--checkpoint", os.path.join(learned, "checkpoints", "last.pt"),
                         "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    last = read_metrics(learned)[-1]
    assert report["miou"] == pytest.approx(last["val_miou"], rel=1e-9)
    assert report["pixel_accuracy"] == pytest.approx(last["val_pixel_acc"], rel=1e-9)
    assert report["per_class_iou"] == pytest.approx(last["val_class_iou"], rel=1e-9)


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_export_gives_per_pixel_logits_checked_against_the_network(learned, tmp_path,
                                                                   suffix, capsys):
    path = tmp_path / f"seg{suffix}"
    test_py = load_test_py()
    assert test_py.main(["--checkpoint", os.path.join(learned, "checkpoints", "last.pt"),
                         "--export", str(path)]) == 0
    assert path.exists() and "max abs difference" in capsys.readouterr().out
    if suffix == ".onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path))
        x = torch.randn(2, 3, 16, 16).numpy()
        (logits,) = session.run(None, {session.get_inputs()[0].name: x})
        assert logits.shape == (2, 3, 16, 16)


def test_quantize_is_refused_in_one_line(learned, tmp_path, capsys):
    test_py = load_test_py()
    code = test_py.main(["--checkpoint", os.path.join(learned, "checkpoints", "last.pt"),
                         "--export", str(tmp_path / "m.onnx"), "--quantize", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --quantize")


@pytest.mark.parametrize("path", [("--num-workers", "0", "--data-on-device", "off"),
                                  ("--num-workers", "2", "--data-on-device", "off"),
                                  ("--data-on-device", "on")])
def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path, path):
    flags = ("--epochs", "2", "--ema-decay", "0.9", *path)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main(seg_args(full, *flags, size=48)) == 0
    with stop_at_step(3):  # of 6 steps: inside the first epoch
        assert train.main(seg_args(stopped, *flags, size=48)) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3
    assert train.main(seg_args(stopped, *flags, "--resume", "auto", size=48)) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in ("model", "ema", "optimizer", "rng")},
                        {k: b[k] for k in ("model", "ema", "optimizer", "rng")})
    assert read_metrics(full)[-1]["val_miou"] == read_metrics(stopped)[-1]["val_miou"]


def test_the_device_path_trains_as_the_dataloader_does(tmp_path, capsys):
    loader, device = tmp_path / "loader", tmp_path / "device"
    assert train.main(seg_args(loader, "--data-on-device", "off", "--num-workers", "2")) == 0
    assert "data path: per-sample DataLoader, 2 workers" in capsys.readouterr().out
    assert train.main(seg_args(device, "--data-on-device", "on")) == 0
    assert "data path: on cpu: synthetic images and masks" in capsys.readouterr().out
    assert_states_equal(final_state(loader)["model"], final_state(device)["model"])


def test_accumulation_equals_the_large_batch(tmp_path):
    big, accumulated = tmp_path / "big", tmp_path / "acc"
    assert train.main(seg_args(big, network="unet_gn", batch=16, epochs=2)) == 0
    assert train.main(seg_args(accumulated, "--virtual-batch-size", "16", network="unet_gn",
                               batch=4, epochs=2)) == 0
    torch.testing.assert_close(final_state(accumulated)["model"], final_state(big)["model"])


def test_two_processes_of_8_train_like_one_of_16(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert train.main(seg_args(one, network="unet_gn", batch=16, epochs=2)) == 0
    torchrun(seg_args(two, network="unet_gn", batch=8, epochs=2))
    torch.testing.assert_close(final_state(two)["model"], final_state(one)["model"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    assert a["val_miou"] == pytest.approx(b["val_miou"], abs=1e-6)
    assert a["val_pixel_acc"] == pytest.approx(b["val_pixel_acc"], abs=1e-6)


def test_bf16_on_the_cpu_trains(tmp_path):
    """--amp bf16: the unet's layers compute in bfloat16 in the training step, its weights
    stay float32 and move as full precision moves them (close, not equal)."""
    updates = {}
    for amp in ("bf16", "none"):
        with watch_training() as (dtypes, start):
            assert train.main(seg_args(tmp_path / amp, "--amp", amp)) == 0
        assert (torch.bfloat16 in dtypes) == (amp == "bf16"), (amp, dtypes)
        assert start and all(p.dtype == torch.float32 for p, _ in start)
        updates[amp] = update(start)
    bf16, full = updates["bf16"], updates["none"]
    assert not torch.equal(bf16, full)
    assert full.norm() > 0 and torch.cosine_similarity(bf16, full, dim=0) > 0.98
    record = read_metrics(tmp_path / "bf16")[-1]
    assert math.isfinite(record["train_loss"]) and 0 <= record["val_miou"] <= 1


def test_freeze_the_backbone_then_unfreeze_it(tmp_path, capsys):
    assert train.main(seg_args(tmp_path / "frozen", "--freeze", "backbone.*", epochs=1)) == 0
    start = tmp_path / "start"
    assert train.main(seg_args(start, "--max-steps", "1", "--freeze", "backbone.*")) == 0
    before, after = final_state(start)["model"], final_state(tmp_path / "frozen")["model"]
    frozen = [k for k in before if k.startswith("backbone.") and "running" not in k
              and "num_batches" not in k]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    # --unfreeze-at 2: the backbone holds its first weights through epoch 1, then trains
    thaw = tmp_path / "thaw"
    assert train.main(seg_args(thaw, "--freeze", "backbone.*", "--unfreeze-at", "2",
                               epochs=2)) == 0
    assert "epoch 2: unfroze" in capsys.readouterr().out
    first, *_ = sorted(glob.glob(str(thaw / "checkpoints" / "epoch-*.pt")))
    first = torch.load(first, weights_only=True)
    assert first["epoch"] == 1 and all(torch.equal(first["model"][k], before[k])
                                       for k in frozen)
    last = final_state(thaw)["model"]
    moved = [k for k in frozen if not torch.equal(last[k], before[k])]
    assert moved == frozen, sorted(set(frozen) - set(moved))


@pytest.mark.parametrize("flags, words", [
    (("--mixup-alpha", "0.2"), "--mixup-alpha mix the images"),
    (("--cutmix-alpha", "1.0"), "--cutmix-alpha mix the images"),
    (("--auto-augment", "trivialaugment"), "--auto-augment trivialaugment would"),
    (("--random-erase", "0.25"), "--random-erase would erase"),
    (("--network", "simple_cnn"), "--network simple_cnn is a classifier"),
    (("--dataset", "cifar10"), "--dataset cifar10 has no masks"),
])
def test_what_makes_no_sense_for_masks_is_one_line(tmp_path, capsys, flags, words):
    assert train.main(seg_args(tmp_path, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_a_segmentation_network_without_the_task_is_one_line(tmp_path, capsys):
    args = [a for a in seg_args(tmp_path) if a not in ("--task", "segmentation")]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train it with --task segmentation" in err[0]


def test_flip_tta_flips_the_logits_back():
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 4, 3, padding=1)  # not mirror-invariant
    x = torch.randn(2, 3, 8, 8)
    got = Segmentation(4).predict(net, x, tta=True)
    want = (net(x) + net(x.flip(-1)).flip(-1)) / 2
    torch.testing.assert_close(got, want)
    y = torch.randint(0, 4, (2, 8, 8))
    y[0, 0, 0] = 255  # ignored
    loop = engine.LoopSettings(device=torch.device("cpu"), show_progress=False)
    result = engine.evaluate(net, [(x, y)], loop, Segmentation(4), tta=True)
    assert result["count"] == 2 * 8 * 8 - 1
    pred = want.argmax(1)
    correct = int(((pred == y) & (y != 255)).sum())
    assert result["pixel_acc"] == pytest.approx(correct / result["count"])


def test_torchvision_segmentation_networks_train_with_their_aux_head(tmp_path, monkeypatch):
    seen = []
    real = Segmentation.loss

    def loss(self, model, x, y):
        value = real(self, model, x, y)
        out = model(x)
        seen.append((set(out), float(value.detach()),
                     float(self.criterion(out["out"], y).detach())))
        return value

    monkeypatch.setattr(Segmentation, "loss", loss)
    assert train.main(seg_args(tmp_path, "--max-steps", "1", network="torchvision/fcn_resnet50",
                               size=4, batch=2, image=32)) == 0
    keys, total, main_only = seen[0]
    assert keys == {"out", "aux"} and total > main_only  # plus 0.5 x the aux head's loss


def test_pretrained_torchvision_weights_train_with_a_new_head(tmp_path, monkeypatch, capsys):
    import networks
    from pipeline import presets

    network = "torchvision/lraspp_mobilenet_v3_large"
    weights = presets.torchvision_weights(network, "torchvision")
    torch.manual_seed(0)
    saved = networks.build_network(network, num_classes=21).state_dict()  # VOC's 21
    put_in_torch_hub(weights, saved, tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert train.main(seg_args(run, "--pretrained", "torchvision", "--max-steps", "1",
                               "--lr", "0", network=network, size=4, batch=2, image=32)) == 0
    out = capsys.readouterr().out
    assert "new heads for 3 classes" in out and "COCO_WITH_VOC_LABELS_V1" in out
    trained = final_state(run)["model"]
    backbone = [k for k in saved if k.startswith("backbone.") and "running" not in k
                and "num_batches" not in k]
    assert backbone and all(torch.equal(trained[k], saved[k]) for k in backbone)  # lr 0
    assert trained["classifier.low_classifier.weight"].shape[0] == 3


def test_the_readme_segmentation_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's first two segmentation commands, from a fresh directory."""
    import re

    from helpers import ROOT, run_as_written

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Segmentation\n.*?```bash\n(.*?)```", readme, flags=re.DOTALL)
    commands = [line.split("#")[0].split() for line in block.group(1).splitlines()][:2]
    assert commands[0][:2] == ["python", "train.py"] and commands[1][:2] == ["python", "test.py"]
    for argv in commands:
        extra = ["--device", "cpu", "--synthetic-size", "48"] if argv[1] == "train.py" else []
        code, out, err = run_as_written([*argv, *extra], tmp_path, monkeypatch, capsys)
        assert code == 0, err[-2000:]
    assert "mIoU" in out and "per-class IoU:" in out


def test_the_masks_picture_shows_the_first_validation_images_truth(learned):
    """val/masks: a row per image (image, truth, prediction); the truth tile's colours map
    back to the first validation sample's mask, and the image tile is the sample itself,
    its normalisation undone."""
    import io

    import numpy as np
    from PIL import Image

    import config
    from tasks import segmentation as seg_metrics

    image = events(learned).Images("val/masks")[-1]
    grid = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    side, pad = 16, 2
    tile = [grid[pad:pad + side, pad + col * (side + pad):pad + col * (side + pad) + side]
            for col in range(3)]
    run_config = config.with_defaults(final_state(learned)["config"])
    _, val_set = tasks.of(run_config).datasets(run_config, print)
    picture, mask = val_set[0]
    palette = seg_metrics.palette(3).numpy()
    truth = np.full(mask.shape, 255)
    for c, colour in enumerate(palette):
        truth[(tile[1] == colour).all(axis=-1)] = c
    assert np.array_equal(truth, mask.numpy())
    mean, std = val_set.transform.mean, val_set.transform.std  # (None: shown as made)
    shown = picture if mean is None else \
        picture * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)
    shown = (shown.clamp(0, 1) * 255).round().permute(1, 2, 0).numpy()
    assert np.abs(shown - tile[0]).max() <= 1
