"""--task pix2pix through train.py and test.py: phases, checkpoints by name, PSNR/SSIM/L1,
the picture, best.pt on the highest PSNR, and the promises every task keeps (exact resume,
N processes == 1, accumulation, AMP, one line for what makes no sense)."""

import json
import math
import os
import re
import signal

import numpy as np
import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    events,
    final_state,
    load_test_py,
    read_metrics,
    run_as_written,
    stop_at_step,
    torchrun,
    update,
    watch_training,
)
from PIL import Image

import config as config_module
import pix2pix
import train

RESUMED = ("networks", "optimizers", "ema", "scaler", "rng", "progress")
TIMES = ("compute_efficiency", "data_time", "compute_time", "epoch_time", "samples_per_sec",
         "tflops")
# Plain SGD for the equalities (as test_gan's: Adam turns a rounding into a whole step)
EQUAL = ("--optimizer", "sgd", "--lr", "0.01", "--momentum", "0")


def p2p_args(run_dir, *extra, batch=8, epochs=2, size=32, image=32, workers=0, width=8):
    """A tiny pix2pix on the synthetic pairs: the paper's Adam recipe (the task's own)."""
    return ["--task", "pix2pix", "--dataset", "synthetic", "--synthetic-size", str(size),
            "--num-classes", "4", "--image-size", str(image), "--pix2pix-width", str(width),
            "--batch-size", str(batch), "--epochs", str(epochs), "--num-workers",
            str(workers), "--log-every", "1", "--device", "cpu", "--run-dir", str(run_dir),
            *extra]


def write_pairs(root, sizes=((40, 40),) * 6, val=3, names=None):
    """A pairfolder tree: ``root/{train,val}/{a,b}/NAME.png``, the target a colour per
    image, the input its darker copy plus noise (learnable)."""
    g = np.random.default_rng(0)
    for split, count in (("train", len(sizes)), ("val", val)):
        for side in ("a", "b"):
            (root / split / side).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = sizes[i % len(sizes)]
            name = names[i] if names else f"img{i:02d}"
            colour = g.integers(40, 256, 3)
            target = np.broadcast_to(colour, (h, w, 3)).astype(np.uint8)
            noisy = target // 2 + g.integers(0, 30, (h, w, 3))
            Image.fromarray(target).save(root / split / "b" / f"{name}.png")
            Image.fromarray(noisy.astype(np.uint8)).save(root / split / "a" / f"{name}.png")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three epochs with a moving average of the generator."""
    run_dir = tmp_path_factory.mktemp("pix2pix")
    assert train.main(p2p_args(run_dir, "--ema-decay", "0.9", epochs=3)) == 0
    return run_dir


def test_pix2pix_logs_its_losses_and_figures(trained):
    record = read_metrics(trained)[-1]
    for key in ("train_loss_d", "train_loss_g", "train_loss_gan", "train_loss_l1",
                "train_d_real", "train_d_fake", "train_grad_norm_generator",
                "train_grad_norm_discriminator", "val_psnr", "val_ssim", "val_l1",
                "val_psnr_ema", "val_ssim_ema", "val_l1_ema"):
        assert math.isfinite(record[key]), key
    assert record["train_loss"] == pytest.approx(record["train_loss_d"] + record["train_loss_g"])
    assert record["train_loss_g"] == pytest.approx(
        record["train_loss_gan"] + 100 * record["train_loss_l1"], rel=1e-5)
    assert 0 < record["val_ssim"] <= 1 and record["val_psnr"] > 0
    acc = events(trained)
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss_d", "train/loss_g", "train/loss_l1", "val/psnr", "val/ssim", "val/l1",
            "val_ema/psnr", "val_ema/ssim", "val_ema/l1"} <= scalars
    psnr = [e.value for e in acc.Scalars("val/psnr")]
    assert psnr == pytest.approx([r["val_psnr"] for r in read_metrics(trained)])
    image = acc.Images("val/pictures")[-1]  # 4 pairs: input | output | target
    assert (image.width, image.height) == (3 * 32 + 4 * 2, 4 * 32 + 5 * 2)
    assert "val_ema/pictures" in acc.Tags()["images"]


def test_checkpoints_hold_each_network_and_optimizer_by_name(trained):
    state = final_state(trained)
    assert state["format"] == 3 and "model" not in state
    assert set(state["networks"]) == set(state["optimizers"]) == {"generator",
                                                                   "discriminator"}
    assert set(state["ema"]) == {"generator"}
    config = state["config"]
    assert (config["in_channels"], config["out_channels"]) == (3, 3)
    generator, discriminator = pix2pix.build(config, 3, 3)
    generator.load_state_dict(state["networks"]["generator"])
    discriminator.load_state_dict(state["networks"]["discriminator"])
    for optimizer in state["optimizers"].values():
        assert optimizer["param_groups"][0]["betas"] == (0.5, 0.999)
        assert optimizer["param_groups"][0]["lr"] == 2e-4


def test_the_psnr_rises_as_it_trains(trained):
    records = read_metrics(trained)
    assert records[-1]["val_psnr"] > records[0]["val_psnr"]
    assert records[-1]["val_l1"] < records[0]["val_l1"]


def test_test_py_reports_what_training_logged_and_writes_the_outputs(trained, tmp_path,
                                                                       capsys):
    out, report = tmp_path / "out", tmp_path / "r.json"
    last = str(trained / "checkpoints" / "last.pt")
    assert load_test_py().main(["--checkpoint", last, "--samples", "3", "--out", str(out),
                                "--json", str(report), "--device", "cpu",
                                "--num-workers", "0"]) == 0
    got, logged = json.loads(report.read_text()), read_metrics(trained)[-1]
    assert got["weights"] == "ema"
    for key in ("psnr", "ssim", "l1"):  # the moving average's, as training measured it
        assert got[key] == pytest.approx(logged[f"val_{key}_ema"], rel=1e-6), key
    assert sorted(os.listdir(out)) == ["000000.png", "000001.png", "000002.png"]
    assert Image.open(out / "000000.png").size == (32, 32)
    # --samples beyond a batch: the first 3 outputs over two batches of 2, no more
    assert load_test_py().main(["--checkpoint", last, "--samples", "3", "--out",
                                str(tmp_path / "out2"), "--batch-size", "2", "--device",
                                "cpu", "--num-workers", "0"]) == 0
    assert sorted(os.listdir(tmp_path / "out2")) == sorted(os.listdir(out))
    # its own earlier output holding another image is replaced, and said so; a user's
    # file of that name is refused before anything is written
    from tasks._generative import encode_png
    (out / "000001.png").write_bytes(encode_png(torch.zeros(3, 32, 32, dtype=torch.uint8)))
    capsys.readouterr()
    assert load_test_py().main(["--checkpoint", last, "--samples", "3", "--out", str(out),
                                "--device", "cpu", "--num-workers", "0"]) == 0
    assert "warning: 1 file(s) in" in capsys.readouterr().err
    Image.new("RGB", (32, 32)).save(out / "000002.png")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert load_test_py().main(["--checkpoint", last, "--samples", "3", "--out", str(out),
                                "--device", "cpu", "--num-workers", "0"]) == 2
    assert "would replace 1 file(s) there that test.py did not write (000002.png)" in \
        capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_test_py_exports_the_generator_with_its_parity_check(trained, tmp_path):
    report = tmp_path / "r.json"
    exported = tmp_path / "generator.pt2"
    assert load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--export", str(exported), "--json", str(report),
                                "--device", "cpu", "--num-workers", "0"]) == 0
    got = json.loads(report.read_text())
    assert got["export"]["max_abs_diff"] < 1e-4 and exported.is_file()
    program = torch.export.load(str(exported))
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    assert program.module()(x).shape == (2, 3, 32, 32)


@pytest.mark.parametrize("flags, words", [
    (("--tta", "flip"), "--tta averages a classifier's predictions"),
    (("--fid-samples", "4"), "--fid-samples measures a GAN's FID"),
    (("--samples", "99", "--out", "o"), "--samples 99: the validation set has 6 pairs"),
])
def test_what_test_py_cannot_do_with_a_pix2pix_checkpoint_is_one_line(trained, tmp_path,
                                                                       capsys, flags, words):
    args = ["--checkpoint", str(trained / "checkpoints" / "last.pt"), "--device", "cpu",
            *[str(tmp_path / f) if f == "o" else f for f in flags]]
    assert load_test_py().main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err


def test_best_pt_follows_the_highest_psnr(tmp_path, monkeypatch):
    """Three epochs whose PSNRs are given (the generator's, then its average's): best.pt
    is the epoch of the average's highest, neither the last nor the generator's best."""
    from tasks import pix2pix as task

    given = iter([5.0, 9.0, 8.0, 3.0, 7.0, 1.0])
    compute = task.Pix2PixEvaluation.compute
    monkeypatch.setattr(task.Pix2PixEvaluation, "compute",
                        lambda self: {**compute(self), "psnr": next(given)})
    assert train.main(p2p_args(tmp_path, "--ema-decay", "0.9", epochs=3)) == 0
    records = read_metrics(tmp_path)
    ema = [r["val_psnr_ema"] for r in records]
    own = [r["val_psnr"] for r in records]
    assert ema == [9.0, 3.0, 1.0] and own == [5.0, 8.0, 7.0]
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 1 != final_state(tmp_path)["epoch"]
    assert best["progress"]["best"] == 9.0


@pytest.mark.parametrize("workers", [2, 0])
def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path, workers):
    """At 64 px: the U-Net's dropout (hashed masks) and the jitter both run."""
    flags = ("--ema-decay", "0.9")
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    kw = dict(image=64, workers=workers)
    assert train.main(p2p_args(full, *flags, **kw)) == 0
    with stop_at_step(5):  # the 5th optimizer step: the discriminator's of global step 3
        assert train.main(p2p_args(stopped, *flags, **kw)) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3  # of 8: inside the first epoch
    assert train.main(p2p_args(stopped, *flags, "--resume", "auto", **kw)) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in RESUMED}, {k: b[k] for k in RESUMED})
    assert read_metrics(full)[-1] == {**read_metrics(stopped)[-1],
                                      **{k: read_metrics(full)[-1][k] for k in TIMES}}


def weights(networks):
    """The float tensors of a checkpoint's networks (not BatchNorm's batch counts)."""
    return {name: {k: v for k, v in state.items() if v.is_floating_point()}
            for name, state in networks.items()}


def test_accumulation_equals_the_large_batch(tmp_path):
    """Per-sample normalisation and hashed dropout, at 64 px (dropout and the jitter on):
    4 micro-batches of 4 are one batch of 16, within rounding. InstanceNorm (the default)
    is compared over one step: over the U-Net's 2x2 maps it amplifies rounding step after
    step (1e-8 after one step, 1e-5 after two); without normalisation over two epochs.
    BatchNorm (a micro-batch's statistics) differs at once: the comparison can fail."""
    def runs(name, *flags, epochs=1):
        big, accumulated = tmp_path / f"{name}-big", tmp_path / f"{name}-acc"
        assert train.main(p2p_args(big, *EQUAL, *flags, batch=16, image=64,
                                   epochs=epochs)) == 0
        assert train.main(p2p_args(accumulated, *EQUAL, *flags, "--virtual-batch-size", "16",
                                   batch=4, image=64, epochs=epochs)) == 0
        assert final_state(accumulated)["step"] == final_state(big)["step"]
        return (weights(final_state(accumulated)["networks"]),
                weights(final_state(big)["networks"]))

    torch.testing.assert_close(*runs("instance", "--max-steps", "1"))
    torch.testing.assert_close(*runs("none", "--pix2pix-norm", "none", epochs=2))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(*runs("batch", "--pix2pix-norm", "batch", "--max-steps",
                                         "1"))


def test_two_processes_of_8_train_like_one_of_16(tmp_path):
    """Two epochs at 64 px (dropout, jitter), without normalisation (see above)."""
    one, two = tmp_path / "one", tmp_path / "two"
    flags = (*EQUAL, "--ema-decay", "0.9", "--pix2pix-norm", "none")
    assert train.main(p2p_args(one, *flags, batch=16, image=64)) == 0
    torchrun(p2p_args(two, *flags, batch=8, image=64))
    torch.testing.assert_close(final_state(two)["networks"], final_state(one)["networks"])
    torch.testing.assert_close(final_state(two)["ema"], final_state(one)["ema"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    for key in ("val_psnr", "val_ssim", "val_l1", "train_loss_d", "train_loss_g"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key


def test_the_dropout_masks_do_not_depend_on_how_a_step_is_split():
    h = torch.ones(8, 4, 3, 3)
    keys = pix2pix.sample_keys(3, 1, torch.arange(10, 18))
    whole = pix2pix.hashed_dropout(h, keys, 1, 0.5)
    parts = [pix2pix.hashed_dropout(h[i:i + 2], keys[i:i + 2], 1, 0.5) for i in (0, 2, 4, 6)]
    assert torch.equal(torch.cat(parts), whole)
    assert 0.3 < (whole == 0).float().mean() < 0.7 and set(whole.unique().tolist()) == {0, 2}
    other = pix2pix.hashed_dropout(h, pix2pix.sample_keys(3, 2, torch.arange(10, 18)), 1, 0.5)
    assert not torch.equal(other, whole)  # another epoch, other masks
    assert not torch.equal(pix2pix.hashed_dropout(h, keys, 2, 0.5), whole)  # another layer


@pytest.mark.parametrize("kind", pix2pix.GAN_LOSSES)
def test_the_discriminators_loss_is_halved_as_the_papers(kind):
    """(loss(D(x, y), real) + loss(D(x, G(x)), fake)) / 2: the paper's D learns at half
    the rate of G; loss_d is that half."""
    torch.manual_seed(0)
    d = pix2pix.PatchDiscriminator(6, width=4)
    x, y, fake = (torch.rand(2, 3, 32, 32) * 2 - 1 for _ in range(3))
    loss, figures = pix2pix.discriminator_loss(d, x, y, fake, pix2pix.criterion(kind))
    with torch.no_grad():
        real_scores, fake_scores = d(torch.cat([x, y], 1)), d(torch.cat([x, fake], 1))
    own = torch.nn.functional.binary_cross_entropy_with_logits if kind == "vanilla" else \
        torch.nn.functional.mse_loss
    both = own(real_scores, torch.ones_like(real_scores)) + \
        own(fake_scores, torch.zeros_like(fake_scores))
    assert float(loss.detach()) == pytest.approx(float(both) / 2, rel=1e-6)
    assert float(figures["loss_d"]) == float(loss.detach())


def _figures_of_outputs_above_their_targets():
    """The validation's figures of outputs 0.1 (one pair) and 0.2 (three pairs) above their
    targets in [-1, 1], met in two batches: ``(result, outputs, targets)``."""
    from tasks import pix2pix as task

    torch.manual_seed(0)
    y = torch.rand(4, 3, 32, 32) * 1.6 - 0.8
    out = y + torch.tensor([0.1, 0.2, 0.2, 0.2]).view(4, 1, 1, 1)
    evaluation = task.Pix2PixEvaluation(torch.device("cpu"))
    evaluation.update(out[:1], y[:1])
    evaluation.update(out[1:], y[1:])
    return evaluation.compute(), out, y


def test_psnr_is_measured_on_images_in_0_1():
    """PSNR of the whole set's mean squared error of the images in [0, 1] (errors 0.05
    and 0.1 there), not in the generator's [-1, 1] (6 dB less)."""
    result, _, _ = _figures_of_outputs_above_their_targets()
    mse = (0.05 ** 2 + 3 * 0.1 ** 2) / 4
    assert result["psnr"] == pytest.approx(10 * math.log10(1 / mse), rel=1e-4)
    assert result["count"] == 4


def test_val_l1_is_the_mean_absolute_error_per_element():
    """val_l1 is the training's ``loss_l1`` scale: the mean absolute error per element in
    [-1, 1] over the whole set (not per pair, pixel or batch; not halved to [0, 1])."""
    result, out, y = _figures_of_outputs_above_their_targets()
    assert result["l1"] == pytest.approx(float(torch.nn.functional.l1_loss(out, y)), rel=1e-5)
    assert result["l1"] == pytest.approx((0.1 + 3 * 0.2) / 4, rel=1e-5)


def test_bf16_on_the_cpu_trains(tmp_path):
    updates = {}
    for amp in ("bf16", "none"):
        with watch_training() as (dtypes, start):
            assert train.main(p2p_args(tmp_path / amp, "--amp", amp, epochs=1)) == 0
        assert (torch.bfloat16 in dtypes) == (amp == "bf16"), (amp, dtypes)
        assert start and all(p.dtype == torch.float32 for p, _ in start)
        updates[amp] = update(start)
    assert not torch.equal(updates["bf16"], updates["none"])
    assert torch.cosine_similarity(updates["bf16"], updates["none"], dim=0) > 0.9
    record = read_metrics(tmp_path / "bf16")[-1]
    assert math.isfinite(record["train_loss_g"]) and math.isfinite(record["val_psnr"])


def test_a_pairfolder_trains_and_test_py_names_the_outputs_after_the_pairs(tmp_path):
    data = write_pairs(tmp_path / "pairs", sizes=((40, 40), (48, 36)) * 3,
                       names=["cat", "dog", "emu", "fox", "gnu", "hen"])
    run = tmp_path / "run"
    args = p2p_args(run, "--dataset", "pairfolder", "--data-dir", str(data), epochs=1)
    assert train.main(args) == 0
    assert math.isfinite(read_metrics(run)[-1]["val_psnr"])
    out = tmp_path / "out"
    assert load_test_py().main(["--checkpoint", str(run / "checkpoints" / "best.pt"),
                                "--samples", "2", "--out", str(out), "--device", "cpu"]) == 0
    assert sorted(os.listdir(out)) == ["cat.png", "dog.png"]


@pytest.mark.parametrize("flags, words", [
    (("--mixup-alpha", "0.2"), "--mixup-alpha/--cutmix-alpha mix the inputs of a batch"),
    (("--auto-augment", "trivialaugment"), "--auto-augment would move the input"),
    (("--random-erase", "0.2"), "--random-erase would erase the input"),
    (("--tta", "flip"), "--tta averages a classifier's predictions"),
    (("--label-smoothing", "0.1"), "--label-smoothing smooths a classifier's labels"),
    (("--freeze", "generator.*"), "--freeze is not for pix2pix's two networks"),
    (("--pretrained", "x.pt"), "--pretrained loads one network's weights"),
    (("--grad-checkpointing",), "--grad-checkpointing has no pix2pix implementation"),
    (("--find-lr",), "--find-lr sweeps one optimizer's learning rate"),
    (("--data-on-device", "on"), "--data-on-device on has no path for pairs"),
    (("--gpus", "0,1"), "--gpus with several GPUs (DataParallel)"),
    (("--network", "resnet18"), "--task pix2pix trains --network pix2pix"),
    (("--image-size", "48"), "--image-size must be a multiple of 32 (got 48)"),
    (("--dataset", "cifar10"), "--task pix2pix: --dataset must be one of pairfolder, "),
    (("--l1-weight", "-1"), "--l1-weight must be at least 0"),
    (("--pix2pix-dropout", "1"), "--pix2pix-dropout must be in [0, 1)"),
])
def test_what_makes_no_sense_for_pix2pix_is_one_line(tmp_path, capsys, flags, words):
    assert train.main(p2p_args(tmp_path, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_the_pix2pix_network_without_the_task_is_one_line(tmp_path, capsys):
    assert train.main(["--dataset", "synthetic", "--network", "pix2pix", "--run-dir",
                       str(tmp_path)]) == 2
    assert "error: --network pix2pix is pix2pix's U-Net generator and PatchGAN " \
        "discriminator: train it with --task pix2pix" in capsys.readouterr().err


def test_the_perceptual_loss_without_vgg19s_weights_names_the_file(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    assert train.main(p2p_args(tmp_path / "run", "--perceptual-weight", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --perceptual-weight 1 needs VGG19's ImageNet weights")
    assert str(tmp_path / "torch-home" / "hub" / "checkpoints" / "vgg19-dcbb9e9d.pth") \
        in err[-1] and "--perceptual-weight 0" in err[-1]


def test_the_perceptual_loss_from_torch_home_trains(tmp_path, monkeypatch):
    """VGG19's features up to relu4_4 (random weights here) in TORCH_HOME's hub cache,
    where PerceptualLoss reads them offline: the loss takes its term."""
    from torchvision.models.vgg import cfgs, make_layers

    hub = tmp_path / "torch-home" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    features = make_layers(cfgs["E"], batch_norm=False)[:27]  # to relu4_4
    torch.save(features.state_dict(), hub / "vgg19-dcbb9e9d.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    run = tmp_path / "run"
    assert train.main(p2p_args(run, "--perceptual-weight", "0.5", epochs=1, size=16)) == 0
    record = read_metrics(run)[-1]
    assert record["train_loss_perceptual"] > 0
    assert record["train_loss_g"] == pytest.approx(
        record["train_loss_gan"] + 100 * record["train_loss_l1"]
        + 0.5 * record["train_loss_perceptual"], rel=1e-5)


def test_without_a_recipe_pix2pix_takes_the_papers():
    config, _ = config_module.parse_config(["--task", "pix2pix", "--dataset", "synthetic"])
    assert (config["network"], config["optimizer"], config["lr"], config["betas"]) == \
        ("pix2pix", "adam", 2e-4, [0.5, 0.999])
    assert (config["weight_decay"], config["scheduler"], config["l1_weight"],
            config["pix2pix_norm"]) == (0.0, "none", 100.0, "instance")
    config, _ = config_module.parse_config(["--task", "pix2pix", "--lr", "0.001"])
    assert config["lr"] == 0.001


def test_the_recipe_is_the_papers_and_trains_in_under_a_minute():
    config, _ = config_module.parse_config(["--config", os.path.join(ROOT, "configs",
                                                                     "pix2pix_synthetic.yaml")])
    config_module.check_config(config)
    assert (config["task"], config["network"], config["optimizer"], config["lr"]) == \
        ("pix2pix", "pix2pix", "adam", 2e-4)
    assert config["l1_weight"] == 100.0 and config["betas"] == [0.5, 0.999]


def test_the_readme_pix2pix_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README section's commands, from a directory holding configs/ (as the repository
    does) and a pairfolder at data/pairs."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Image-to-image \(pix2pix\)\n.*?```bash\n(.*?)```", readme,
                      flags=re.DOTALL)
    commands = [line.split("#")[0].split() for line in block.group(1).splitlines()
                if line.strip()]
    assert [c[:2] for c in commands] == [["python", "train.py"], ["python", "test.py"],
                                         ["python", "test.py"], ["python", "train.py"]]
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    write_pairs(tmp_path / "data" / "pairs")
    small = {0: ["--epochs", "1", "--synthetic-size", "64"],  # smaller than written
             3: ["--epochs", "1", "--pix2pix-width", "8"]}
    for i, argv in enumerate(commands):
        code, _, err = run_as_written([*argv, *small.get(i, []), "--device", "cpu",
                                       "--num-workers", "0"], tmp_path, monkeypatch, capsys)
        assert code == 0, (argv, err[-2000:])
    assert len(os.listdir(tmp_path / "outputs")) == 8
    assert (tmp_path / "generator.onnx").is_file() or (tmp_path / "generator.pt2").is_file()
    assert "val_psnr" in read_metrics(tmp_path / "runs" / "pix2pix-synthetic")[-1]
