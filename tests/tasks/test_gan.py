"""--task gan through train.py: phases, checkpoints by name, FID, and the promises a
classifier keeps (exact resume, N processes == 1, accumulation, AMP)."""

import json
import math
import os
import re
import signal

import pytest
import torch
from helpers import (
    assert_states_equal,
    events,
    final_state,
    load_test_py,
    read_metrics,
    stop_at_step,
    torchrun,
    update,
    watch_training,
    write_launcher,
)

import config as config_module
import dcgan
import tasks
import train
from machinery import engine, meters
from reporting import metrics
from tasks.gan import GAN

# What every state of a GAN checkpoint holds that an exact resume restores.
RESUMED = ("networks", "optimizers", "ema", "scaler", "rng", "progress")


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A small classifier trained on the synthetic set: --fid-features for every run here
    (Inception's weights cannot be downloaded on this machine)."""
    run_dir = tmp_path_factory.mktemp("features")
    assert train.main(["--dataset", "synthetic", "--synthetic-size", "64", "--network", "mlp",
                       "--epochs", "1", "--batch-size", "16", "--num-workers", "0",
                       "--run-dir", str(run_dir)]) == 0
    return str(run_dir / "checkpoints" / "last.pt")


def gan_args(run_dir, features, *extra, batch=16, epochs=2, size=64, workers=0):
    """A tiny DCGAN on the synthetic set: the paper's Adam recipe, FID on 8 images."""
    return ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", str(size),
            "--gan-width", "8", "--latent-dim", "16", "--fid-samples", "8",
            "--fid-features", features, "--batch-size", str(batch), "--epochs", str(epochs),
            "--optimizer", "adam", "--lr", "0.0002", "--betas", "0.5", "0.999",
            "--weight-decay", "0", "--scheduler", "none", "--warmup-epochs", "0",
            "--num-workers", str(workers), "--log-every", "1", "--run-dir", str(run_dir),
            *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, features):
    """Three epochs with a moving average of the generator."""
    run_dir = tmp_path_factory.mktemp("gan")
    assert train.main(gan_args(run_dir, features, "--ema-decay", "0.9", epochs=3)) == 0
    return run_dir


def test_a_gan_logs_what_users_look_at(trained):
    record = read_metrics(trained)[-1]
    for key in ("train_loss_d", "train_loss_g", "train_d_real", "train_d_fake",
                "train_grad_norm_discriminator", "train_grad_norm_generator",
                "val_fid_classifier", "val_kid_classifier", "val_fid_classifier_ema",
                "val_kid_classifier_ema"):
        assert record[key] == record[key], key  # present and not NaN
    assert 0 <= record["train_d_real"] <= 1 and 0 <= record["train_d_fake"] <= 1
    # train_loss: the sum of the phases' losses
    assert record["train_loss"] == pytest.approx(record["train_loss_d"] + record["train_loss_g"])
    line = metrics.epoch_line(record, {"epochs": 3, "num_workers": 0}, type(
        "T", (tasks.Task,), {"best": "fid_classifier",
                             "shown_figures": GAN.shown_figures})())
    assert f"train_loss_d {record['train_loss_d']:.4f}  train_loss_g " \
        f"{record['train_loss_g']:.4f}  val_fid_classifier" in line
    acc = events(trained)
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss_d", "train/loss_g", "train/d_real", "train/d_fake",
            "val/fid_classifier", "val_ema/fid_classifier"} <= scalars
    assert "val/fid" not in scalars  # classifier features are never named as Inception's
    assert {"val/samples", "val_ema/samples"} <= set(acc.Tags()["images"])
    image = acc.Images("val/samples")[-1]
    assert image.width > 8 * 32 and image.height > 8 * 32  # 64 samples, 8 by 8


def test_test_py_measures_the_fid_its_run_logged(trained, features, tmp_path):
    """Issue 59: test.py's FID of a GAN checkpoint is the task's own validation run on it
    (one FID path): for the last checkpoint's generator and its moving average, the very
    figures the run logged for them."""
    logged = read_metrics(trained)[-1]
    for weights, suffix in (("raw", ""), ("ema", "_ema")):
        report = tmp_path / f"{weights}.json"
        assert load_test_py().main([
            "--checkpoint", str(trained / "checkpoints" / "last.pt"), "--weights", weights,
            "--fid-samples", "8", "--fid-features", features, "--json", str(report),
            "--device", "cpu", "--num-workers", "0"]) == 0
        got = json.loads(report.read_text())
        assert (got["weights"], got["fid_samples"]) == (weights, 8)
        for figure in ("fid_classifier", "kid_classifier", "kid_std_classifier"):
            assert got[figure] == logged[f"val_{figure}{suffix}"], (weights, figure)
    assert logged["val_fid_classifier"] != logged["val_fid_classifier_ema"]  # told apart


def test_checkpoints_hold_each_network_and_optimizer_by_name(trained):
    state = final_state(trained)
    assert state["format"] == 3 and "model" not in state and "optimizer" not in state
    assert set(state["networks"]) == set(state["optimizers"]) == {"generator",
                                                                   "discriminator"}
    assert set(state["ema"]) == {"generator"}
    assert state["config"]["in_channels"] == 3
    generator, discriminator = dcgan.build(state["config"], 3)
    generator.load_state_dict(state["networks"]["generator"])
    discriminator.load_state_dict(state["networks"]["discriminator"])
    for name, optimizer in state["optimizers"].items():  # one Adam step per global step
        steps = {float(s["step"]) for s in optimizer["state"].values()}
        assert steps == {float(state["step"])}, name
        assert optimizer["param_groups"][0]["betas"] == (0.5, 0.999)


def test_test_py_measures_the_fid_train_py_logged(trained, features, tmp_path):
    report = tmp_path / "r.json"
    assert load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--fid-samples", "8", "--fid-features", features, "--json",
                                str(report), "--device", "cpu", "--num-workers", "0"]) == 0
    got, logged = json.loads(report.read_text()), read_metrics(trained)[-1]
    assert got["fid_classifier"] == pytest.approx(logged["val_fid_classifier_ema"], rel=1e-6)
    assert got["kid_classifier"] == pytest.approx(logged["val_kid_classifier_ema"], rel=1e-6)


def test_a_gan_checkpoint_as_a_classifiers_start_is_one_line(trained, tmp_path, capsys):
    last = str(trained / "checkpoints" / "last.pt")
    assert train.main(["--dataset", "synthetic", "--pretrained", last, "--run-dir",
                       str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: --pretrained {last!r} holds a GAN's networks (generator, "
                       f"discriminator), not one network's weights")


def test_an_early_stop_says_the_lowest_fid():
    task = type("T", (tasks.Task,), {"best": "fid", "lower_is_better": True})()
    state = engine.TrainState(epoch=4, best_epoch=2, early_stop_waited=2)
    state.best = metrics.best_metric(task, {"val_fid": 12.5})
    line = metrics.early_stop_line({"run_dir": "r", "early_stop_min_delta": 0,
                                    "early_stop_patience": 2}, state, task)
    assert "the best was epoch 2 (val_fid 12.5000)" in line


def test_best_pt_follows_the_lowest_fid(tmp_path, features, monkeypatch):
    """Three epochs whose FIDs are given (two evaluations an epoch: the generator's and
    its moving average's): best.pt is the epoch of the average's lowest, which is neither
    the last epoch nor that of the generator's own lowest."""
    from reporting import gan_metrics

    given = iter([5.0, 1.0, 2.0, 8.0, 7.0, 9.0])  # in turn: minima at different epochs
    scores = gan_metrics.measure

    def given_fid(*args, **kwargs):
        return {**scores(*args, **kwargs), "fid_classifier": next(given)}

    monkeypatch.setattr(gan_metrics, "measure", given_fid)
    assert train.main(gan_args(tmp_path, features, "--ema-decay", "0.9", epochs=3)) == 0
    assert next(given, None) is None  # each of the six was logged
    records = read_metrics(tmp_path)
    ema = [r["val_fid_classifier_ema"] for r in records]
    own = [r["val_fid_classifier"] for r in records]
    assert sorted(ema + own) == [1.0, 2.0, 5.0, 7.0, 8.0, 9.0]
    lowest = ema.index(min(ema))
    assert lowest != len(records) - 1 and lowest != own.index(min(own))
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == records[lowest]["epoch"] != final_state(tmp_path)["epoch"]
    assert best["progress"]["best"] == -min(ema)


def test_a_nan_fid_is_never_the_best():
    task = type("T", (tasks.Task,), {"best": "fid", "lower_is_better": True})()
    assert metrics.best_metric(task, {"val_fid": float("nan")}) == -float("inf")
    assert metrics.best_metric(task, {"val_fid": 3.0}) > metrics.best_metric(
        task, {"val_fid": 4.0})


@pytest.mark.parametrize("path", [("--num-workers", "2", "--data-on-device", "off"),
                                  ("--data-on-device", "on")])
def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path, features,
                                                                        path):
    flags = ("--ema-decay", "0.9", *path)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main(gan_args(full, features, *flags)) == 0
    with stop_at_step(5):  # the 5th optimizer step: the discriminator's of global step 3
        assert train.main(gan_args(stopped, features, *flags)) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3  # of 8: inside the first epoch
    assert train.main(gan_args(stopped, features, *flags, "--resume", "auto")) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in RESUMED}, {k: b[k] for k in RESUMED})
    assert read_metrics(full)[-1] == {**read_metrics(stopped)[-1],
                                      **{k: read_metrics(full)[-1][k] for k in TIMES}}


TIMES = ("compute_efficiency", "data_time", "compute_time", "epoch_time", "samples_per_sec",
         "tflops")


# Plain SGD for the equalities below: two players amplify the rounding of the two sums'
# orders step after step, and Adam (a gradient that is only rounding, divided by its own
# root mean square, is a whole step) and momentum amplify it faster; with plain SGD, two
# epochs end within 1e-8 of each other.
EQUAL = ("--no-gan-batch-norm", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0")


def test_a_moving_average_turned_on_at_a_resume_starts_from_the_generator(tmp_path,
                                                                           features, capsys):
    assert train.main(gan_args(tmp_path, features, epochs=1)) == 0
    assert train.main(gan_args(tmp_path, features, "--ema-decay", "0.9", "--resume",
                               "auto")) == 0
    assert "has no moving average; it starts from the restored weights" in \
        capsys.readouterr().out
    state = final_state(tmp_path)
    assert set(state["ema"]) == {"generator"}
    assert set(state["ema"]["generator"]) == set(state["networks"]["generator"])


def test_accumulation_equals_the_large_batch(tmp_path, features):
    big, accumulated = tmp_path / "big", tmp_path / "acc"
    assert train.main(gan_args(big, features, *EQUAL, "--d-steps", "2", batch=16)) == 0
    assert train.main(gan_args(accumulated, features, *EQUAL, "--d-steps", "2",
                               "--virtual-batch-size", "16", batch=4)) == 0
    torch.testing.assert_close(final_state(accumulated)["networks"],
                               final_state(big)["networks"])
    assert final_state(accumulated)["step"] == final_state(big)["step"] == 8


# The generator's images outside training (eval mode: FID's and the grid's; not the model
# summary's one image), each by its latent's first number, a line a call, a file a process.
RECORD_GENERATED = """
import dcgan
forward = dcgan.Generator.forward
def recorded(self, z):
    if not self.training and len(z) > 1:
        with open(os.path.join({out!r}, os.environ["RANK"]), "a") as f:
            f.write(" ".join(map(repr, z[:, 0].tolist())) + "\\n")
    return forward(self, z)
dcgan.Generator.forward = recorded
"""


def test_two_processes_of_8_train_like_one_of_16(tmp_path, features):
    """And validate like it: FID (of 8 images) within rounding, each process generating
    its half of them by index (the CUDA review's M3: not process 0 alone, the other
    waiting), process 0 the grid too."""
    one, two = tmp_path / "one", tmp_path / "two"
    flags = (*EQUAL, "--d-steps", "2", "--ema-decay", "0.9")
    assert train.main(gan_args(one, features, *flags, batch=16)) == 0
    (tmp_path / "generated").mkdir()
    torchrun(gan_args(two, features, *flags, batch=8), script=write_launcher(
        tmp_path / "launch.py", RECORD_GENERATED.format(out=str(tmp_path / "generated"))))
    torch.testing.assert_close(final_state(two)["networks"], final_state(one)["networks"])
    torch.testing.assert_close(final_state(two)["ema"], final_state(one)["ema"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    # (KID too: these few steps' images are alike, FID of half of them is FID of all to
    # 1e-6; KID is not)
    for key in ("val_fid_classifier", "val_fid_classifier_ema", "val_kid_classifier",
                "val_kid_classifier_ema", "train_loss_d", "train_loss_g"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key

    def firsts(z):
        return " ".join(map(repr, z[:, 0].tolist()))
    fid, grid = (dcgan.fixed_latents(n, 16, 0) for n in (8, GAN.grid))  # (--seed 0)
    calls = {rank: (tmp_path / "generated" / str(rank)).read_text().splitlines()
             for rank in (0, 1)}
    validations = 2 * 2  # 2 epochs, each validating the generator and its average
    assert calls[0] == [firsts(fid[:4]), firsts(grid)] * validations
    assert calls[1] == [firsts(fid[4:])] * validations


# In train.py under torchrun: DDP's buffer broadcast before a forward fails, as cuDNN's
# BatchNorm backward fails after it on a GPU (pytorch #175024); the CPU's BatchNorm keeps
# no running statistics for its backward, so without this a broadcast passes here.
BROADCAST_FAILS = """
import torch
DDP = torch.nn.parallel.DistributedDataParallel
assert hasattr(DDP, "_sync_buffers"), "DDP's buffer broadcast moved: follow it"
def broadcast(self):
    raise RuntimeError(f"a buffer broadcast before a forward of {type(self.module).__name__}")
DDP._sync_buffers = broadcast
"""


def test_a_batchnorm_discriminator_trains_under_torchrun(tmp_path, features):
    """Its BatchNorm sees real and generated images in two calls before one backward: a
    buffer broadcast between them would fail the backward (pytorch #175024). Here any
    broadcast fails the run (``BROADCAST_FAILS``), so it bites on the CPU too."""
    run_dir = tmp_path / "run"
    torchrun(gan_args(run_dir, features, epochs=1, batch=8),
             script=write_launcher(tmp_path / "launch.py", BROADCAST_FAILS))
    state = final_state(run_dir)
    assert any("running_mean" in k for k in state["networks"]["discriminator"])
    assert any("running_mean" in k for k in state["networks"]["generator"])
    assert read_metrics(run_dir)[-1]["val_fid_classifier"] > 0


def test_each_network_gets_its_own_ddp_without_buffer_broadcasts(tmp_path, features):
    """The in-place error of pytorch #175024 comes from cuDNN's BatchNorm backward (CPU
    BatchNorm does not keep the running statistics for backward, so the torchrun test
    above passes either way here): what prevents it is each network's DDP built without
    buffer broadcasts, checked here in a one-process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        config = config_module.with_defaults({"task": "gan", "latent_dim": 8, "gan_width": 4})
        net = dcgan.networks(config, 3)
        model = train.wrap_model(net, config, torch.device("cpu"), world_size=2)
        for name, wrapped in model.items():
            assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel), name
            assert wrapped.module is net[name], name
            assert not getattr(wrapped, "forward_sync_buffers", wrapped.broadcast_buffers)
        single = train.wrap_model(torch.nn.Linear(2, 2), config, torch.device("cpu"), 2)
        assert getattr(single, "forward_sync_buffers", single.broadcast_buffers)  # as ever
    finally:
        dist.destroy_process_group()


def test_wgan_gp_and_spectral_norm_train_and_log_the_penalty(tmp_path, features):
    assert train.main(gan_args(tmp_path, features, "--gan-loss", "wgan-gp", "--d-steps", "2",
                               "--gan-attention", epochs=1)) == 0
    record = read_metrics(tmp_path)[-1]
    assert record["train_gradient_penalty"] > 0
    assert "train/gradient_penalty" in events(tmp_path).Tags()["scalars"]
    spectral = tmp_path / "sn"
    assert train.main(gan_args(spectral, features, "--gan-loss", "hinge",
                               "--gan-spectral-norm", epochs=1)) == 0
    assert any("parametrizations" in k
               for k in final_state(spectral)["networks"]["discriminator"])


def test_bf16_on_the_cpu_trains(tmp_path, features):
    """--amp bf16: both networks' layers compute in bfloat16 in the training step, the
    weights stay float32 and move as full precision moves them (close, not equal)."""
    updates = {}
    for amp in ("bf16", "none"):
        with watch_training() as (dtypes, start):
            assert train.main(gan_args(tmp_path / amp, features, "--amp", amp, epochs=1)) == 0
        assert (torch.bfloat16 in dtypes) == (amp == "bf16"), (amp, dtypes)
        assert start and all(p.dtype == torch.float32 for p, _ in start)
        updates[amp] = update(start)
    bf16, full = updates["bf16"], updates["none"]
    assert not torch.equal(bf16, full)
    assert full.norm() > 0 and torch.cosine_similarity(bf16, full, dim=0) > 0.9
    record = read_metrics(tmp_path / "bf16")[-1]
    assert math.isfinite(record["train_loss_d"]) and math.isfinite(record["train_loss_g"])
    assert math.isfinite(record["val_fid_classifier"])


def test_fp16_updates_the_one_scaler_once_per_step(tmp_path, features, monkeypatch):
    updates = []
    update = torch.amp.GradScaler.update
    monkeypatch.setattr(torch.amp.GradScaler, "update",
                        lambda self, *a, **k: (updates.append(1), update(self, *a, **k)))
    assert train.main(gan_args(tmp_path, features, "--amp", "fp16", "--max-steps", "3")) == 0
    state = final_state(tmp_path)
    assert state["step"] == 3 and len(updates) == 3  # --max-steps is not halved
    assert state["scaler"]["scale"] > 0
    # --d-steps 2: the discriminator's optimizer steps twice a step, so the scaler is
    # updated between its two steps too (it steps each optimizer once between updates)
    updates.clear()
    assert train.main(gan_args(tmp_path / "d2", features, "--amp", "fp16", "--max-steps", "3",
                               "--d-steps", "2")) == 0
    assert final_state(tmp_path / "d2")["step"] == 3 and len(updates) == 6


def test_every_step_is_unscaled_by_the_scale_its_backward_used(tmp_path, features,
                                                                 monkeypatch):
    """The CUDA review's M1: with --d-steps 2 the scaler is updated between the repeats;
    the update must come before a repeat's backward, not between its backward and its
    step. With the scale growing at every update (growth_interval 1), the scale of each
    optimizer step is the one its gradients were scaled by."""
    events = []
    init, scale, unscale = (torch.amp.GradScaler.__init__, torch.amp.GradScaler.scale,
                            torch.amp.GradScaler.unscale_)
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "growth_interval": 1}))
    monkeypatch.setattr(torch.amp.GradScaler, "scale", lambda self, loss: (
        events.append(("backward", self.get_scale())), scale(self, loss))[1])
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", lambda self, optimizer: (
        events.append(("step", self.get_scale())), unscale(self, optimizer))[1])
    assert train.main(gan_args(tmp_path, features, "--amp", "fp16", "--max-steps", "2",
                               "--d-steps", "2", "--grad-clip", "10")) == 0
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    assert len(steps) == 2 * 3  # two steps of (discriminator x 2, generator)
    for i in steps:  # the backward just before each step
        assert events[i][1] == events[i - 1][1], events
    assert len({s for _, s in events}) > 2  # the scale did grow between them


def test_a_step_of_several_optimizers_counts_once(tmp_path, features, monkeypatch):
    """The CUDA review's L5: a GAN step of --d-steps 2 steps three optimizers; its gradient
    norm, its clipping and its skip are counted once, as a classifier's step (clipped or
    skipped where any of them was), not three times."""
    assert train.main(gan_args(tmp_path / "clip", features, "--max-steps", "3", "--d-steps",
                               "2", "--grad-clip", "1e-9")) == 0
    record = read_metrics(tmp_path / "clip")[-1]
    assert record["step"] == 3 and record["grad_clipped"] == 3
    acc = events(tmp_path / "clip")
    # the step's norm is its largest optimizer step's: at least the generator's and the
    # mean of the discriminator's two (a mean of all three would be below one of them)
    for d, g, step in zip(acc.Scalars("train/grad_norm_discriminator"),
                          acc.Scalars("train/grad_norm_generator"),
                          acc.Scalars("train/grad_norm")):
        assert step.value >= max(d.value, g.value) * (1 - 1e-6), (d, g, step)

    init = torch.amp.GradScaler.__init__  # a scale that overflows every backward in fp16
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "init_scale": 2.0 ** 100}))
    assert train.main(gan_args(tmp_path / "skip", features, "--amp", "fp16", "--max-steps",
                               "3", "--d-steps", "2")) == 0
    assert [e.value for e in events(tmp_path / "skip").Scalars("train/scaler_skips")] == \
        [1, 2, 3]


def test_each_phase_gives_gradients_to_its_own_network_only(features):
    config = config_module.with_defaults({"task": "gan", "dataset": "synthetic",
                                          "latent_dim": 8, "gan_width": 4, "fid_samples": 2,
                                          "fid_features": features, "d_steps": 2})
    config["network"] = "dcgan"
    train_set = type("S", (), {"transform": None})()
    task = GAN(config, train_set)
    net = dcgan.networks(config, 3)
    calls = {name: 0 for name in net}
    for name, module in net.items():
        for p in module.parameters():
            p.register_hook(lambda g, name=name: calls.__setitem__(name, calls[name] + 1))
    optimizer = train.ops.build_optimizer(net, config, torch.device("cpu"))
    loop = engine.LoopSettings(device=torch.device("cpu"), scaler=torch.amp.GradScaler(
        "cpu", enabled=False), counters=meters.Counters(torch.device("cpu")))
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    where = engine.Where(epoch=0, first=0, offset=0, count=4, step_samples=4)
    engine._phase_steps(net, optimizer, task, loop, [(x, None, 4, where)])
    n = {name: len(list(module.parameters())) for name, module in net.items()}
    assert calls == {"discriminator": 2 * n["discriminator"], "generator": n["generator"]}
    assert all(p.requires_grad for p in net.parameters())  # given back after the step


def test_the_latents_do_not_depend_on_how_a_step_is_split(features):
    config = config_module.with_defaults({"task": "gan", "latent_dim": 5,
                                          "fid_features": features})
    task = GAN(config, type("S", (), {"transform": None})())
    whole = task.latents("generator", engine.Where(1, 32, 0, 16, 16), "cpu")
    parts = [task.latents("generator", engine.Where(1, 32, o, 4, 16), "cpu")
             for o in (0, 4, 8, 12)]
    assert torch.equal(torch.cat(parts), whole)
    other = task.latents("discriminator", engine.Where(1, 32, 0, 16, 16), "cpu")
    again = task.latents("generator", engine.Where(1, 32, 0, 16, 16, repeat=1), "cpu")
    assert not torch.equal(other, whole) and not torch.equal(again, whole)


@pytest.mark.parametrize("flags, words", [
    (("--mixup-alpha", "0.2"), "--mixup-alpha/--cutmix-alpha mix images and labels"),
    (("--tta", "flip"), "--tta averages a classifier's predictions"),
    (("--freeze", "generator.*"), "--freeze is not for a GAN's two networks"),
    (("--find-lr",), "--find-lr sweeps one optimizer's learning rate"),
    (("--network", "resnet18"), "--task gan trains --network dcgan"),
    (("--image-size", "48"), "--image-size must be one of 28, 32, 64"),
    (("--fid-samples", "50"), "--fid-samples 50: the validation set has 12 images"),
    (("--dataset", "cifar100"), "--dataset must be one of"),
])
def test_what_makes_no_sense_for_a_gan_is_one_line(tmp_path, features, capsys, flags, words):
    assert train.main(gan_args(tmp_path, features, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_dcgan_without_the_task_is_one_line(tmp_path, capsys):
    assert train.main(["--dataset", "synthetic", "--network", "dcgan", "--run-dir",
                       str(tmp_path)]) == 2
    assert "error: --network dcgan is a GAN's pair of networks: train it with --task gan" \
        in capsys.readouterr().err


def test_inception_fid_without_its_weights_names_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    args = gan_args(tmp_path / "run", "x")
    args = args[:args.index("--fid-features")] + args[args.index("--fid-features") + 2:]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "weights-inception-2015-12-05-6726825d.pth" \
        in err[-1] and str(tmp_path / "torch-home") in err[-1]


def test_without_a_recipe_a_gan_takes_the_dcgan_papers():
    config, _ = config_module.parse_config(["--task", "gan", "--dataset", "mnist"])
    assert (config["network"], config["optimizer"], config["lr"], config["betas"]) == \
        ("dcgan", "adam", 2e-4, [0.5, 0.999])
    assert (config["weight_decay"], config["scheduler"], config["augment"],
            config["image_size"]) == (0.0, "none", False, 28)
    config, _ = config_module.parse_config(["--task", "gan", "--lr", "0.001", "--augment"])
    assert config["lr"] == 0.001 and config["augment"] is True  # what the user set stays


@pytest.mark.parametrize("name", ["dcgan_mnist.yaml", "dcgan_cifar10.yaml"])
def test_the_dcgan_recipes_are_the_papers(name):
    config, _ = config_module.parse_config(["--config", os.path.join("configs", name)])
    config_module.check_config(config)
    assert (config["task"], config["network"], config["optimizer"]) == ("gan", "dcgan", "adam")
    assert config["lr"] == config["lr_d"] == 2e-4 and config["betas"] == [0.5, 0.999]
    assert config["batch_size"] == 128 and config["augment"] is False


def test_the_readme_gan_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's first three GAN commands, from a directory holding MNIST and, as the
    repository does, configs/."""
    import re

    from helpers import ROOT, run_as_written, write_mnist

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## GANs\n.*?```bash\n(.*?)```", readme, flags=re.DOTALL)
    commands = [line.split("#")[0].split() for line in block.group(1).splitlines()][:3]
    assert [c[:2] for c in commands] == [["python", "train.py"]] * 2 + [["python", "test.py"]]
    write_mnist(tmp_path / "data", train=40, test=12)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    small = {0: ["--epochs", "1", "--batch-size", "8"],  # smaller than written, same flags
             1: ["--epochs", "1", "--batch-size", "8", "--fid-samples", "8", "--gan-width",
                 "8"],
             2: []}
    for i, argv in enumerate(commands):
        code, _, err = run_as_written([*argv, *small[i], "--device", "cpu", "--num-workers",
                                       "0"], tmp_path, monkeypatch, capsys)
        assert code == 0, (argv, err[-2000:])
    pngs = sorted(os.listdir(tmp_path / "samples"))
    assert len(pngs) == 64 and pngs[0] == "000000.png"
    assert "val_fid_classifier" in read_metrics(tmp_path / "runs" / "dcgan-mnist")[-1]


@pytest.mark.parametrize("yaml_text, words", [
    ("betas: 0.5\n", "--betas must be two numbers, not 0.5"),
    ("betas: [0.5, 1.0]\n", "--betas must each be in [0, 1) (got [0.5, 1.0])"),
    ("betas: [0.5, .nan]\n", "--betas must be a finite number"),
])
def test_adams_betas_are_two_numbers_below_one(tmp_path, yaml_text, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_text)
    with pytest.raises(config_module.UserError, match=re.escape(words)):
        config, _ = config_module.parse_config(["--config", str(recipe)])
        config_module.check_config(config)


def test_a_steps_flops_count_each_network_as_the_phases_run_it():
    """Per sample: D forward and backward on real and generated images (x2), G forward,
    then D and G backward through the generator's images: measured against the two
    networks' own counts."""
    import ops

    config = config_module.with_defaults({"task": "gan", "latent_dim": 16, "gan_width": 8})
    net = dcgan.networks(config, 3)
    cpu = torch.device("cpu")
    g_fwd_bwd = ops.train_flops_per_sample(net["generator"], (16,), cpu)
    d_fwd_bwd = ops.train_flops_per_sample(net["discriminator"], (3, 32, 32), cpu)
    step = ops.train_flops_per_sample(dcgan.StepFlops(net["generator"], net["discriminator"]),
                                      (16,), cpu)
    # D's three forward and backward passes and G's one; through to G, D's backward also
    # computes its first layer's input gradient (a fraction of a D pass). One G forward
    # more (a third of g_fwd_bwd), made again for its own phase, would be over the bound.
    assert g_fwd_bwd + 3 * d_fwd_bwd <= step < g_fwd_bwd + 3 * d_fwd_bwd + g_fwd_bwd / 6


def test_another_fid_features_on_resume_starts_best_pt_afresh(tmp_path, features, capsys,
                                                              monkeypatch):
    """Round 5's F12: the FID of another classifier's features cannot be compared with the
    checkpoint's best: a resume with another --fid-features says so, and best.pt then
    follows the new figure from the resumed epoch on (here a worse FID than the old best)."""
    import shutil

    from reporting import gan_metrics

    real, fids = gan_metrics.measure, iter([1.0, 5.0, 4.0])

    def scores(*args, **kwargs):
        return {**real(*args, **kwargs), "fid_classifier": next(fids)}

    monkeypatch.setattr(gan_metrics, "measure", scores)
    other = tmp_path / "other.pt"
    shutil.copy(features, other)
    run_dir = tmp_path / "run"
    assert train.main(gan_args(run_dir, features, epochs=1)) == 0
    capsys.readouterr()
    assert train.main(gan_args(run_dir, str(other), "--resume", "auto", epochs=2)) == 0
    assert (f"note: --fid-features changed since {str(run_dir / 'checkpoints' / 'last.pt')!r}"
            f": its fid_classifier cannot be compared with the checkpoint's best; best.pt "
            f"starts afresh") in capsys.readouterr().out
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2 and best["config"]["fid_features"] == str(other)
    assert best["progress"]["best"] == -read_metrics(run_dir)[-1]["val_fid_classifier"]
    capsys.readouterr()
    assert train.main(gan_args(run_dir, str(other), "--resume", "auto", epochs=3)) == 0
    assert "cannot be compared" not in capsys.readouterr().out  # the same features: silent


def test_lr_d_sets_the_discriminators_learning_rate_and_only_its(tmp_path, features):
    """Round 5's promise 7: --lr-d is the discriminator's peak rate; the generator keeps
    --lr (a constant schedule: the rates the steps took are the peaks)."""
    assert train.main(gan_args(tmp_path, features, "--lr-d", "0.0005", "--max-steps",
                               "2")) == 0
    groups = {name: [g["lr"] for g in state["param_groups"]]
              for name, state in final_state(tmp_path)["optimizers"].items()}
    assert groups == {"generator": [0.0002], "discriminator": [0.0005]}


def test_with_two_d_steps_train_loss_is_the_repeats_mean_plus_the_generators(tmp_path,
                                                                             features):
    """Round 5's promise 4: --d-steps 2 does not double the discriminator's share of
    train_loss: it is train_loss_d (the repeats' mean) + train_loss_g."""
    assert train.main(gan_args(tmp_path, features, "--d-steps", "2", epochs=1)) == 0
    record = read_metrics(tmp_path)[-1]
    assert record["train_loss"] == pytest.approx(
        record["train_loss_d"] + record["train_loss_g"], rel=1e-5)


def _without(args, flag, values=1):
    i = args.index(flag)
    return args[:i] + args[i + 1 + values:]


def test_fid_samples_0_trains_without_fid_and_best_pt_is_the_last(tmp_path, monkeypatch,
                                                                   capsys):
    """Issue 36: FID is the figure, not a condition of training: offline, without
    Inception's weights and without a classifier, --fid-samples 0 trains; the run's first
    lines say so, no FID is logged, and best.pt is the last epoch's checkpoint."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # no Inception there
    args = _without(gan_args(tmp_path / "run", "x"), "--fid-features")
    args[args.index("--fid-samples") + 1] = "0"
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "--fid-samples 0: no FID or KID at validation" in out.split("epoch 1/2")[0]
    records = read_metrics(tmp_path / "run")
    assert records and not [k for r in records for k in r if "fid" in k or "kid" in k]
    ckpts = tmp_path / "run" / "checkpoints"
    best, last = (torch.load(ckpts / n, weights_only=False) for n in ("best.pt", "last.pt"))
    assert best["epoch"] == last["epoch"] == 2
    assert_states_equal(best["networks"], last["networks"])
    tags = events(tmp_path / "run").Tags()["images"]
    assert any("samples" in t for t in tags), tags  # the grid is still shown


def test_the_default_fid_samples_is_capped_at_the_validation_set_with_one_warning(
        tmp_path, features, capsys):
    """The default --fid-samples (10000) on a validation set of 12 images measures 12,
    with one warning; given above the set, the refusal names both ways out."""
    args = _without(gan_args(tmp_path / "run", features, epochs=1), "--fid-samples")
    assert train.main(args) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --fid-samples: the validation set has 12 images") == 1, err
    assert read_metrics(tmp_path / "run")[-1]["val_fid_classifier"] >= 0
    args = gan_args(tmp_path / "other", features, epochs=1)
    args[args.index("--fid-samples") + 1] = "13"
    assert train.main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --fid-samples 13: the validation set has 12 images") \
        and "at most 12" in line and "--fid-samples 0" in line, line


def test_early_stopping_without_fid_is_one_line(tmp_path, features, capsys):
    args = gan_args(tmp_path, features, "--early-stop-patience", "2")
    args[args.index("--fid-samples") + 1] = "0"
    assert train.main(args) == 2
    assert "error: --early-stop-patience follows FID, and --fid-samples 0" in \
        capsys.readouterr().err


def test_a_short_last_micro_batch_weighs_by_its_samples_in_each_phase(tmp_path, features):
    """Round 5's promise 3: 60 samples in steps of 16 end with a step of 12, accumulated
    as 8 + 4: in each phase the micro-batch of 4 weighs a third of the step, not a half,
    so the run ends where batches of 16 (the last of 12) end."""
    big, accumulated = tmp_path / "big", tmp_path / "acc"
    assert train.main(gan_args(big, features, *EQUAL, "--d-steps", "2", batch=16,
                               size=60)) == 0
    assert train.main(gan_args(accumulated, features, *EQUAL, "--d-steps", "2",
                               "--virtual-batch-size", "16", batch=8, size=60)) == 0
    assert final_state(big)["step"] == final_state(accumulated)["step"] == 8  # 4 an epoch
    torch.testing.assert_close(final_state(accumulated)["networks"],
                               final_state(big)["networks"])
    for key in ("train_loss_d", "train_loss_g"):
        assert read_metrics(accumulated)[-1][key] == pytest.approx(
            read_metrics(big)[-1][key], rel=1e-5), key
