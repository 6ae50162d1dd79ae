"""Promises that realistic bugs once broke without any test failing (issue 29, item 5):
each test here fails when its bug is put back (the issue names the bugs)."""

import json
import re
import time

import pytest
import torch
from helpers import (
    final_state,
    fork_popen,
    load_test_py,
    photo_folder,
    read_metrics,
    tiny_args,
    tv_args,
    write_image_folder,
)

import train
from config import parse_config
from pipeline import data

# ------------------------------------------------- a decoded cache over 64 MiB is reused

def test_a_photo_cache_larger_than_a_checksum_chunk_is_reused(tmp_path, capfd):
    # The images file is checksummed in 64 MiB pieces; a real photo folder's cache is
    # larger than one. 18 photos kept at a short side of 1170 (--image-size 1024): about
    # 85 MiB in the training split's cache. Each run after the first must reuse it.
    images = write_image_folder(tmp_path / "images", per_class=6, val_per_class=1)
    config = parse_config(["--dataset", "imagefolder", "--data-dir", str(images),
                           "--image-size", "1024", "--num-workers", "0"])[0]
    built = []
    first, _ = data.build_datasets(config, log=built.append)
    assert first.base.decoded.nbytes > 64 * 2**20  # more than one checksum piece
    capfd.readouterr()
    again = []
    second, _ = data.build_datasets(config, log=again.append)
    err = capfd.readouterr().err
    assert "damaged" not in err and "Traceback" not in err, err
    assert len(again) == 2 and all(line.endswith("reused") for line in again), again
    assert torch.equal(first.base.decoded.images, second.base.decoded.images)


# ------------------------------------------------- --pretrained torchvision and its crop

def test_an_explicit_crop_pct_wins_over_the_weights(tmp_path):
    tv = ["--dataset", "imagefolder", "--network", "torchvision/convnext_tiny",
          "--pretrained", "torchvision"]
    config, _ = parse_config([*tv, "--crop-pct", "0.8"])
    assert config["crop_pct"] == 0.8 and config["image_size"] == 224  # its size kept
    config, _ = parse_config([*tv, "--image-size", "160"])  # its crop fraction kept
    assert config["image_size"] == 160 and config["crop_pct"] == pytest.approx(224 / 236)
    recipe = tmp_path / "recipe.yaml"  # a recipe sets them as the command line does
    recipe.write_text("crop_pct: 0.7\nimage_size: 96\n")
    config, _ = parse_config([*tv, "--config", str(recipe)])
    assert (config["crop_pct"], config["image_size"]) == (0.7, 96)


# ---------------------------------------------------- downloaded weights, hash-checked

def test_downloaded_weights_that_fail_their_hash_are_refused(
        tmp_path, fake_hub, capsys):  # noqa: F811 (the fixture imported above)
    import pathlib
    import urllib.parse

    weights, _, cached = fake_hub
    served = pathlib.Path(urllib.parse.urlparse(weights.url).path)
    blob = bytearray(served.read_bytes())  # damaged on the way: 64 bytes of tensor data
    for i in range(len(blob) // 2, len(blob) // 2 + 64):
        blob[i] ^= 0xFF
    served.write_bytes(bytes(blob))
    torch.load(served, weights_only=True)  # the damage is not one torch.load sees
    images = photo_folder(tmp_path / "images")
    for run in (tmp_path / "run", tmp_path / "again"):  # nor is it trusted the next time
        assert train.main(tv_args(run, images)) != 0
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "--pretrained" in errors[0], err
        assert "Traceback" not in err
        assert not (run / "checkpoints" / "last.pt").exists()  # nothing trained on them


# ------------------------------------------------------------------ MLflow on a resume

@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A file store's URI (MLflow 3.7+ opens one only when allowed), the experiment the
    dataset's; MLflow's HTTP settings restored after the test."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    return (tmp_path / "mlruns").as_uri()


def test_a_resumed_mlflow_run_is_running_while_it_trains(tmp_path, mlflow_store):
    from helpers import stop_at_step
    from mlflow.tracking import MlflowClient
    from torch.optim.optimizer import register_optimizer_step_post_hook

    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, "--mlflow", mlflow_store, epochs=2)
    with stop_at_step(3):
        assert train.main(args) == 143
    client, run_id = MlflowClient(tracking_uri=mlflow_store), final_state(run_dir)[
        "mlflow_run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    seen = []  # what `mlflow ui` shows after each step of the resumed run
    handle = register_optimizer_step_post_hook(
        lambda *_: seen.append(client.get_run(run_id).info.status))
    try:
        assert train.main([*args, "--resume", "auto"]) == 0
    finally:
        handle.remove()
    assert seen == ["RUNNING"] * 5, seen  # steps 4-8
    assert client.get_run(run_id).info.status == "FINISHED"


def test_the_mlflow_run_id_survives_a_resume_while_mlflow_is_down(tmp_path, mlflow_store,
                                                                   capsys):
    from helpers import closed_port, only_run

    run_dir = tmp_path / "run"
    assert train.main(tiny_args(run_dir, "--mlflow", mlflow_store, "--max-steps", "2",
                                epochs=2)) == 0
    run_id = final_state(run_dir)["mlflow_run_id"]
    with closed_port() as sock:  # the server is down for the next part
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert train.main(tiny_args(run_dir, "--resume", "auto", "--mlflow", down,
                                    "--max-steps", "5", epochs=2)) == 0
    assert "training goes on without recording in MLflow" in capsys.readouterr().err
    assert final_state(run_dir).get("mlflow_run_id") == run_id  # kept for later
    assert train.main(tiny_args(run_dir, "--resume", "auto", "--mlflow", mlflow_store,
                                "--max-steps", "0", epochs=2)) == 0
    assert f"mlflow: continuing run {run_id}" in capsys.readouterr().out
    _, run = only_run(mlflow_store)  # one run, the first, finished
    assert run.info.run_id == run_id and run.info.status == "FINISHED"


# ------------------------------------------------------------------------ early stopping

def stop_epoch(values, patience, min_delta, resets=True):
    """The epoch at which --early-stop-patience stops a run whose validations give
    ``values`` (the README's rule, computed here on its own), or None; ``resets=False``:
    the bug where an improvement does not reset the count."""
    best, waited = -float("inf"), 0
    for epoch, value in enumerate(values, 1):
        if value > best + min_delta:
            best, waited = value, (0 if resets else waited)
        else:
            waited += 1
        if waited >= patience:
            return epoch
    return None


def test_an_improvement_resets_the_early_stop_patience(tmp_path, train_main):
    # A slow learner (AdamW at 1e-4): val_acc rises by about 0.1-0.25 an epoch, so with
    # --early-stop-min-delta 0.2 some epochs improve enough and some do not.
    run_dir = tmp_path / "run"
    assert train_main(tiny_args(run_dir, "--optimizer", "adamw", "--lr", "1e-4",
                                "--scheduler", "none", "--early-stop-patience", "2",
                                "--early-stop-min-delta", "0.2", size=96, epochs=5)) == 0
    values = [r["val_acc"] for r in read_metrics(run_dir)]
    assert len(values) == (stop_epoch(values, 2, 0.2) or 5), values
    # the case at hand: a count never reset would have stopped the run sooner
    assert (stop_epoch(values, 2, 0.2, resets=False) or 6) < len(values), values


# ---------------------------------------------------------------------- top-5 accuracy

def test_the_emas_top5_is_the_emas_own(tmp_path, train_main):
    # 20 classes, a fast learner and a slow average (no warm-up): after one epoch the
    # network's top-5 is far above its moving average's.
    run_dir = tmp_path / "run"
    assert train_main(tiny_args(run_dir, "--ema-decay", "0.99", "--no-ema-warmup",
                                "--num-classes", "20", "--lr", "0.01", "--no-augment",
                                size=160)) == 0
    logged = read_metrics(run_dir)[-1]
    test_py = load_test_py()
    for weights, key in (("raw", "val_acc5"), ("ema", "val_acc5_ema")):
        out = tmp_path / f"{weights}.json"
        assert test_py.main(["--checkpoint", str(run_dir / "checkpoints" / "last.pt"),
                             "--weights", weights, "--num-workers", "0", "--device", "cpu",
                             "--json", str(out)]) == 0
        assert json.loads(out.read_text())["accuracy_top5"] == logged[key], weights
    assert logged["val_acc5"] != logged["val_acc5_ema"], logged  # the case at hand


# ----------------------------------------------------- the profiler's data/compute verdict

def test_the_profilers_verdict_counts_only_the_profiled_steps(tmp_path, monkeypatch, capsys):
    # The first two batches are slow to read (a cold disk): 0.5 s each. Steps 3-4 are
    # profiled (1 skipped, 1 warm-up, 2 recorded); their batches come at once, so the
    # time they waited for data is far below one slow batch's.
    args = tiny_args(tmp_path, "--profile-steps", "2", "--data-on-device", "off",
                     "--prefetch", "0")
    sampler = data.EpochBatchSampler(64, 16, parse_config(args)[0]["seed"])
    cold = {key for batch in list(sampler)[:2] for key in batch}  # epoch 0's first two
    real = data.SeededDataset.__getitem__

    def cold_then_warm(self, key):
        if key in cold:
            time.sleep(0.5 / 16)
        return real(self, key)

    monkeypatch.setattr(data.SeededDataset, "__getitem__", cold_then_warm)
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert read_metrics(tmp_path)[0]["data_time"] > 0.9  # the epoch waited for those two
    verdict = re.findall(r"^profile: (?:data|compute)-bound: .*\(data (\d+\.\d+) s, "
                         r"compute \d+\.\d+ s over 2 steps\)", out, re.M)
    assert len(verdict) == 1, out
    assert float(verdict[0]) < 0.4, verdict  # steps 3-4 only


# ------------------------------------------------------------------- the LR range test

def test_each_step_of_the_lr_range_test_trains_at_its_own_rate(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    used = []  # the rate each optimizer step is taken at
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, *_: used.append([g["lr"] for g in optimizer.param_groups]))
    try:
        assert train.main(tiny_args(tmp_path, "--find-lr", "--find-lr-steps", "6",
                                    "--find-lr-min", "1e-4", "--find-lr-max", "1e-1")) == 0
    finally:
        handle.remove()
    expected = [1e-4 * 1000 ** (i / 5) for i in range(6)]  # min * (max / min) ** (i / 5)
    with open(tmp_path / "lr_find.json") as f:
        swept = json.load(f)
    assert swept["lrs"] == pytest.approx(expected)  # each loss is the one taken at ...
    assert [lrs[0] for lrs in used] == pytest.approx(expected)  # ... the rate trained at
    assert all(len(set(lrs)) == 1 for lrs in used)  # on every param group


# ------------------------------------- process 0 fails while the others wait for it

FAIL_ON_0 = """
import os, sys, time
sys.path.insert(0, {root!r})
import train
from pipeline import data
from ops import UserError
real = data.build_datasets
def build_datasets(config, *args, **kwargs):  # process 0 finds no data, after a while
    if os.environ["RANK"] == "0":
        time.sleep(2)
        raise UserError("made to fail: no data here")
    return real(config, *args, **kwargs)
data.build_datasets = build_datasets
sys.exit(train.main())
"""


@pytest.mark.parametrize("store", ["process 0's", "the launcher's"],
                         ids=["store-of-process-0", "store-of-the-agent"])
def test_the_others_are_told_when_process_0_fails_without_a_launcher_signal(tmp_path, store):
    """Two processes started as a launcher other than torchrun starts them (srun, mpirun,
    a script): the environment torch.distributed reads, and no SIGTERM to the others when
    one fails. The store is process 0's (it goes when process 0 does), or the launcher's
    own (it stays: as torchrun's agent's, with nothing sent)."""
    import socket
    import subprocess
    import sys

    import torch.distributed as dist
    from helpers import ROOT, _child_env

    env = {**_child_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    server = None
    if store == "the launcher's":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env.update(MASTER_PORT=str(server.port), TORCHELASTIC_USE_AGENT_STORE="True")
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
    script = tmp_path / "launch.py"
    script.write_text(FAIL_ON_0.format(root=ROOT))
    args = tiny_args(tmp_path / "run", "--data-on-device", "off")
    procs = [fork_popen([sys.executable, str(script), *args], cwd=ROOT,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        first, _ = procs[0].communicate(timeout=300)
        try:  # once process 0 is gone, the other has a few seconds, not forever
            other, _ = procs[1].communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("process 1 still waits, 30 s after process 0 failed")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert procs[0].returncode == 2 and "error: made to fail: no data here" in first, first
    lines = [line for line in other.splitlines() if line.strip()]
    assert lines == ["error: process 0 failed while reading synthetic (downloading it if "
                     "needed) (UserError: made to fail: no data here)"], other
    assert procs[1].returncode == 1
    del server
