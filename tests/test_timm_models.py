"""``--network timm/<name>`` keeps every promise of the loop (issue 57): a tiny timm ViT
(``test_vit``: LayerNorm, no BatchNorm, no dropout) built without weights, on the
synthetic set, with layer-wise lr decay, no decay on norms, EMA and a frozen first block
unfrozen at epoch 2 by timm's module names. One run is shared by the tests that read it:
a SIGTERM and ``--resume auto`` end bit for bit where it ends, accumulation and torchrun
2x equal it, ``--verify-resume`` passes, a resume with other groups is one line; AMP
(bf16 on the CPU), ``--compile``, ``--preflight``'s groups, test.py's safetensors export;
photos of a timm model on both data paths, bit for bit."""

import json
import os

import pytest
import torch
from helpers import (
    ROOT,
    assert_batches_equal,
    assert_states_equal,
    final_state,
    fork_popen,
    load_test_py,
    main_in_process,
    photo_folder,
    read_metrics,
    stop_at_step,
    tiny_args,
    torchrun,
    watch_training,
)

import train
from config import with_defaults
from machinery import verify_resume
from pipeline import data, device_data

pytestmark = pytest.mark.slow

# 64 samples, batch 16: 4 steps an epoch, 8 in all; the first block frozen in epoch 1.
FLAGS = ("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.05",
         "--layer-decay", "0.75", "--norm-weight-decay", "0", "--ema-decay", "0.9",
         "--no-augment", "--scheduler", "none", "--freeze", "blocks.0.*", "--unfreeze-at",
         "2", "--data-on-device", "off")


def vit_args(run_dir, *extra, batch=16, epochs=2):
    return tiny_args(run_dir, *FLAGS, *extra, network="timm/test_vit", size=64, image=32,
                     batch=batch, epochs=epochs)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    assert train.main(vit_args(run_dir)) == 0
    return run_dir


def test_it_trains_with_the_groups_in_the_checkpoint(whole):
    saved = final_state(whole)
    assert saved["step"] == 8 and saved["config"]["network"] == "timm/test_vit"
    groups = saved["optimizer"]["param_groups"]
    scales = {g["group"]: g["lr_scale"] for g in groups}
    assert scales["layer 7/weight_decay"] == 1.0  # the head
    assert scales["layer 1/weight_decay"] == pytest.approx(0.75 ** 6)  # the first block
    unfrozen = [g for g in groups if g["unfrozen"]]
    assert unfrozen and all(g["group"].startswith("layer 1/") for g in unfrozen)
    assert {g["weight_decay"] for g in groups if "norm" in g["group"]} == {0.0}
    records = read_metrics(whole)
    assert len(records) == 2 and all(r["train_loss"] == r["train_loss"] for r in records)


def test_a_sigterm_and_resume_auto_end_bit_for_bit(whole, tmp_path):
    with stop_at_step(3):  # inside epoch 1, before the unfreeze
        assert train.main(vit_args(tmp_path)) == 143
    assert final_state(tmp_path)["step"] == 3
    assert train.main(vit_args(tmp_path, "--resume", "auto")) == 0
    a, b = final_state(whole), final_state(tmp_path)
    for key in ("model", "ema", "optimizer"):
        assert_states_equal(a[key], b[key])


def test_a_resume_with_other_groups_is_one_line(whole, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(whole, run)
    code, _, err = main_in_process(train.main, vit_args(run, "--resume", "auto", "--epochs",
                                                        "3", "--layer-decay", "0.5"), capsys)
    assert code == 2
    assert err.strip().startswith("error: the parameter groups differ from")
    assert len(err.strip().splitlines()) == 1


# AdamW moves a parameter by about lr (0.002) a step whatever its gradient's size: a
# near-zero gradient summed in another order moves it by up to ~1e-5 otherwise; a wrong
# batch (another sample, a lost micro-batch) moves it by steps of lr.
CLOSE = {"atol": 1e-4, "rtol": 1e-4}


def test_accumulation_equals_one_batch(whole, tmp_path):
    assert train.main(vit_args(tmp_path, "--virtual-batch-size", "16", batch=8)) == 0
    torch.testing.assert_close(final_state(tmp_path)["model"], final_state(whole)["model"],
                               **CLOSE)


def test_two_processes_equal_one(whole, tmp_path):
    torchrun(vit_args(tmp_path, batch=8))
    torch.testing.assert_close(final_state(tmp_path)["model"], final_state(whole)["model"],
                               **CLOSE)
    torch.testing.assert_close(final_state(tmp_path)["ema"], final_state(whole)["ema"],
                               **CLOSE)


def test_verify_resume_is_exact(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(verify_resume, "start_process", fork_popen)
    monkeypatch.chdir(ROOT)
    code, out, err = main_in_process(train.main, [*vit_args(tmp_path), "--verify-resume",
                                                  "--verify-resume-steps", "6"], capsys)
    assert code == 0, (out + err)[-2000:]
    assert "resume exact:" in out + err, (out + err)[-800:]


def test_bf16_autocast_trains_it_on_the_cpu(tmp_path):
    with watch_training() as (dtypes, _):
        assert train.main(vit_args(tmp_path, "--amp", "bf16", "--max-steps", "2")) == 0
    assert torch.bfloat16 in dtypes
    assert torch.isfinite(final_state(tmp_path)["model"]["head.weight"]).all()


def test_compile_trains_it(tmp_path):
    assert train.main(vit_args(tmp_path, "--compile", "--max-steps", "2", "--epochs",
                               "1")) == 0
    assert final_state(tmp_path)["step"] == 2


def test_preflight_prints_the_groups_once(tmp_path, capsys):
    code, out, err = main_in_process(train.main, vit_args(tmp_path, "--preflight"), capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("param groups:")]
    assert len(lines) == 1  # (the frozen first block: its two groups join at epoch 2)
    assert lines[0].startswith("param groups: 13 (") and "lr x1, decay 0.05" in lines[0]


def test_a_safetensors_export_evaluates_as_the_checkpoint(whole, tmp_path, capsys):
    test_py = load_test_py()
    last = str(whole / "checkpoints" / "last.pt")
    out = tmp_path / "vit.safetensors"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert test_py.main(["--checkpoint", last, "--export", str(out), "--json", str(a),
                         "--num-workers", "0", "--device", "cpu"]) == 0
    assert test_py.main(["--model", str(out), "--json", str(b), "--num-workers", "0"]) == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["accuracy"] == rb["accuracy"] and ra["loss"] == pytest.approx(rb["loss"])
    assert os.path.getsize(out) > 0


def test_photos_of_a_timm_model_are_the_same_on_both_data_paths(tmp_path):
    root = photo_folder(tmp_path)
    cfg = with_defaults({"dataset": "imagefolder", "data_dir": str(root), "seed": 3,
                         "augment": True, "image_size": 64, "crop_pct": 0.95,
                         "network": "timm/test_vit", "batch_size": 4, "num_workers": 0})
    train_set, val_set = data.build_datasets(cfg)
    assert "bicubic" in repr(train_set.transform) and "0.5" in repr(train_set.transform)
    sampler = data.EpochBatchSampler(len(train_set), 4, 3)
    sampler.set_epoch(1)
    per_sample = list(data.build_loader(train_set, batch_sampler=sampler, num_workers=0))
    train_loader, val_loader = device_data.build_device_loaders(cfg, train_set, val_set,
                                                                sampler, "cpu")
    assert_batches_equal(per_sample, list(train_loader))
    assert_batches_equal(list(data.build_loader(val_set, batch_size=4)), list(val_loader))


def test_the_readme_timm_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """README "A timm model": fine-tune timm's resnet10t from a fake Hugging Face cache
    (its weights made here, in the hub's layout), export, evaluate the file alone; then
    the offline line with nothing cached, one error line naming what to place where."""
    import re

    import timm
    from helpers import run_as_written
    from safetensors.torch import save_file

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"### A timm model\n.*?```bash\n(.*?)```", readme, flags=re.DOTALL)
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 4 and lines[3].startswith("HF_HUB_OFFLINE=1 python train.py")
    images = photo_folder(tmp_path / "photos", per_class=4)
    repo = tmp_path / "hf" / "hub" / "models--timm--resnet10t.c3_in1k"
    (repo / "snapshots" / "r1").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("r1")
    weights = timm.create_model("resnet10t", num_classes=1000).state_dict()
    save_file(weights, str(repo / "snapshots" / "r1" / "model.safetensors"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here tries the network
    small = ["--epochs", "1", "--image-size", "64", "--batch-size", "4", "--num-workers", "0",
             "--device", "cpu"]
    outputs = []
    for line in lines[:3]:
        argv = [str(images) if word == "DIR" else word for word in line.split()]
        extra = small if argv[1] == "train.py" else ["--num-workers", "0"]
        code, out, err = run_as_written([*argv, *extra], tmp_path, monkeypatch, capsys)
        assert code == 0, err[-2000:]
        outputs.append(out + err)
    assert "pretrained: loaded" in outputs[0] and "resnet10t.c3_in1k" in outputs[0]
    assert "kept the new head (fc.weight, fc.bias)" in outputs[0]
    assert (tmp_path / "resnet10t.safetensors").is_file()
    accuracy = re.search(r"accuracy\s+([\d.]+)", outputs[1]).group(1)
    assert re.search(r"accuracy\s+([\d.]+)", outputs[2]).group(1) == accuracy
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    argv = [str(images) if word == "DIR" else word for word in lines[3].split()[1:]]
    code, out, err = run_as_written([*argv, *small], tmp_path, monkeypatch, capsys)
    assert code == 2
    message = err.strip().splitlines()
    assert len([m for m in message if m.startswith("error:")]) == 1
    assert message[-1].startswith("error: --pretrained timm: timm/resnet10t.c3_in1k/model."
                                  "safetensors is not in the Hugging Face cache")
    assert str(tmp_path / "empty" / "hub" / "models--timm--resnet10t.c3_in1k" / "snapshots")\
        in message[-1]
