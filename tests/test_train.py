"""End-to-end tests of train.py: runs, config, logs, errors (issue 2)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    events,
    final_state,
    load_test_py,
    read_metrics,
    tiny_args,
    write_idx,
    write_image_folder,
)

import train
from config import build_parser, check_config, parse_config
from machinery import engine, hardware, meters
from pipeline import data
from reporting import runlog
from tasks.classification import Classification

METRIC_KEYS = {"epoch", "step", "train_loss", "lr", "compute_efficiency", "data_time",
               "compute_time", "epoch_time", "samples_per_sec"}


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """simple_cnn on 2000 synthetic samples for 3 epochs: the issue's learnability bar."""
    run_dir = tmp_path_factory.mktemp("run")
    code = train.main(["--dataset", "synthetic", "--network", "simple_cnn",
                       "--synthetic-size", "2000", "--epochs", "3", "--batch-size", "64",
                       "--optimizer", "adam", "--lr", "1e-3", "--weight-decay", "0",
                       "--num-workers", "0", "--run-dir", str(run_dir), "--log-every", "5",
                       "--device", "cpu"])
    assert code == 0
    return run_dir


def test_synthetic_run_learns(synthetic_run):
    records = read_metrics(synthetic_run)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[-1]["val_acc"] > 0.9  # chance is 0.1


def test_metrics_jsonl_has_every_contract_key(synthetic_run):
    records = read_metrics(synthetic_run)
    for r in records:
        assert METRIC_KEYS | {"val_loss", "val_acc", "tflops"} <= set(r)
        # Every batch is waited for and computed, inside the epoch's wall time.
        assert r["data_time"] > 0 and r["compute_time"] > 0
        assert r["data_time"] + r["compute_time"] <= r["epoch_time"]
        assert 0 < r["compute_efficiency"] < 1
        assert r["compute_efficiency"] == pytest.approx(
            r["compute_time"] / (r["compute_time"] + r["data_time"]))
        assert r["samples_per_sec"] == pytest.approx(2000 / r["epoch_time"])
        assert r["train_loss"] > 0 and r["val_loss"] > 0 and 0 <= r["val_acc"] <= 1
    steps_per_epoch = -(-2000 // 64)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["step"] for r in records] == [steps_per_epoch * e for e in (1, 2, 3)]
    # --lr 1e-3 after each epoch's last step: the 1-epoch warmup has just ended, then a
    # cosine over the other 2 epochs is half way, then at its end
    assert [r["lr"] for r in records] == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-12)


def test_tensorboard_scalars_read_back(synthetic_run):
    acc = events(synthetic_run)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/loss", "val/acc", "z_perf/compute_efficiency",
            "z_perf/samples_per_sec", "z_perf/tflops"} <= tags
    loss_steps = [e.step for e in acc.Scalars("train/loss")]
    assert loss_steps == sorted(set(loss_steps)) and loss_steps[0] == 5
    val = [(e.step, e.value) for e in acc.Scalars("val/acc")]
    records = read_metrics(synthetic_run)
    assert [s for s, _ in val] == [r["step"] for r in records]
    torch.testing.assert_close([v for _, v in val], [r["val_acc"] for r in records])
    assert "z_data/first_batch" in acc.Tags()["images"]


def test_hparams_written_with_final_metrics(synthetic_run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = events(synthetic_run)
    contents = [plugin_data_pb2.HParamsPluginData.FromString(c)
                for c in acc.PluginTagToContent("hparams").values()]
    experiment = next(c.experiment for c in contents if c.HasField("experiment"))
    names = {m.name.tag for m in experiment.metric_infos}
    # the metrics are curves of the run (the HPARAMS tab shows their last values) ...
    assert {"train/loss", "val/loss", "val/acc"} <= names <= set(acc.Tags()["scalars"])
    assert acc.Scalars("val/acc")[-1].value == pytest.approx(
        read_metrics(synthetic_run)[-1]["val_acc"])
    # ... and no one-point charts of their own, first on the Time Series page
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("hparam")]


def test_time_series_opens_on_the_loss_and_accuracy_curves(synthetic_run):
    """TensorBoard's Time Series page sorts its groups by name and opens the first two."""
    acc = events(synthetic_run)
    tags = acc.Tags()["scalars"] + acc.Tags()["images"]
    groups = sorted({t.split("/", 1)[0] for t in tags})
    assert groups[:2] == ["train", "val"], groups


def test_run_dir_records_config_command_and_summary(synthetic_run):
    with open(os.path.join(synthetic_run, "config.yaml")) as f:
        config = yaml.safe_load(f)
    assert config["network"] == "simple_cnn" and config["epochs"] == 3
    assert "run_dir" not in config and "resume" not in config
    with open(os.path.join(synthetic_run, "command.txt")) as f:
        command = f.read()
    assert "python train.py --dataset synthetic --network simple_cnn --synthetic-size 2000" \
        in command
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert f"git {head or 'unknown'}" in command and f"torch {torch.__version__}" in command
    with open(os.path.join(synthetic_run, "summary.txt")) as f:
        summary = f.read()
    assert "Trainable parameters: 113,962" in summary and "Frozen parameters: 0" in summary
    assert "ConvBlock" in summary


def test_checkpoints_load_weights_only_with_contract_keys(synthetic_run):
    for name in ("last.pt", "best.pt"):
        state = torch.load(os.path.join(synthetic_run, "checkpoints", name),
                           weights_only=True)
        assert {"model", "optimizer", "epoch", "step", "config"} <= set(state)
        assert not any(k.startswith("module.") for k in state["model"])
    last = final_state(synthetic_run)
    assert last["epoch"] == 3 and last["step"] == read_metrics(synthetic_run)[-1]["step"]


def test_test_py_agrees_with_logged_val_acc(synthetic_run, tmp_path):
    out = tmp_path / "result.json"
    code = load_test_py().main(["--checkpoint", str(synthetic_run / "checkpoints" / "last.pt"),
                                "--json", str(out), "--num-workers", "0"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["accuracy"] == read_metrics(synthetic_run)[-1]["val_acc"]


def test_saved_config_reloads_with_config_flag(synthetic_run, tmp_path):
    config, explicit = parse_config(["--config", str(synthetic_run / "config.yaml")])
    saved = yaml.safe_load((synthetic_run / "config.yaml").read_text())
    for key, value in saved.items():
        assert config[key] == value
    assert set(saved) == explicit


def test_config_precedence_defaults_yaml_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 0.5\nepochs: 7\nfreeze: ['features.*']\naugment: false\n")
    config, explicit = parse_config(["--config", str(recipe), "--epochs", "9"])
    assert config["lr"] == 0.5            # YAML over default
    assert config["epochs"] == 9          # command line over YAML
    assert config["batch_size"] == 128    # default
    assert config["freeze"] == ["features.*"] and config["augment"] is False
    assert explicit == {"lr", "epochs", "freeze", "augment"}


def test_yaml_typo_names_the_key_and_the_closest_flag(tmp_path, capsys):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("learning_rate: 0.1\nbatch_sise: 3\n")
    assert train.main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown key 'learning_rate'")
    recipe.write_text("batch_sise: 3\n")
    assert train.main(["--config", str(recipe)]) == 2
    assert "did you mean 'batch_size' (--batch-size)?" in capsys.readouterr().err


def test_yaml_value_of_wrong_type_is_an_error(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("optimizer: lion\n")
    assert train.main(["--config", str(recipe)]) == 2
    assert "optimizer must be one of" in capsys.readouterr().err
    recipe.write_text("epochs: many\n")
    assert train.main(["--config", str(recipe)]) == 2
    assert "epochs must be int" in capsys.readouterr().err


def test_every_flag_has_help_and_shows_its_default(capsys):
    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.dest
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # (argparse wraps at the terminal's width)
    assert "(default: 128)" in text and "default: resnet18, or simple_cnn" in text


def test_default_network_is_resnet18_and_simple_cnn_for_synthetic():
    assert parse_config([])[0]["network"] == "resnet18"
    assert parse_config(["--dataset", "synthetic"])[0]["network"] == "simple_cnn"
    assert parse_config(["--dataset", "synthetic", "--network", "mlp"])[0][
        "network"] == "mlp"


@pytest.mark.parametrize("recipe", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_every_recipe_parses(recipe):
    config, explicit = parse_config(["--config", os.path.join(ROOT, "configs", recipe)])
    check_config(config)
    assert explicit


def test_the_readme_smoke_run_learns(tmp_path):
    # README: python train.py --dataset synthetic --epochs 2 (here without workers)
    assert train.main(["--dataset", "synthetic", "--epochs", "2", "--run-dir", str(tmp_path),
                       "--num-workers", "0", "--device", "cpu"]) == 0
    records = read_metrics(tmp_path)
    assert records[-1]["val_acc"] > 0.5  # chance is 0.1


@pytest.mark.parametrize("argv, message", [
    (["--network", "nope"], "unknown network 'nope'"),
    (["--dataset", "nope"], "unknown dataset 'nope'"),
    (["--virtual-batch-size", "20"], "must be a multiple of --batch-size"),
    (["--optimizer", "lion"], "invalid choice"),
    (["--resume", "missing.pt"], "does not exist"),
    (["--config", "missing.yaml"], "cannot read config"),
    (["--freeze", "nothing.*"], "matches no parameter"),
])
def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = train.main(tiny_args(tmp_path / "run", *argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_resume_auto_needs_a_run_dir(capsys):
    assert train.main(["--resume", "auto", "--dataset", "synthetic"]) == 2
    assert "--resume auto needs --run-dir" in capsys.readouterr().err


def test_missing_data_dir_for_imagefolder(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path / "run", "--dataset", "imagefolder",
                                "--data-dir", str(tmp_path / "nowhere")))
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_offline_download_fails_with_a_clear_message(tmp_path, monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", offline)
    code = train.main(tiny_args(tmp_path / "run", "--dataset", "cifar10",
                                "--data-dir", str(tmp_path / "data")))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: could not download cifar10") and "--data-dir" in err
    assert "imagefolder" in err and "synthetic" in err


def test_error_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--network", "nope", "--run-dir",
                           str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown network")
    assert "Traceback" not in proc.stderr


def test_a_fresh_run_refuses_a_run_dir_with_checkpoints(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path)) == 0
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    assert train.main(tiny_args(tmp_path)) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


def test_imagefolder_end_to_end(tmp_path):
    write_image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    code = train.main(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "images"),
                       "--image-size", "16", "--network", "simple_cnn", "--epochs", "3",
                       "--batch-size", "6", "--optimizer", "adam", "--lr", "1e-2",
                       "--num-workers", "2", "--data-on-device", "off", "--run-dir",
                       str(run_dir), "--device", "cpu"])
    assert code == 0
    records = read_metrics(run_dir)
    assert len(records) == 3 and records[-1]["val_acc"] > 0.6  # chance is 1/3
    state = final_state(run_dir)
    assert state["model"]["fc.1.weight"].shape == (3, 128 * 2 * 2)


def test_imagefolder_with_different_class_lists_is_an_error(tmp_path, capsys):
    write_image_folder(tmp_path / "images", splits=("train",), per_class=1)
    write_image_folder(tmp_path / "images", splits=("test",), classes=("cat", "fox"),
                       per_class=1)
    code = train.main(tiny_args(tmp_path / "run", "--dataset", "imagefolder",
                                "--data-dir", str(tmp_path / "images")))
    err = capsys.readouterr().err
    assert code == 2
    assert "differ" in err and "'dog', 'emu'" in err and "'fox'" in err


def test_resume_path_continues_at_the_next_epoch_and_step(tmp_path, capsys):
    first = tmp_path / "first"
    assert train.main(tiny_args(first, epochs=2)) == 0
    steps_per_epoch = final_state(first)["step"] // 2
    epoch_one = first / "checkpoints" / "epoch-0001.pt"
    second = tmp_path / "second"
    assert train.main(tiny_args(second, "--resume", str(epoch_one), epochs=3)) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "(epoch 1, step" in out
    records = read_metrics(second)
    assert [r["epoch"] for r in records] == [2, 3]  # epoch 1 is not repeated
    assert [r["step"] for r in records] == [2 * steps_per_epoch, 3 * steps_per_epoch]


def test_max_steps_stops_inside_an_epoch_and_saves(tmp_path):
    assert train.main(tiny_args(tmp_path, "--max-steps", "3", epochs=5)) == 0
    state = final_state(tmp_path)
    assert state["step"] == 3 and state["epoch"] == 0
    assert state["progress"]["epoch_samples"] == 3 * 16


def test_a_run_stopped_inside_an_epoch_records_its_final_validation(tmp_path, capsys):
    """Round 5's 'also': --max-steps inside an epoch validates, prints its figure, and
    metrics.jsonl holds it as a record of its own (``final``, the step, the fraction of
    the epoch), as TensorBoard does: the last record is not the previous epoch's."""
    assert train.main(tiny_args(tmp_path, "--max-steps", "7", epochs=5)) == 0  # 4 a epoch
    records = read_metrics(tmp_path)
    assert [r["epoch"] for r in records] == [1, 1.75] and "final" not in records[0]
    last = records[-1]
    assert last["final"] is True and last["step"] == 7 and "samples_per_sec" in last
    line = [line for line in capsys.readouterr().out.splitlines() if "--max-steps" in line]
    assert f"val_acc {last['val_acc']:.4f}" in line[0]
    tags = events(tmp_path).Scalars("val/acc")
    assert [(e.step, round(e.value, 6)) for e in tags][-1] == (7, round(last["val_acc"], 6))
    # resumed past its limit (--max-steps 0; with its --max-steps 7 kept it takes no step:
    # round 7's F1), the record stays (no "damaged line" warning) and the epochs follow it
    assert train.main(tiny_args(tmp_path, "--resume", "auto", "--max-steps", "0",
                                epochs=2)) == 0
    assert "damaged" not in capsys.readouterr().err
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 1.75, 2]


def test_eval_every_validates_every_nth_epoch_and_the_last(tmp_path):
    assert train.main(tiny_args(tmp_path, "--eval-every", "2", epochs=3)) == 0
    records = read_metrics(tmp_path)
    assert ["val_acc" in r for r in records] == [False, True, True]


def test_lr_schedule_is_stepped_per_optimizer_step(tmp_path):
    assert train.main(tiny_args(tmp_path, "--scheduler", "cosine", "--warmup-epochs", "1",
                                epochs=4)) == 0
    acc = events(tmp_path)
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert lrs[0] == pytest.approx(0.05 * 2 / 4)      # warmup: 4 steps an epoch, after step 1
    assert max(lrs) == pytest.approx(0.05, rel=1e-6)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-9)    # cosine ends at 0


class SleepyDataset(torch.utils.data.Dataset):
    """Each sample takes a known time to load."""

    def __init__(self, delay, size=8):
        self.delay, self.size = delay, size

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        time.sleep(self.delay)
        return torch.zeros(4), 0


class SleepyModel(torch.nn.Module):
    """Each forward takes a known time."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        time.sleep(self.delay)
        return self.fc(x)


def test_efficiency_measures_data_and_compute_time():
    # 3 steps of 2 samples: 0.4 s of loading then 0.2 s of compute each, 1.2 s and 0.6 s in
    # all. Sleeps last at least that long; a busy machine only adds time, so each bound
    # below is a floor, or a ceiling with half of the other phase's time as slack: a timer
    # that put the data wait into compute time (or compute into data time) exceeds it.
    data_delay, compute_delay, batch, steps = 0.2, 0.2, 2, 3
    data_wait, compute = steps * batch * data_delay, steps * compute_delay
    loader = data.build_loader(SleepyDataset(data_delay, size=steps * batch),
                               batch_sampler=data.EpochBatchSampler(steps * batch, batch,
                                                                    seed=0))
    model = SleepyModel(compute_delay)
    optimizer = torch.optim.SGD([{"params": model.parameters(), "base_lr": 0.1}], lr=0.1)
    device = torch.device("cpu")
    run = engine.LoopSettings(device=device,
                              scaler=torch.amp.GradScaler("cpu", enabled=False),
                              timer=engine.StepTimer(device),
                              counters=meters.Counters(device), show_progress=False)
    progress = engine.TrainState()
    engine.train_one_epoch(model, loader, optimizer, Classification(2), run, progress)
    data_t, compute_t, wall = run.timer.totals()
    assert progress.step == steps
    assert data_wait <= data_t < data_wait + compute / 2, (data_t, compute_t)
    assert compute <= compute_t < compute + data_wait / 2, (data_t, compute_t)
    assert data_t + compute_t <= wall
    assert engine.efficiency(data_t, compute_t) == pytest.approx(
        compute_t / (compute_t + data_t))
    assert engine.efficiency(data_t, compute_t) < 0.5  # compute took less than the wait


def test_tensorboard_server_shows_the_run(synthetic_run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir",
                             str(synthetic_run), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, tags = time.time() + 90, {}
        while time.time() < deadline:
            try:
                url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
                with urllib.request.urlopen(url, timeout=5) as response:
                    tags = json.load(response)
                if tags and "val/acc" in next(iter(tags.values()), {}):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        run_tags = next(iter(tags.values()), {})
        assert {"train/loss", "val/acc", "z_perf/compute_efficiency"} <= set(run_tags)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_torchvision_dataset_from_an_existing_copy(tmp_path):
    # MNIST files already in --data-dir: torchvision's real loader, no download.
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 40), ("t10k", 10)):
        labels = torch.arange(n, dtype=torch.uint8) % 10
        images = (labels.view(-1, 1, 1) * 25).expand(n, 28, 28).clone()
        images += torch.randint(0, 5, (n, 28, 28), generator=g, dtype=torch.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    run_dir = tmp_path / "run"
    assert train.main(["--dataset", "mnist", "--data-dir", str(tmp_path / "data"),
                       "--network", "simple_cnn", "--epochs", "1", "--batch-size", "8",
                       "--num-workers", "0", "--run-dir", str(run_dir), "--device", "cpu"]) == 0
    train_set, val_set = data.build_datasets(parse_config(
        ["--dataset", "mnist", "--data-dir", str(tmp_path / "data")])[0])
    assert (len(train_set), len(val_set), train_set.in_channels) == (40, 10, 1)
    image, label = train_set[(3, 0)]
    assert image.shape == (1, 28, 28) and label == 3
    assert final_state(run_dir)["model"]["features.0.block.0.weight"].shape[1] == 1


def test_deterministic_flag_is_set_for_its_run_only(tmp_path):
    assert train.main(tiny_args(tmp_path / "a", "--deterministic")) == 0
    assert torch.are_deterministic_algorithms_enabled()
    assert train.main(tiny_args(tmp_path / "b")) == 0
    assert not torch.are_deterministic_algorithms_enabled()
    torch.testing.assert_close(final_state(tmp_path / "a")["model"],
                               final_state(tmp_path / "b")["model"], rtol=0, atol=0)


def test_progress_bar_shows_loss_throughput_and_efficiency(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runlog, "_isatty", lambda stream: True)  # as in a terminal
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    bar = capsys.readouterr().err
    assert "epoch 1/1" in bar
    assert re.search(r"eff=\d\.\d\d, loss=\d+\.\d{4}, samples_s=\d+", bar)


@pytest.mark.parametrize("amp, tf32, devices, peak", [
    (torch.bfloat16, True, 1, 756.5),       # H100 PCIe bf16
    (None, True, 1, 378.0),                 # --amp none: convolutions run in TF32
    (None, False, 1, 51.2),                 # ... unless cuDNN may not
    (torch.float16, True, 4, 4 * 756.5),    # 4 processes (or --gpus): 4 GPUs' peak
])
def test_mfu_divides_by_the_peak_of_every_gpu_at_the_precision_used(monkeypatch, amp, tf32,
                                                                      devices, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    assert hardware.peak_tflops(torch.device("cuda", 0), amp, devices) == pytest.approx(peak)
    assert hardware.peak_tflops(torch.device("cpu"), amp, devices) is None
    record = train.metrics.epoch_record(1, 10, 5.0, 10, 0.1, (1.0, 3.0, 4.0), 4000,
                                        flops_per_sample=10**11, peak_tflops=peak)
    assert record["tflops"] == pytest.approx(100.0)   # 1000 samples/s x 0.1 TFLOP
    assert record["mfu"] == pytest.approx(100.0 / peak)


def test_gpu_count_is_the_processes_or_the_dataparallel_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    procs = train.runtime.Processes(0, 1, torch.device("cuda", 0))
    assert hardware.gpu_count({"gpus": None}, procs) == 1
    assert hardware.gpu_count({"gpus": "0,2,3"}, procs) == 3
    assert hardware.gpu_count({"gpus": None}, procs._replace(world_size=8)) == 8


class _Readbacks(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's value back to the host (on CUDA: a sync)."""

    READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy",
             "cpu", "__array__"}

    def __init__(self):
        super().__init__()
        self.calls, self.paused = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flags", [
    (),
    ("--amp", "fp16", "--grad-clip", "1", "--virtual-batch-size", "32"),  # the GradScaler
    ("--ema-decay", "0.9", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"),
    ("--data-on-device", "on", "--network", "simple_cnn"),
])
def test_no_value_is_read_back_between_log_steps(tmp_path, monkeypatch, flags):
    # The hot path (the step, and run_epoch's decisions after it) reads nothing back to the
    # host: on CUDA each read is a device sync. Log steps read the counters, once. (The
    # per-sample DataLoader works on CPU tensors before they reach the device: not counted;
    # the device path, which makes its batches on the device, is.)
    counter, logs = _Readbacks(), []
    real_log = train.log_train

    def log_train(training, bar):  # the log step's own reads are allowed: not counted
        counter.paused += 1
        try:
            logs.append(training.state.step)
            return real_log(training, bar)
        finally:
            counter.paused -= 1

    def run_epoch(*args):
        with counter:
            return real_run_epoch(*args)

    def batches(prefetcher):  # the DataLoader's own work on CPU tensors is not counted
        it = real_iter(prefetcher)
        while True:
            counter.paused += 1
            try:
                batch = next(it, None)
            finally:
                counter.paused -= 1
            if batch is None:
                return
            yield batch

    def start(prefetcher, loader, depth):  # iter(DataLoader) draws its base seed
        counter.paused += 1
        try:
            real_init(prefetcher, loader, depth)
        finally:
            counter.paused -= 1

    real_run_epoch, real_iter = train.run_epoch, engine._Prefetcher.__iter__
    real_init = engine._Prefetcher.__init__
    monkeypatch.setattr(train, "log_train", log_train)
    monkeypatch.setattr(train, "run_epoch", run_epoch)
    monkeypatch.setattr(engine._Prefetcher, "__iter__", batches)
    monkeypatch.setattr(engine._Prefetcher, "__init__", start)
    args = tiny_args(tmp_path, "--log-every", "1000", "--no-augment", *flags, size=160,
                     epochs=2)
    assert train.main(args) == 0
    assert final_state(tmp_path)["step"] >= 10 and len(logs) == 2  # one log per epoch end
    assert counter.calls == []


def test_top5_accuracy_is_logged_where_there_are_more_than_five_classes(tmp_path):
    run = tmp_path / "ten"
    assert train.main(tiny_args(run, "--ema-decay", "0.9", "--no-augment", epochs=2)) == 0
    records = read_metrics(run)
    assert all(r["val_acc5"] >= r["val_acc"] and 0 <= r["val_acc5"] <= 1 for r in records)
    assert all(r["val_acc5_ema"] >= r["val_acc_ema"] for r in records)
    logged = events(run)
    assert [e.value for e in logged.Scalars("val/acc5")] == pytest.approx(
        [r["val_acc5"] for r in records])
    assert "val_ema/acc5" in logged.Tags()["scalars"]
    out = tmp_path / "r.json"
    assert load_test_py().main(["--checkpoint", str(run / "checkpoints" / "last.pt"),
                                "--weights", "raw", "--num-workers", "0", "--device", "cpu",
                                "--json", str(out)]) == 0
    assert json.loads(out.read_text())["accuracy_top5"] == records[-1]["val_acc5"]
    few = tmp_path / "five"  # exactly five: every class is in the top five, nothing to say
    assert train.main(tiny_args(few, "--num-classes", "5", "--ema-decay", "0.9")) == 0
    assert not [k for k in read_metrics(few)[-1] if "acc5" in k]
    assert not [t for t in events(few).Tags()["scalars"] if "acc5" in t]


def test_top5_counts_a_class_among_the_five_largest_logits():
    loop = engine.LoopSettings(device=torch.device("cpu"), show_progress=False)
    logits = torch.tensor([[9., 8, 7, 6, 5, 4, 0], [0., 1, 2, 3, 4, 5, 6]])
    net = torch.nn.Identity()
    result = engine.evaluate(net, [(logits, torch.tensor([4, 0]))], loop,
                             Classification(7))
    assert result["acc"] == 0.0 and result["acc5"] == 0.5  # class 4 is 5th; class 0 last


def test_the_epochs_time_is_its_steps_not_the_save_before_its_validation(tmp_path,
                                                                          monkeypatch):
    """The checkpoint written before a validation (round 5's F7) is not the epoch's
    training time: samples_per_sec and epoch_time count the steps alone. The clock jumps
    100 s inside every save; the epoch's time stays below it."""
    from machinery import engine, saving

    offset = [0.0]
    clock = engine.time.perf_counter
    monkeypatch.setattr(engine.time, "perf_counter", lambda: clock() + offset[0])
    save = saving.Saver.save

    def slow_save(self, *args, **kwargs):
        offset[0] += 100.0
        return save(self, *args, **kwargs)

    monkeypatch.setattr(saving.Saver, "save", slow_save)
    assert train.main(tiny_args(tmp_path, epochs=2)) == 0
    assert all(r["epoch_time"] < 100 for r in read_metrics(tmp_path)), read_metrics(tmp_path)
