"""The batch of a non-finite loss, kept and replayed (replay.py, train.py --replay)."""

import json
import os
import re
import shutil

import pytest
import torch
from helpers import finish, snapshot, start_torchrun, tiny_args, write_image_folder, write_launcher
from torch import nn

import networks
import replay
import train
from machinery import hardware
from pipeline import data

MARK = 100.0  # synthetic pixels are about N(0, 1): only the marked sample reaches this
PER_SAMPLE = ("--data-on-device", "off")  # samples through SeededDataset (marked below)


class Blowup(nn.Module):
    """Multiplies a sample by 1e60 (float32: inf) when it carries the marker."""

    def forward(self, x):
        marked = x.flatten(1).amax(1) > MARK / 2
        scale = (1 + marked * 1e30).view(-1, *[1] * (x.dim() - 1))
        return x * scale * scale


def overflow_mlp(num_classes, in_channels, image_size):
    return nn.Sequential(Blowup(), nn.Flatten(),
                         nn.Linear(in_channels * image_size * image_size, 32), nn.ReLU(),
                         nn.Linear(32, num_classes))


class InfGradient(torch.autograd.Function):
    """The identity forward; backward, an infinite gradient for a marked sample."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        marked = (x.amax(1) > MARK / 10).view(-1, 1)  # (after a Linear: N(0, 0.3) unmarked)
        return torch.where(marked, grad * float("inf"), grad)


class BadGradient(nn.Module):
    def forward(self, x):
        return InfGradient.apply(x)


def bad_gradient_mlp(num_classes, in_channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, 32),
                         BadGradient(), nn.ReLU(), nn.Linear(32, num_classes))


def bad_sample(epoch=1, batch=2, position=5, size=64, batch_size=16):
    """The index the sampler puts at ``position`` of ``batch`` in ``epoch`` (seed 0)."""
    sampler = data.EpochBatchSampler(size, batch_size, seed=0)
    sampler.set_epoch(epoch)
    return int(list(sampler.index_batches())[batch][position])


def mark_sample(monkeypatch, index, epoch):
    """Sample ``index`` of the training set carries the marker in ``epoch`` only (its
    augmentation, say, is a pure function of (seed, epoch, index) like every sample's)."""
    plain = data.SeededDataset.__getitem__

    def getitem(self, key):
        image, label = plain(self, key)
        if key == (index, epoch):
            image = torch.full_like(image, MARK)
        return image, label

    monkeypatch.setattr(data.SeededDataset, "__getitem__", getitem)




@pytest.fixture
def overflow(monkeypatch):
    monkeypatch.setitem(networks.NETWORKS, "overflow_mlp", overflow_mlp)


def test_a_nonfinite_loss_is_recorded_and_the_replay_names_module_and_sample(
        tmp_path, capsys, monkeypatch, overflow):
    run_dir = tmp_path / "run"
    index = bad_sample()  # epoch 2, its 3rd batch: step 7 (4 steps an epoch)
    mark_sample(monkeypatch, index, epoch=1)
    assert train.main(tiny_args(run_dir, *PER_SAMPLE, network="overflow_mlp", epochs=2)) == 1
    err = capsys.readouterr().err
    record_path = run_dir / "checkpoints" / "nonfinite-step-00000007.json"
    assert f"replay it with: python train.py --replay {record_path}" in err
    assert err.count("--replay") == 1  # one record a run, though the losses stay NaN
    record = json.loads(record_path.read_text())
    assert record["step"] == 7 and record["epoch"] == 1 and record["what"] == "loss"
    assert record["micro_batch"] == 0 and len(record["micro_batches"]) == 1
    assert index in record["micro_batches"][0]["samples"]
    assert record["micro_batches"][0]["batch"] == 2
    assert record["checkpoint"] == str(run_dir / "checkpoints" / "last.pt")  # step 4's
    assert record["config"]["network"] == "overflow_mlp"

    # A record whose config names a task file never imports it (issue 51's F1): one line
    # that says which flag to add, and the file has not run.
    (tmp_path / "payload.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n")
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps({**record, "config": {**record["config"], "task":
                                                     f"{tmp_path / 'payload.py'}:X"}}))
    assert train.main(["--replay", str(evil)]) == 2
    err = capsys.readouterr().err
    assert f"add --task {tmp_path / 'payload.py'}:X" in err and "Traceback" not in err
    assert not (tmp_path / "RAN").exists()

    before = snapshot(run_dir)
    assert train.main(["--replay", str(record_path)]) == 0
    out = capsys.readouterr().out
    assert "reproduced the non-finite loss" in out and "(step 4)" in out
    assert "first non-finite output: module '0' (Blowup)" in out  # Sequential's first child
    assert "its inputs were finite" in out
    assert f"samples: {index}\n" in out + "\n"  # that sample only
    assert snapshot(run_dir) == before  # the recorded run is only read

    monkeypatch.undo()  # the sample unmarked: the step is finite now
    monkeypatch.setitem(networks.NETWORKS, "overflow_mlp", overflow_mlp)
    assert train.main(["--replay", str(record_path)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[-1].startswith("error: not reproduced: step 7")
    assert snapshot(run_dir) == before


def test_the_record_names_the_micro_batch_of_a_step(tmp_path, capsys, monkeypatch, overflow):
    # --virtual-batch-size 32 of batches 16: two micro-batches a step. The marked sample is
    # in epoch 1's 4th batch: the second micro-batch of step 2; no checkpoint before it.
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=0, batch=3, position=9)
    mark_sample(monkeypatch, index, epoch=0)
    code = train.main(tiny_args(run_dir, *PER_SAMPLE, "--virtual-batch-size", "32",
                                network="overflow_mlp"))
    assert code == 1
    record_path = run_dir / "checkpoints" / "nonfinite-step-00000002.json"
    record = json.loads(record_path.read_text())
    assert record["step"] == 2 and record["micro_batch"] == 1
    assert [mb["batch"] for mb in record["micro_batches"]] == [2, 3]
    assert index in record["micro_batches"][1]["samples"]
    assert record["checkpoint"] is None
    capsys.readouterr()
    # As on CUDA, where training times cuDNN's algorithms (benchmark): the replay does not,
    # or another algorithm each replay could make it "not reproduced"
    real_seed, real_replay_to, seen = hardware.seed_everything, replay.replay_to, []
    monkeypatch.setattr(hardware, "seed_everything", lambda seed, rank, deterministic, device,
                        **kw: real_seed(seed, rank, deterministic, torch.device("cuda"), **kw))
    monkeypatch.setattr(replay, "replay_to", lambda *a: seen.append(
        torch.backends.cudnn.benchmark) or real_replay_to(*a))
    try:
        assert train.main(["--replay", str(record_path)]) == 0
    finally:
        torch.backends.cudnn.benchmark = False
    assert seen == [False]
    out = capsys.readouterr().out
    assert "from the initial weights" in out and "together" not in out
    assert "micro-batch 2 of 2" in out and f"samples: {index}\n" in out + "\n"


def test_the_replay_names_an_image_folder_sample_by_its_file(tmp_path, capsys, monkeypatch,
                                                            overflow):
    images = write_image_folder(tmp_path / "images")  # 3 classes of 6 images: 18 samples
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=0, batch=1, position=2, size=18, batch_size=4)
    mark_sample(monkeypatch, index, epoch=0)
    args = tiny_args(run_dir, *PER_SAMPLE, "--dataset", "imagefolder", "--data-dir",
                     str(images), network="overflow_mlp", batch=4)
    assert train.main(args) == 1
    record_path = run_dir / "checkpoints" / "nonfinite-step-00000002.json"
    capsys.readouterr()
    assert train.main(["--replay", str(record_path)]) == 0
    out = capsys.readouterr().out
    path = images / "train" / ("cat", "dog", "emu")[index // 6] / f"{index % 6}.png"
    assert f"samples: {index} ({path})\n" in out


def test_under_ddp_the_record_holds_every_process_share_and_replays_in_one(
        tmp_path, capsys, monkeypatch, overflow):
    # Two processes of 8: the marked sample is the 14th of epoch 2's 3rd global batch, so
    # only process 1's loss is not finite; the record says so, and one process replays it.
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=1, batch=2, position=13)
    launcher = write_launcher(tmp_path / "launch.py", LAUNCH.format(
        tests=os.path.dirname(os.path.abspath(__file__)), index=index))
    code, out = finish(start_torchrun(tiny_args(run_dir, *PER_SAMPLE, network="overflow_mlp",
                                                batch=8, epochs=2), script=launcher))
    assert code != 0 and "non-finite loss at step 7" in out, out[-3000:]
    record = json.loads((run_dir / "checkpoints" / "nonfinite-step-00000007.json").read_text())
    share = record["micro_batches"][0]["per_process"]
    assert record["world_size"] == 2 and len(share) == 2 and len(share[0]) == 8
    assert index in share[1] and index not in share[0]
    assert record["micro_batches"][0]["samples"] == share[0] + share[1]
    mark_sample(monkeypatch, index, epoch=1)
    assert train.main(["--replay", str(run_dir / "checkpoints" /
                                         "nonfinite-step-00000007.json")]) == 0
    out = capsys.readouterr().out
    assert "module '0' (Blowup)" in out and f"samples: {index}\n" in out
    assert "(2 processes' batches together on one device: --device cpu where they do not " \
        "fit)" in out


LAUNCH = """sys.path.insert(0, {tests!r})
import pytest, networks
from test_replay import mark_sample, overflow_mlp
patch = pytest.MonkeyPatch()
patch.setitem(networks.NETWORKS, "overflow_mlp", overflow_mlp)
mark_sample(patch, {index}, epoch=1)"""


def test_a_gradient_made_non_finite_in_the_backward_is_found_there(tmp_path, capsys,
                                                                   monkeypatch):
    # The loss is finite; the gradient norm is not: the backward of module '2' made it.
    monkeypatch.setitem(networks.NETWORKS, "bad_gradient_mlp", bad_gradient_mlp)
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=0, batch=1, position=3)
    mark_sample(monkeypatch, index, epoch=0)
    assert train.main(tiny_args(run_dir, *PER_SAMPLE, network="bad_gradient_mlp")) == 1
    record_path = run_dir / "checkpoints" / "nonfinite-step-00000002.json"
    assert "non-finite gradient norm at step 2" in capsys.readouterr().err
    assert json.loads(record_path.read_text())["what"] == "gradient norm"
    assert train.main(["--replay", str(record_path)]) == 0
    out = capsys.readouterr().out
    assert "first non-finite gradient: made in the backward pass of module '2' " \
           "(BadGradient)" in out
    assert "anomaly detection: Function 'InfGradientBackward' returned nan" in out


def test_the_replay_finds_its_checkpoint_in_a_moved_run_and_refuses_to_write(
        tmp_path, capsys, monkeypatch, overflow):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    index = bad_sample()
    mark_sample(monkeypatch, index, epoch=1)
    assert train.main(tiny_args(run_dir, *PER_SAMPLE, network="overflow_mlp", epochs=2)) == 1
    run_dir.rename(moved)  # the record names run/checkpoints/last.pt: gone
    record = str(moved / "checkpoints" / "nonfinite-step-00000007.json")
    capsys.readouterr()
    assert train.main(["--replay", record]) == 0
    out = capsys.readouterr().out
    assert f"from {moved / 'checkpoints' / 'last.pt'} (step 4)" in out
    (moved / "checkpoints" / "last.pt").unlink()  # another file of step 4 stands in
    assert train.main(["--replay", record]) == 0
    assert "(step 4): reproduced" in capsys.readouterr().out
    for name in os.listdir(moved / "checkpoints"):
        if name.endswith(".pt"):
            (moved / "checkpoints" / name).unlink()
    for args, env in ((["--run-dir", str(moved)], {}), (["--resume", "auto"], {}),
                      ([], {"WORLD_SIZE": "2"}), ([], {})):
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            assert train.main(["--replay", record, *args]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")
    assert not (moved / "checkpoints" / "last.pt").exists()


def test_a_healthy_run_writes_no_record(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, epochs=1)) == 0
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("nonfinite")]
    assert "--replay" not in capsys.readouterr().err


def test_a_missing_or_foreign_record_is_one_error_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{\"a\": 1}")
    for path in (tmp_path / "none.json", tmp_path / "x.json"):
        assert train.main(["--replay", str(path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("where", ["named", "beside"])
def test_a_pt_that_is_no_training_checkpoint_is_one_error_line(tmp_path, capsys, monkeypatch,
                                                               overflow, where):
    """Round 5's F3: a state_dict where the record's checkpoint was (or beside it) is named
    in one line, never a KeyError; the scan beside the record skips it."""
    run_dir = tmp_path / "run"
    mark_sample(monkeypatch, bad_sample(), epoch=1)
    assert train.main(tiny_args(run_dir, *PER_SAMPLE, network="overflow_mlp", epochs=2)) == 1
    folder = run_dir / "checkpoints"
    for old in folder.glob("*.pt"):
        old.unlink()
    plain = folder / ("last.pt" if where == "named" else "init.pt")
    torch.save({"w": torch.zeros(1)}, plain)
    capsys.readouterr()
    assert train.main(["--replay", str(folder / "nonfinite-step-00000007.json")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: --replay"), err
    expected = f"{str(plain)!r} is not a training checkpoint" if where == "named" \
        else "no checkpoint from before step 7 is left beside it"
    assert expected in err[0]


def test_a_record_beside_another_runs_checkpoints_says_so(tmp_path, capsys, monkeypatch,
                                                          overflow):
    """Round 5's F4: a record copied beside another run's checkpoints (its own run moved
    away) is not replayed from that run's weights: one line names the difference."""
    recorded, other = tmp_path / "run", tmp_path / "other"
    mark_sample(monkeypatch, bad_sample(), epoch=1)
    assert train.main(tiny_args(recorded, *PER_SAMPLE, network="overflow_mlp", epochs=2)) == 1
    monkeypatch.undo()
    monkeypatch.setitem(networks.NETWORKS, "overflow_mlp", overflow_mlp)
    assert train.main([*tiny_args(other, *PER_SAMPLE, network="overflow_mlp"),
                       "--lr", "0.01"]) == 0
    record = other / "checkpoints" / "nonfinite-step-00000007.json"
    shutil.copy(recorded / "checkpoints" / record.name, record)
    shutil.rmtree(recorded)
    capsys.readouterr()
    assert train.main(["--replay", str(record)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "is of another run than the record's" in err[0], err
    assert "its lr is 0.01, the record's 0.05" in err[0]


def test_fp16_steps_the_scaler_skips_are_not_recorded_as_nonfinite(tmp_path, capsys,
                                                                    monkeypatch):
    """Round 5's promise 9: under --amp fp16 a step the GradScaler skips (inf gradients, its
    normal working: here every step of a scale far too large) is no non-finite step: no
    record, and no advice to replay it."""
    init = torch.amp.GradScaler.__init__
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "init_scale": 2.0 ** 100,
                                                               "growth_interval": 10 ** 6}))
    assert train.main(tiny_args(tmp_path, "--amp", "fp16", epochs=1)) == 0
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["progress"]["scaler_skips"] >= 1  # the scaler did skip steps
    assert not list((tmp_path / "checkpoints").glob("nonfinite-*.json"))
    assert "--replay" not in capsys.readouterr().err


@pytest.mark.parametrize("batch", [0, 1])
def test_a_record_that_starts_just_before_its_step_watches_that_step(
        tmp_path, capsys, monkeypatch, overflow, batch):
    """Round 5's promise 8: with --ckpt-every-steps 1 the record starts at the step just
    before the non-finite one (the first step's: from the run's start), and the replay
    watches that very step, naming the module that made the first non-finite value."""
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=0, batch=batch)
    mark_sample(monkeypatch, index, epoch=0)
    assert train.main(tiny_args(run_dir, *PER_SAMPLE, "--ckpt-every-steps", "1",
                                network="overflow_mlp")) == 1
    capsys.readouterr()
    record_path = run_dir / "checkpoints" / f"nonfinite-step-{batch + 1:08d}.json"
    record = json.loads(record_path.read_text())
    assert record["step"] == batch + 1
    assert train.main(["--replay", str(record_path)]) == 0
    out = capsys.readouterr().out
    assert "reproduced the non-finite loss" in out, out
    assert "first non-finite output: module '0' (Blowup)" in out, out
    assert f"samples: {index}\n" in out + "\n"


def test_a_gan_step_is_recorded_and_replayed_phase_by_phase(tmp_path, capsys, monkeypatch):
    """A task of several networks (--task gan): the record names the step, the replay the
    network's module, the phase (the discriminator's, which sees the real images first)
    and the sample."""
    run_dir = tmp_path / "run"
    index = bad_sample(epoch=1, batch=2, position=5)  # epoch 2's 3rd batch: step 7
    plain = data.SeededDataset.__getitem__

    def getitem(self, key):  # a real image holding inf: the data's fault, as replay says
        image, label = plain(self, key)
        return (torch.full_like(image, float("inf")) if key == (index, 1) else image), label

    monkeypatch.setattr(data.SeededDataset, "__getitem__", getitem)
    args = ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", "64", "--gan-width",
            "8", "--latent-dim", "16", "--fid-samples", "0", "--batch-size", "16", "--epochs",
            "2", "--num-workers", "0", "--log-every", "1", *PER_SAMPLE, "--run-dir",
            str(run_dir)]
    train.main(args)
    record_path = run_dir / "checkpoints" / "nonfinite-step-00000007.json"
    assert f"replay it with: python train.py --replay {record_path}" in capsys.readouterr().err
    record = json.loads(record_path.read_text())
    assert record["step"] == 7 and index in record["micro_batches"][0]["samples"]
    assert train.main(["--replay", str(record_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"first non-finite output: module 'discriminator\.[\w.]+' \(Conv2d\) in "
                     r"the forward pass of micro-batch 1 of 1 \(the discriminator's phase\); "
                     r"its inputs were already not finite \(the data\?\)", out), out
    assert f"samples: {index}\n" in out + "\n"
