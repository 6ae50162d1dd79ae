"""Freezing and fine-tuning: --freeze, --unfreeze-at, --pretrained (issue 6, items 1-4)."""

import math
import os
import shutil
import urllib.request

import pytest
import torch
import torch.nn as nn
from helpers import assert_states_equal, final_state, tiny_args
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ops
import train
from networks import build_network
from pipeline import data, presets

SCALE = 0.2  # the --unfreeze-lr-scale used below (tiny_args' --lr is 0.05)


def cnn_args(run_dir, *extra, epochs=1, classes=10):
    """simple_cnn on 64 synthetic 16x16 images: 4 optimizer steps an epoch."""
    return tiny_args(run_dir, "--num-classes", str(classes), *extra, network="simple_cnn",
                     image=16, epochs=epochs)


def load(run_dir, name="last.pt"):
    return torch.load(os.path.join(run_dir, "checkpoints", name), weights_only=True)


def features(state_dict):
    """Every tensor of simple_cnn's ``features``: weights and BatchNorm buffers."""
    return {k: v for k, v in state_dict.items() if k.startswith("features.")}


def assert_all_differ(a, b):
    for key in a:
        assert not torch.equal(a[key], b[key]), f"{key} did not change"


def error_line(err):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """last.pt of a first simple_cnn run (another seed than the fine-tuning runs)."""
    run_dir = tmp_path_factory.mktemp("pretrain") / "run"
    assert train.main(cnn_args(run_dir, "--seed", "1")) == 0
    return os.path.join(run_dir, "checkpoints", "last.pt")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, pretrained):
    """One epoch from the pretrained weights with ``features.*`` frozen."""
    run_dir = tmp_path_factory.mktemp("finetune") / "run"
    assert train.main(cnn_args(run_dir, "--pretrained", pretrained,
                               "--freeze", "features.*")) == 0
    return run_dir


# ----------------------------------------------------------------------- ops

def test_freeze_and_unfreeze_return_what_they_changed():
    net = build_network("simple_cnn", 10, 3, 16)
    names = [n for n, _ in net.named_parameters()]
    first = [n for n in names if n.startswith(("features.0.", "fc."))]
    assert ops.freeze(net, ["features.0.*", "fc.*"]) == first
    assert [n for n, p in net.named_parameters() if not p.requires_grad] == first
    # Already frozen parameters are not reported again.
    rest = [n for n in names if n.startswith(("features.1.", "features.2."))]
    assert ops.freeze(net, ["features.*"]) == rest
    assert ops.unfreeze(net, ["fc.*"]) == ["fc.1.weight", "fc.1.bias"]
    assert ops.unfreeze(net, ["fc.*"]) == []
    assert ops.unfreeze(net) == [n for n in names if n.startswith("features.")]
    assert all(p.requires_grad for p in net.parameters())


def test_freeze_pattern_that_matches_nothing_names_the_top_level_modules():
    net = build_network("simple_cnn", 10, 3, 16)
    with pytest.raises(ops.UserError, match=r"'feature\.\*' matches no parameter.*fc, features"):
        ops.freeze(net, ["fc.*", "feature.*"])
    assert all(p.requires_grad for p in net.parameters())  # nothing half-frozen


def test_count_parameters_splits_trainable_and_frozen():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ops.freeze(net, ["0.*"])
    assert ops.count_parameters(net) == (4 * 2 + 2, 3 * 4 + 4)


def test_fully_frozen_batchnorm_stays_in_eval_mode_a_partly_trainable_one_trains():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    net[1].requires_grad_(False)          # fully frozen
    net[2].weight.requires_grad_(False)   # bias still trainable
    net.train()
    assert ops.keep_frozen_norms_eval(net) == 1
    assert not net[1].training and net[2].training and net[0].training
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net(torch.randn(4, 3, 6, 6))
    after = net.state_dict()
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(after[f"1.{key}"], before[f"1.{key}"]), key
        assert not torch.equal(after[f"2.{key}"], before[f"2.{key}"]), key


# ------------------------------------------------------------ --pretrained + --freeze

def test_frozen_weights_and_batchnorm_buffers_do_not_move(finetuned, pretrained):
    start = load(os.path.dirname(os.path.dirname(pretrained)))["model"]
    end = final_state(finetuned)["model"]
    assert len(features(start)) == 18  # 3 ConvBlocks: conv weight, BN weight, bias, 3 buffers
    assert_states_equal(features(end), features(start))
    assert_all_differ({k: end[k] for k in ("fc.1.weight", "fc.1.bias")}, start)


def test_optimizer_holds_only_the_trainable_parameters(finetuned):
    net = build_network("simple_cnn", 10, 3, 16)
    ops.freeze(net, ["features.*"])
    trainable, _ = ops.count_parameters(net)
    assert trainable == 10 * 128 * 2 * 2 + 10  # fc.1 alone
    opt = final_state(finetuned)["optimizer"]
    assert len(opt["param_groups"]) == 1
    ids = opt["param_groups"][0]["params"]
    assert len(ids) == 2  # fc.1.weight, fc.1.bias
    assert sum(opt["state"][i]["momentum_buffer"].numel() for i in ids) == trainable
    assert set(opt["state"]) == set(ids)


def test_summary_shows_trainable_and_frozen_counts(finetuned):
    net = build_network("simple_cnn", 10, 3, 16)
    ops.freeze(net, ["features.*"])
    trainable, frozen = ops.count_parameters(net)
    assert frozen == sum(p.numel() for p in net.features.parameters())
    text = (finetuned / "summary.txt").read_text()
    assert f"Trainable parameters: {trainable:,}\n" in text
    assert f"Frozen parameters: {frozen:,}\n" in text


def test_tensorboard_hparams_record_the_freeze_patterns(finetuned, pretrained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(finetuned))
    acc.Reload()
    contents = acc.PluginTagToContent("hparams").values()
    starts = [d.session_start_info for d in map(plugin_data_pb2.HParamsPluginData.FromString,
                                                contents) if d.HasField("session_start_info")]
    assert len(starts) == 1
    hparams = starts[0].hparams
    assert hparams["freeze"].string_value == "['features.*']"
    assert hparams["pretrained"].string_value == pretrained
    assert hparams["unfreeze_at"].number_value == 0


# ----------------------------------------------------------------- pattern errors

@pytest.mark.parametrize("extra, message", [
    (["--freeze", "feature.*"], "freeze pattern 'feature.*' matches no parameter; the "
                                "network's top-level modules are: fc, features"),
    (["--unfreeze-at", "2"], "--unfreeze-at needs --freeze"),
])
def test_freeze_flag_errors(tmp_path, train_main, capsys, extra, message):
    assert train_main(cnn_args(tmp_path / "run", *extra)) == 2
    assert message in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


# ---------------------------------------------------------------- pretrained files

def test_pretrained_with_another_head_size_keeps_the_new_head(tmp_path, train_main, capsys):
    assert train_main(cnn_args(tmp_path / "five", "--max-steps", "1", classes=5)) == 0
    five = tmp_path / "five" / "checkpoints" / "last.pt"
    capsys.readouterr()
    assert train_main(cnn_args(tmp_path / "ten", "--pretrained", str(five), "--freeze",
                               "features.*", "--max-steps", "1")) == 0
    out = capsys.readouterr().out
    assert "kept the new head (fc.1.weight, fc.1.bias): its size differs" in out
    end = final_state(tmp_path / "ten")["model"]
    assert_states_equal(features(end), features(torch.load(five, weights_only=True)["model"]))
    assert end["fc.1.weight"].shape == (10, 512)


def test_pretrained_from_another_network_lists_the_mismatched_keys(tmp_path, train_main,
                                                                  capsys):
    path = tmp_path / "mlp.pt"
    torch.save({"model": build_network("mlp", 10, 3, 16).state_dict()}, path)
    assert train_main(cnn_args(tmp_path / "run", "--pretrained", str(path))) == 2
    line = error_line(capsys.readouterr().err)
    assert f"'{path}' does not fit this network" in line
    assert "missing: fc.1.bias, fc.1.weight, features.0.block.0.weight, " in line
    assert "unexpected: fc.bias, fc.weight, hidden.0.bias, hidden.0.weight" in line
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


@pytest.fixture
def offline(monkeypatch):
    """Every way torch and torchvision fetch weights raises instead."""
    import torch.hub
    import torchvision.models._api

    def refuse(*args, **kwargs):
        raise AssertionError("attempted a download")

    for module, name in [(torch.hub, "load_state_dict_from_url"),
                         (torch.hub, "download_url_to_file"),
                         (torchvision.models._api, "load_state_dict_from_url"),
                         (urllib.request, "urlopen")]:
        monkeypatch.setattr(module, name, refuse)
    # The patches work: asking torchvision for its weights fails.
    with pytest.raises(AssertionError, match="attempted a download"):
        torchvision.models.get_model("resnet18", weights="DEFAULT")


def test_plain_torchvision_state_dict_fine_tunes_offline(tmp_path, train_main, offline):
    import torchvision

    torch.manual_seed(123)  # not the run's seed: loaded weights differ from a fresh init
    weights = torchvision.models.resnet18(num_classes=10).state_dict()
    path = tmp_path / "resnet18.pt"
    torch.save(weights, path)

    net = build_network("torchvision/resnet18", 10, 3, 32)
    assert presets.load_pretrained(net, str(path), print) == []
    assert_states_equal(net.state_dict(), weights)

    argv = tiny_args(tmp_path / "run", "--pretrained", str(path), "--freeze", "layer1.*",
                     "--max-steps", "1", network="torchvision/resnet18", size=16, image=32,
                     batch=8)
    assert train_main(argv) == 0
    end = final_state(tmp_path / "run")["model"]
    layer1 = {k: v for k, v in weights.items() if k.startswith("layer1.")}
    assert len(layer1) == 24  # 2 blocks of 2 convs and 2 BatchNorms (5 tensors each)
    assert_states_equal({k: end[k] for k in layer1}, layer1)
    assert_all_differ({k: end[k] for k in ("fc.weight", "fc.bias", "conv1.weight")}, weights)


def test_state_dict_with_a_1000_class_head_into_10_classes(tmp_path, offline):
    import torchvision

    weights = torchvision.models.resnet18(num_classes=1000).state_dict()
    path = tmp_path / "imagenet.pt"
    torch.save(weights, path)
    net = build_network("torchvision/resnet18", 10, 3, 32)
    fresh = {k: v.clone() for k, v in net.state_dict().items()}
    messages = []
    assert presets.load_pretrained(net, str(path), messages.append) == ["fc.weight", "fc.bias"]
    assert "kept the new head (fc.weight, fc.bias): its size differs" in messages[0]
    loaded = net.state_dict()
    assert_states_equal({k: loaded[k] for k in ("fc.weight", "fc.bias")},
                        {k: fresh[k] for k in ("fc.weight", "fc.bias")})
    assert_states_equal({k: v for k, v in loaded.items() if not k.startswith("fc.")},
                        {k: v for k, v in weights.items() if not k.startswith("fc.")})


# ------------------------------------------------------------------- --unfreeze-at

UNFREEZE = ("--freeze", "features.*", "--unfreeze-at", "2", "--unfreeze-lr-scale", str(SCALE))


@pytest.fixture(scope="module")
def unfreeze_recorded(tmp_path_factory, pretrained):
    """3 epochs (12 steps, cosine) unfreezing ``features`` at epoch 2, every step saved.

    Returns the run directory and, for each optimizer step, the ``(lr, base_lr)`` of each
    param group as the step ran.
    """
    run_dir = tmp_path_factory.mktemp("unfreeze") / "run"
    used = []

    def record(optimizer, args, kwargs):
        used.append([(g["lr"], g["base_lr"]) for g in optimizer.param_groups])

    handle = register_optimizer_step_pre_hook(record)
    try:
        assert train.main(cnn_args(run_dir, "--pretrained", pretrained, *UNFREEZE,
                                   "--ckpt-every-steps", "1", "--keep-last", "50",
                                   epochs=3)) == 0
    finally:
        handle.remove()
    return run_dir, used


@pytest.fixture(scope="module")
def unfreeze_run(unfreeze_recorded):
    return unfreeze_recorded[0]


def test_unfreeze_at_epoch_2(unfreeze_run, pretrained):
    start = features(torch.load(pretrained, weights_only=True)["model"])
    after_1, after_2 = load(unfreeze_run, "epoch-0001.pt"), load(unfreeze_run, "epoch-0002.pt")
    assert_states_equal(features(after_1["model"]), start)
    assert_all_differ(features(after_2["model"]), start)
    assert_all_differ(features(final_state(unfreeze_run)["model"]), features(after_2["model"]))
    assert len(after_1["optimizer"]["param_groups"]) == 1


# The run's cosine over 12 steps, no warmup: after step k the rate is
# base * (1 + cos(pi * k / 12)) / 2, worked out by hand here.
COSINE_12 = {4: 0.75, 6: 0.5, 8: 0.25, 12: 0.0}


def test_every_step_ran_at_the_hand_computed_rates(unfreeze_recorded):
    # Step k (1..12) runs at the rate set after step k - 1: 0.05 (--lr) for fc.1 and
    # 0.05 * 0.2 (--unfreeze-lr-scale) for features, both times (1 + cos(pi (k-1) / 12)) / 2.
    _, used = unfreeze_recorded
    assert len(used) == 12
    for k, groups in enumerate(used, start=1):
        factor = (1 + math.cos(math.pi * (k - 1) / 12)) / 2
        expected = [(0.05 * factor, 0.05)] + ([(0.01 * factor, 0.01)] if k > 4 else [])
        assert len(groups) == len(expected), k
        for (lr, base), (want_lr, want_base) in zip(groups, expected):
            assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15), (k, groups)
            assert base == pytest.approx(want_base, rel=1e-12), (k, groups)
    # the unfrozen group's first step (5) ran at 0.01 * 0.75, not at its base rate
    assert used[4][1][0] == pytest.approx(0.0075)


@pytest.mark.parametrize("name, step", [("epoch-0001.pt", 4), ("step-00000006.pt", 6),
                                        ("epoch-0002.pt", 8), ("last.pt", 12)])
def test_unfrozen_group_lr_is_scaled_and_follows_the_schedule(unfreeze_run, name, step):
    state = load(unfreeze_run, name)
    assert state["step"] == step
    factor = COSINE_12[step]
    groups = state["optimizer"]["param_groups"]
    assert groups[0]["base_lr"] == pytest.approx(0.05)
    assert groups[0]["lr"] == pytest.approx(0.05 * factor, abs=1e-12)
    if step == 4:  # epoch 1: features still frozen, one group
        assert len(groups) == 1 and len(groups[0]["params"]) == 2
        return
    main, unfrozen = groups
    assert len(main["params"]) == 2 and len(unfrozen["params"]) == 9  # fc.1; features
    assert unfrozen["base_lr"] == pytest.approx(0.01)  # 0.05 * --unfreeze-lr-scale 0.2
    assert unfrozen["lr"] == pytest.approx(0.01 * factor, abs=1e-12)


@pytest.mark.parametrize("name", ["epoch-0001.pt", "step-00000006.pt"])
def test_resume_across_the_unfreeze_point_is_exact(unfreeze_run, tmp_path, train_main, name):
    """From the end of epoch 1 (before the unfreeze) and from inside epoch 2 (after it)."""
    source = os.path.join(unfreeze_run, "checkpoints", name)
    assert train_main(["--resume", source, "--run-dir", str(tmp_path / "run")]) == 0
    resumed, whole = final_state(tmp_path / "run"), final_state(unfreeze_run)
    assert (resumed["epoch"], resumed["step"]) == (whole["epoch"], whole["step"]) == (3, 12)
    assert_states_equal(resumed["model"], whole["model"])
    assert_states_equal(resumed["optimizer"], whole["optimizer"])


# Stopping a run with a smaller --epochs or with --max-steps also shortens its LR schedule
# (the schedule spans the run), so these stop-and-resume runs use a constant schedule.
CONSTANT = (*UNFREEZE, "--scheduler", "none")


@pytest.fixture(scope="module")
def constant_run(tmp_path_factory, pretrained):
    run_dir = tmp_path_factory.mktemp("constant") / "run"
    assert train.main(cnn_args(run_dir, "--pretrained", pretrained, *CONSTANT, epochs=3)) == 0
    return final_state(run_dir)


@pytest.mark.parametrize("stop, resume", [
    (["--epochs", "1"], ["--epochs", "3"]),           # stopped after epoch 1
    (["--max-steps", "6"], ["--max-steps", "0"]),     # stopped inside epoch 2
])
def test_stopped_and_resumed_run_matches_the_uninterrupted_one(
        constant_run, pretrained, tmp_path, train_main, stop, resume):
    run_dir = tmp_path / "run"
    assert train_main(cnn_args(run_dir, "--pretrained", pretrained, *CONSTANT, *stop,
                               epochs=3)) == 0
    assert train_main(["--resume", "auto", "--run-dir", str(run_dir), *resume]) == 0
    resumed = final_state(run_dir)
    assert (resumed["epoch"], resumed["step"]) == (3, 12)
    assert_states_equal(resumed["model"], constant_run["model"])
    assert_states_equal(resumed["optimizer"], constant_run["optimizer"])



def test_a_checkpoint_taken_after_the_epochs_last_step_resumes_with_no_batch_left():
    """E.g. a stop-save at the epoch's last step, killed while validating."""
    sampler = data.EpochBatchSampler(64, 16, seed=0)
    sampler.set_epoch(0, 64)
    assert (len(sampler), sampler.plan(), list(sampler)) == (0, [], [])
    sampler.set_epoch(0, 48)
    assert sampler.plan() == [(16, 16)]


def test_resume_does_not_need_the_pretrained_file(pretrained, tmp_path, train_main):
    """The weights come from the checkpoint; the pretrained file may be gone."""
    weights = tmp_path / "weights.pt"
    shutil.copy(pretrained, weights)
    run_dir = tmp_path / "run"
    assert train_main(cnn_args(run_dir, "--pretrained", str(weights), "--freeze", "features.*",
                               "--max-steps", "2")) == 0
    os.remove(weights)
    assert train_main(["--resume", "auto", "--run-dir", str(run_dir), "--max-steps", "0"]) == 0
    end = final_state(run_dir)
    assert (end["epoch"], end["step"]) == (1, 4)
    assert_states_equal(features(end["model"]),
                        features(torch.load(pretrained, weights_only=True)["model"]))
