"""--task diffusion through train.py and test.py: the noise-prediction loss, the sample
grid and FID on the moving average, best.pt on the lowest FID, and the promises every task
keeps (exact resume, N processes == 1, accumulation, AMP, refusals in one line, export)."""

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
    write_launcher,
    write_mnist,
)

import config as config_module
import ddpm
import train
from machinery import checkpoint

# What every state of a diffusion checkpoint holds that an exact resume restores.
RESUMED = ("model", "optimizer", "ema", "scaler", "rng", "progress")
TIMES = ("compute_efficiency", "data_time", "compute_time", "epoch_time", "samples_per_sec",
         "tflops")


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A small classifier trained on the synthetic set: --fid-features for every run here
    (Inception's weights cannot be downloaded on this machine)."""
    run_dir = tmp_path_factory.mktemp("features")
    assert train.main(["--dataset", "synthetic", "--synthetic-size", "64", "--network", "mlp",
                       "--image-size", "8", "--epochs", "1", "--batch-size", "16",
                       "--num-workers", "0", "--run-dir", str(run_dir)]) == 0
    return str(run_dir / "checkpoints" / "last.pt")


def diffusion_args(run_dir, features, *extra, batch=16, epochs=2, size=64, workers=0):
    """A tiny DDPM on the synthetic set (8 px, width 8, 50 timesteps, DDIM in 3 steps):
    FID on 8 images."""
    return ["--task", "diffusion", "--dataset", "synthetic", "--synthetic-size", str(size),
            "--image-size", "8", "--diffusion-width", "8", "--diffusion-blocks", "1",
            "--diffusion-steps", "50", "--sample-steps", "3", "--fid-samples", "8",
            "--fid-features", features, "--batch-size", str(batch), "--epochs", str(epochs),
            "--num-workers", str(workers), "--log-every", "1", "--run-dir", str(run_dir),
            *extra]


def _without(args, flag, values=1):
    i = args.index(flag)
    return args[:i] + args[i + 1 + values:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, features):
    """Three epochs with a moving average of the U-Net."""
    run_dir = tmp_path_factory.mktemp("ddpm")
    assert train.main(diffusion_args(run_dir, features, "--ema-decay", "0.9", epochs=3)) == 0
    return run_dir


def test_a_diffusion_run_logs_the_loss_and_the_averages_samples(trained):
    records = read_metrics(trained)
    last = records[-1]
    for key in ("train_loss", "val_loss", "val_loss_ema", "val_fid_classifier_ema",
                "val_kid_classifier_ema", "grad_norm"):
        assert math.isfinite(last[key]), key
    # the network itself is not sampled when there is a moving average: only its loss
    assert not [k for r in records for k in r if "fid" in k and not k.endswith("_ema")]
    assert 0 < last["val_loss"] < 1.5 and records[0]["train_loss"] > last["train_loss"] * 0.9
    acc = events(trained)
    scalars, images = set(acc.Tags()["scalars"]), set(acc.Tags()["images"])
    assert {"train/loss", "val/loss", "val_ema/loss", "val_ema/fid_classifier",
            "val_ema/kid_classifier"} <= scalars
    assert "val_ema/samples" in images and "val/samples" not in images
    image = acc.Images("val_ema/samples")[-1]
    assert image.width == image.height == 8 * (8 + 2) + 2  # 64 images of 8 px, 8 by 8


def test_checkpoints_hold_the_unet_its_optimizer_and_average_as_one_network(trained,
                                                                            tmp_path):
    state = final_state(trained)
    assert state["format"] == 2 and "networks" not in state
    config = state["config"]
    assert (config["task"], config["network"], config["in_channels"]) == \
        ("diffusion", "ddpm", 3)
    unet = ddpm.build(config, 3)
    unet.load_state_dict(state["model"])
    unet.load_state_dict(state["ema"])
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {float(state["step"])} == {12.0}
    # A checkpoint of before (format 3, the U-Net by name) loads as this one, and test.py
    # reads its U-Net and its moving average.
    old = {k: v for k, v in state.items() if k not in ("model", "optimizer", "ema")}
    old.update(format=3, networks={"denoiser": state["model"]},
               optimizers={"denoiser": state["optimizer"]}, ema={"denoiser": state["ema"]})
    del old["checksum"]
    torch.save(old, tmp_path / "old.pt")
    read = checkpoint.load_checkpoint(str(tmp_path / "old.pt"))
    assert_states_equal({k: read[k] for k in ("model", "optimizer", "ema", "format")},
                        {k: state[k] for k in ("model", "optimizer", "ema", "format")})
    for weights in ("raw", "ema"):  # test.py's one loader of every task's checkpoints
        got = load_test_py().load_network(read, config, None, "old.pt", weights).state_dict()
        assert_states_equal(got, state["ema" if weights == "ema" else "model"])


def test_the_validation_loss_does_not_depend_on_the_batches(trained):
    """val_loss is a function of the weights (each image's timestep and noise seeded by its
    position): the last checkpoint's U-Net, evaluated in other batches, gives the figure
    the run logged."""
    from tasks import diffusion

    state = final_state(trained)
    config = config_module.with_defaults(dict(state["config"], fid_samples=0))
    train_set, val_set = diffusion.Diffusion.datasets(dict(config, augment=False), print)
    task = diffusion.Diffusion(config, train_set, val_set, 0)
    unet = ddpm.build(config, 3)
    unet.load_state_dict(state["model"])
    x = torch.stack([val_set[i][0] for i in range(len(val_set))])
    evaluation = task.evaluation(torch.device("cpu"), unet)
    for chunk in x.split(5):  # training validated in one batch of 12
        evaluation.update(task.predict(unet, chunk), None, chunk)
    assert evaluation.compute()["loss"] == pytest.approx(read_metrics(trained)[-1]["val_loss"],
                                                         rel=1e-5)


def test_test_py_measures_the_fid_train_py_logged(trained, features, tmp_path):
    report = tmp_path / "r.json"
    assert load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--fid-samples", "8", "--fid-features", features, "--json",
                                str(report), "--device", "cpu", "--num-workers", "0"]) == 0
    got, logged = json.loads(report.read_text()), read_metrics(trained)[-1]
    assert (got["weights"], got["sampler"], got["sample_steps"]) == ("ema", "ddim", 3)
    assert got["fid_classifier"] == pytest.approx(logged["val_fid_classifier_ema"], rel=1e-4)
    assert got["kid_classifier"] == pytest.approx(logged["val_kid_classifier_ema"], rel=1e-3,
                                                  abs=1e-6)


def test_test_py_writes_seeded_pngs_and_says_when_it_replaces_its_own(trained, tmp_path,
                                                                     capsys):
    from PIL import Image

    from tasks._generative import encode_png

    last, out = str(trained / "checkpoints" / "last.pt"), tmp_path / "samples"
    out.mkdir()
    red = torch.tensor([255, 0, 0], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8)
    (out / "000001.png").write_bytes(encode_png(red))  # test.py's, of another checkpoint
    run = ["--checkpoint", last, "--samples", "5", "--out", str(out), "--device", "cpu",
           "--num-workers", "0", "--batch-size", "2"]
    assert load_test_py().main(run) == 0
    captured = capsys.readouterr()
    assert "wrote 5 samples to" in captured.out
    assert "1 file(s) in" in captured.err and "were replaced (000001.png)" in captured.err
    names = sorted(os.listdir(out))
    assert names == [f"{i:06d}.png" for i in range(5)]
    def pixels(folder):
        return torch.stack([torch.from_numpy(np.array(Image.open(folder / n).convert("RGB")))
                            .reshape(-1, 3) for n in names]).float()  # (pixels, RGB) each

    first = pixels(out)
    assert Image.open(out / names[0]).size == (8, 8)
    assert len({tuple(p.flatten().tolist()) for p in first}) == 5
    again = tmp_path / "again"  # another batch size: the same images (rounding apart)
    assert load_test_py().main([*run[:5], str(again), *run[6:-1], "5"]) == 0
    assert (pixels(again) - first).abs().max() <= 1
    other = tmp_path / "other"  # another seed, other images; ddpm's sampler, other too
    assert load_test_py().main([*run[:5], str(other), *run[6:], "--seed", "9"]) == 0
    assert (pixels(other) - first).abs().mean() > 5
    ddpm_dir = tmp_path / "ddpm"
    assert load_test_py().main([*run[:5], str(ddpm_dir), *run[6:], "--sampler", "ddpm",
                                "--sample-steps", "10"]) == 0
    assert (pixels(ddpm_dir) - first).abs().mean() > 5


def test_test_py_seed_0_samples_seed_0_not_the_training_seed(trained, tmp_path):
    """--seed 0 is a seed like any other (not "no --seed"): on a checkpoint trained with
    seed 5 it gives the images of seed 0, those of the run trained with seed 0; without
    --seed, those of seed 5."""
    from PIL import Image

    from machinery import checkpoint

    last = str(trained / "checkpoints" / "last.pt")
    state = torch.load(last, weights_only=True)
    assert state["config"]["seed"] == 0
    state["config"]["seed"] = 5
    five = str(tmp_path / "seed5.pt")
    checkpoint.save_checkpoint({k: v for k, v in state.items() if k != "checksum"}, five)

    def sampled(path, name, *seed):
        out, report = tmp_path / name, tmp_path / f"{name}.json"
        assert load_test_py().main(["--checkpoint", path, "--samples", "3", "--out", str(out),
                                    "--json", str(report), "--device", "cpu",
                                    "--num-workers", "0", *seed]) == 0
        pixels = np.stack([np.array(Image.open(out / f"{i:06d}.png")) for i in range(3)])
        return json.loads(report.read_text())["seed"], pixels

    seed, zero = sampled(last, "trained_with_0")
    assert seed == 0
    seed, got = sampled(five, "seed_0", "--seed", "0")
    assert seed == 0 and np.array_equal(got, zero)
    seed, own = sampled(five, "its_own")
    assert seed == 5 and np.abs(own.astype(int) - zero).mean() > 5


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_the_denoiser_exports_and_matches_the_network(trained, tmp_path, suffix):
    out = tmp_path / f"denoiser{suffix}"
    assert load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--export", str(out), "--device", "cpu", "--num-workers",
                                "0"]) == 0
    state = final_state(trained)
    unet = ddpm.build(state["config"], 3).eval()
    unet.load_state_dict(state["ema"])
    x, t = torch.randn(3, 3, 8, 8), torch.tensor([0.0, 17.0, 49.0])
    with torch.no_grad():
        want = unet(x, t)
    assert want.abs().max() > 1e-4  # trained: no longer the zero of its first step
    if suffix == ".pt2":
        got = torch.export.load(str(out)).module()(x, t)
        metadata = None
    else:
        import onnx
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == ["images", "timesteps"]
        assert [o.name for o in session.get_outputs()] == ["noise"]
        got = torch.from_numpy(session.run(None, {"images": x.numpy(),
                                                  "timesteps": t.numpy()})[0])
        metadata = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if metadata is not None:
        stored = json.loads(metadata["training_config"])
        assert (stored["task"], stored["diffusion_steps"], stored["noise_schedule"]) == \
            ("diffusion", 50, "linear")
        assert metadata["weights"] == "ema" and "timesteps" in metadata["input"]


def test_best_pt_follows_the_lowest_fid_of_the_average(tmp_path, features, monkeypatch):
    from reporting import gan_metrics

    given = iter([5.0, 1.0, 2.0])  # one FID an epoch (the moving average's)
    measure = gan_metrics.measure

    def given_fid(*args, **kwargs):
        return {**measure(*args, **kwargs), "fid_classifier": next(given)}

    monkeypatch.setattr(gan_metrics, "measure", given_fid)
    assert train.main(diffusion_args(tmp_path, features, "--ema-decay", "0.9",
                                     epochs=3)) == 0
    assert next(given, None) is None
    records = read_metrics(tmp_path)
    assert [r["val_fid_classifier_ema"] for r in records] == [5.0, 1.0, 2.0]
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2 and best["progress"]["best"] == -1.0


@pytest.mark.parametrize("path", [("--num-workers", "2", "--data-on-device", "off"),
                                  ("--data-on-device", "on")])
def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path, features,
                                                                        path):
    flags = ("--ema-decay", "0.9", *path)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main(diffusion_args(full, features, *flags)) == 0
    with stop_at_step(3):
        assert train.main(diffusion_args(stopped, features, *flags)) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3  # of 8: inside the first epoch
    assert train.main(diffusion_args(stopped, features, *flags, "--resume", "auto")) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in RESUMED}, {k: b[k] for k in RESUMED})
    assert read_metrics(full)[-1] == {**read_metrics(stopped)[-1],
                                      **{k: read_metrics(full)[-1][k] for k in TIMES}}


# Plain SGD for the equalities below: the sums of a split step add up in another order, and
# Adam turns a gradient that is only rounding into a whole step (divided by its own root
# mean square); with plain SGD two epochs end within rounding of each other.
EQUAL = ("--optimizer", "sgd", "--lr", "0.01", "--momentum", "0")


def test_accumulation_equals_the_large_batch(tmp_path, features):
    big, accumulated = tmp_path / "big", tmp_path / "acc"
    assert train.main(diffusion_args(big, features, *EQUAL, batch=16)) == 0
    assert train.main(diffusion_args(accumulated, features, *EQUAL, "--virtual-batch-size",
                                     "16", batch=4)) == 0
    torch.testing.assert_close(final_state(accumulated)["model"],
                               final_state(big)["model"])
    assert final_state(accumulated)["step"] == final_state(big)["step"] == 8


# The image indices each call of the sampler makes, a line a call, a file a process.
RECORD_SAMPLED = """
import ddpm
forward = ddpm.Sampler.forward
def recorded(self, indices):
    with open(os.path.join({out!r}, os.environ["RANK"]), "a") as f:
        f.write(" ".join(map(str, indices.tolist())) + "\\n")
    return forward(self, indices)
ddpm.Sampler.forward = recorded
"""


def test_two_processes_of_8_train_like_one_of_16(tmp_path, features):
    """And validate like it: FID (of 8 images) within rounding, each process sampling its
    half of them by index (the CUDA review's M3: not process 0 alone while the other
    waits), process 0 the grid too."""
    one, two = tmp_path / "one", tmp_path / "two"
    flags = (*EQUAL, "--ema-decay", "0.9")
    assert train.main(diffusion_args(one, features, *flags, batch=16)) == 0
    (tmp_path / "sampled").mkdir()
    torchrun(diffusion_args(two, features, *flags, batch=8), script=write_launcher(
        tmp_path / "launch.py", RECORD_SAMPLED.format(out=str(tmp_path / "sampled"))))
    torch.testing.assert_close(final_state(two)["model"], final_state(one)["model"])
    torch.testing.assert_close(final_state(two)["ema"], final_state(one)["ema"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    for key in ("train_loss", "val_loss", "val_loss_ema", "val_fid_classifier_ema"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key
    calls = {rank: (tmp_path / "sampled" / str(rank)).read_text().splitlines()
             for rank in (0, 1)}
    from tasks.diffusion import Diffusion

    grid = " ".join(map(str, range(Diffusion.grid)))
    assert calls[0] == ["0 1 2 3", grid] * 2  # 2 epochs, each sampling the average
    assert calls[1] == ["4 5 6 7"] * 2


def test_bf16_on_the_cpu_trains(tmp_path, features):
    """--amp bf16: the U-Net's layers compute in bfloat16 in the training step, the
    weights stay float32 and move as full precision moves them (close, not equal; plain
    SGD, whose step follows the gradient: Adam's sign-like first steps would not)."""
    updates = {}
    for amp in ("bf16", "none"):
        with watch_training() as (dtypes, start):
            assert train.main(diffusion_args(tmp_path / amp, features, *EQUAL, "--amp", amp,
                                             epochs=1)) == 0
        assert (torch.bfloat16 in dtypes) == (amp == "bf16"), (amp, dtypes)
        assert start and all(p.dtype == torch.float32 for p, _ in start)
        updates[amp] = update(start)
    bf16, full = updates["bf16"], updates["none"]
    assert not torch.equal(bf16, full)
    assert full.norm() > 0 and torch.cosine_similarity(bf16, full, dim=0) > 0.9
    record = read_metrics(tmp_path / "bf16")[-1]
    assert math.isfinite(record["train_loss"]) and math.isfinite(record["val_loss"])


def test_fp16_trains_with_its_scaler(tmp_path, features):
    # The step computes in float16 and its loss is scaled: GradScaler's 2**16, halved at
    # each skipped step (growth comes after 2000), and the weights moved.
    with watch_training() as (dtypes, start):
        assert train.main(diffusion_args(tmp_path, features, "--amp", "fp16", epochs=1)) == 0
    state, record = final_state(tmp_path), read_metrics(tmp_path)[-1]
    skipped = state["progress"]["scaler_skips"]
    assert torch.float16 in dtypes and state["step"] == 4 and skipped < 4
    assert state["scaler"]["scale"] == 2.0 ** 16 * 0.5 ** skipped
    assert state["scaler"]["_growth_tracker"] == 4 - skipped if not skipped else True
    assert update(start).norm() > 0 and math.isfinite(record["train_loss"])


@pytest.mark.parametrize("flags, words", [
    (("--mixup-alpha", "0.2"), "--mixup-alpha/--cutmix-alpha mix images and labels"),
    (("--label-smoothing", "0.1"), "--label-smoothing smooths a classifier's targets"),
    (("--augment",), "--augment pads and crops"),
    (("--tta", "flip"), "--tta averages a classifier's predictions"),
    (("--freeze", "denoiser.*"), "--freeze is not for a diffusion model's one U-Net"),
    (("--find-lr",), "--find-lr sweeps a classifier's learning rate"),
    (("--grad-checkpointing",), "--grad-checkpointing has no implementation in ddpm.py"),
    (("--network", "resnet18"), "--task diffusion trains --network ddpm"),
    (("--image-size", "10"), "multiples of 4 from 8 to 256"),
    (("--sample-steps", "51"), "--sample-steps 51: there are 50 timesteps"),
    (("--fid-samples", "50"), "--fid-samples 50: the validation set has 12 images"),
    (("--dataset", "cifar100"), "--dataset must be one of"),
    (("--noise-schedule", "quadratic"), "--noise-schedule"),
])
def test_what_makes_no_sense_for_a_diffusion_model_is_one_line(tmp_path, features, capsys,
                                                               flags, words):
    assert train.main(diffusion_args(tmp_path, features, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_ddpm_without_the_task_is_one_line(tmp_path, capsys):
    assert train.main(["--dataset", "synthetic", "--network", "ddpm", "--run-dir",
                       str(tmp_path)]) == 2
    assert "error: --network ddpm is a diffusion model's U-Net: train it with --task " \
        "diffusion" in capsys.readouterr().err


def test_test_py_refuses_what_a_diffusion_checkpoint_cannot_do(trained, tmp_path, capsys):
    last = str(trained / "checkpoints" / "last.pt")
    for flags, words in ((["--tta", "flip"], "--tta averages a classifier's predictions"),
                         ([], "is a diffusion checkpoint: there is no accuracy"),
                         (["--samples", "2", "--out", str(tmp_path), "--sample-steps", "51"],
                          "--sample-steps 51:"),
                         (["--samples", "2", "--out", str(tmp_path), "--sampler", "x"],
                          "--sampler must be one of ddim, ddpm")):
        assert load_test_py().main(["--checkpoint", last, "--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_fid_samples_0_trains_without_fid_and_best_pt_is_the_last(tmp_path, monkeypatch,
                                                                   capsys):
    """Offline, without Inception's weights and without a classifier, --fid-samples 0
    trains: the first lines say so, no FID is logged, best.pt is the last epoch's, the
    grid (of the network itself: no moving average) is still shown."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # no Inception there
    args = _without(diffusion_args(tmp_path / "run", "x"), "--fid-features")
    args[args.index("--fid-samples") + 1] = "0"
    assert train.main(args) == 0
    captured = capsys.readouterr()
    assert "--fid-samples 0: no FID or KID at validation" in captured.out.split("epoch 1/2")[0]
    assert "--task gan's" not in captured.err  # --fid-samples is the diffusion task's too
    records = read_metrics(tmp_path / "run")
    assert records and not [k for r in records for k in r if "fid" in k or "kid" in k]
    assert all(math.isfinite(r["val_loss"]) for r in records)
    ckpts = tmp_path / "run" / "checkpoints"
    best, last = (torch.load(ckpts / n, weights_only=True) for n in ("best.pt", "last.pt"))
    assert best["epoch"] == last["epoch"] == 2
    assert_states_equal(best["model"], last["model"])
    assert "val/samples" in events(tmp_path / "run").Tags()["images"]


def test_the_default_fid_samples_is_capped_at_the_validation_set_with_one_warning(
        tmp_path, features, capsys):
    args = _without(diffusion_args(tmp_path / "run", features, epochs=1), "--fid-samples")
    assert train.main(args) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --fid-samples: the validation set has 12 images") == 1, err
    assert read_metrics(tmp_path / "run")[-1]["val_fid_classifier"] >= 0  # no EMA: its own


def test_without_a_recipe_a_diffusion_model_takes_the_papers():
    config, _ = config_module.parse_config(["--task", "diffusion", "--dataset", "mnist"])
    assert (config["network"], config["optimizer"], config["lr"], config["weight_decay"],
            config["scheduler"], config["augment"], config["grad_clip"],
            config["label_smoothing"], config["image_size"]) == \
        ("ddpm", "adam", 2e-4, 0.0, "none", False, 1.0, 0.0, 28)
    assert (config["diffusion_steps"], config["noise_schedule"], config["sampler"]) == \
        (1000, "linear", "ddim")


@pytest.mark.parametrize("name, side", [("ddpm_mnist.yaml", 28), ("ddpm_cifar10.yaml", 32)])
def test_the_ddpm_recipes_are_the_papers(name, side):
    config, _ = config_module.parse_config(["--config", os.path.join("configs", name)])
    config_module.check_config(config)
    assert (config["task"], config["network"], config["optimizer"], config["lr"]) == \
        ("diffusion", "ddpm", "adam", 2e-4)
    assert (config["ema_decay"], config["grad_clip"], config["diffusion_steps"],
            config["weight_decay"], config["image_size"]) == (0.9999, 1.0, 1000, 0.0, side)


def test_the_readme_diffusion_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's diffusion commands, from a directory holding MNIST and, as the
    repository does, configs/: the same flags, smaller (appended flags win)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Diffusion \(DDPM, DDIM\)\n.*?```bash\n(.*?)```", readme,
                      flags=re.DOTALL)
    commands = [line.split("#")[0].split() for line in block.group(1).splitlines()]
    assert [c[:2] for c in commands] == [["python", "train.py"]] * 2 + \
        [["python", "test.py"]] * 3 + [["python", "train.py"]]
    write_mnist(tmp_path / "data", train=40, test=12)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    small_net = ["--diffusion-width", "8", "--diffusion-blocks", "1"]
    small = {0: ["--epochs", "1", "--batch-size", "8"],
             1: ["--epochs", "1", "--batch-size", "8", "--fid-samples", "8", "--sample-steps",
                 "2", *small_net],
             2: ["--sample-steps", "2"], 3: ["--sample-steps", "3"], 4: [],
             5: ["--epochs", "1", "--synthetic-size", "32", "--batch-size", "16",
                 "--image-size", "8", "--sample-steps", "2", *small_net]}
    for i, argv in enumerate(commands):
        code, _, err = run_as_written([*argv, *small[i], "--device", "cpu", "--num-workers",
                                       "0"], tmp_path, monkeypatch, capsys)
        assert code == 0, (argv, err[-2000:])
    assert sorted(os.listdir(tmp_path / "samples"))[::63] == ["000000.png", "000063.png"]
    assert len(os.listdir(tmp_path / "samples-ddpm")) == 16
    assert os.path.getsize(tmp_path / "denoiser.onnx") > 0
    assert "val_fid_classifier_ema" in read_metrics(tmp_path / "runs" / "ddpm-mnist")[-1]
    assert "val_loss" in read_metrics(tmp_path / "runs" / "ddpm-synthetic")[-1]
