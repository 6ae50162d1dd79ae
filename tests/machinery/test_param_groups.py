"""The optimizer's parameter groups (machinery/param_groups.py), on the optimizer's real
param_groups as ops.build_optimizer makes them: a norm weight gets no decay, a bias its
own, a no_weight_decay() name none, a first block's learning rate is F^depth of the
head's, the default keeps the one group of old, a resume whose groups differ is refused."""

import pytest
import timm
import torch

import networks
import ops
from config import with_defaults
from machinery import engine, param_groups
from ops import UserError

DEVICE = torch.device("cpu")


def config(**flags):
    return with_defaults({"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.05,
                          "network": "timm/test_vit", **flags})


def vit():
    return networks.build_network("timm/test_vit", num_classes=5, in_channels=3,
                                  image_size=32)


def built(net, **flags):
    c = config(**flags)
    return ops.build_optimizer(net, c, DEVICE, groups=param_groups.split), c


def group_of(optimizer, param):
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


def test_the_default_keeps_the_one_group_of_old_bit_for_bit():
    torch.manual_seed(0)
    net = networks.build_network("simple_cnn")
    c = config(network="simple_cnn", norm_weight_decay=0.05)  # equal to --weight-decay
    old = ops.build_optimizer(net, c, DEVICE)
    new = ops.build_optimizer(net, c, DEVICE, groups=param_groups.split)
    assert len(new.param_groups) == 1
    assert old.state_dict()["param_groups"] == new.state_dict()["param_groups"]
    assert set(new.param_groups[0]) == set(old.param_groups[0])  # no key of ours


def test_a_norm_weight_gets_its_own_decay_and_a_bias_its_own():
    net = networks.build_network("simple_cnn")
    optimizer, _ = built(net, network="simple_cnn", norm_weight_decay=0.0,
                         bias_weight_decay=0.01)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert norms and convs
    assert group_of(optimizer, norms[0].weight)["weight_decay"] == 0.0
    assert group_of(optimizer, convs[0].weight)["weight_decay"] == 0.05
    assert group_of(optimizer, norms[0].bias)["weight_decay"] == 0.01  # a bias first
    assert sum(len(g["params"]) for g in optimizer.param_groups) == \
        len(list(net.parameters()))  # every parameter once


def test_a_timm_norm_layer_by_its_name():
    class RmsNorm2d(torch.nn.Module):  # (timm's norms not derived from torch's)
        pass

    assert param_groups.is_norm(RmsNorm2d())
    assert param_groups.is_norm(torch.nn.LayerNorm(3))
    assert not param_groups.is_norm(torch.nn.Linear(2, 2))
    assert not param_groups.is_norm(vit())  # (VisionTransformer: no "Norm" at its end)


def test_no_weight_decay_names_get_none_by_default():
    net = vit()
    optimizer, _ = built(net)
    assert group_of(optimizer, net.pos_embed)["weight_decay"] == 0.0
    assert group_of(optimizer, net.cls_token)["weight_decay"] == 0.0
    assert group_of(optimizer, net.blocks[0].attn.qkv.weight)["weight_decay"] == 0.05
    assert group_of(optimizer, net.blocks[0].norm1.weight)["weight_decay"] == 0.05


def test_a_first_blocks_learning_rate_is_f_to_the_depth_of_the_heads():
    net, f = vit(), 0.7
    optimizer, c = built(net, layer_decay=f)
    ids, last = param_groups.layer_ids(net)
    depth = last - ids["blocks.0.attn.qkv.weight"]
    assert depth == len(net.blocks)  # stem 0, blocks 1..6 (the last with the norm), head 7
    engine.set_lr(optimizer, 0.5)  # the schedule's factor reaches every group
    head = group_of(optimizer, net.head.weight)
    first = group_of(optimizer, net.blocks[0].attn.qkv.weight)
    assert head["lr"] == pytest.approx(c["lr"] * 0.5)
    assert first["lr"] == pytest.approx(head["lr"] * f ** depth)
    assert group_of(optimizer, net.patch_embed.proj.weight)["lr"] == \
        pytest.approx(head["lr"] * f ** last)  # the stem, deepest


def test_layer_decay_agrees_with_timms_own_groups():
    net, f = vit(), 0.75
    optimizer, c = built(net, layer_decay=f, norm_weight_decay=0.0, bias_weight_decay=0.0)
    from timm.optim import param_groups_layer_decay

    theirs = param_groups_layer_decay(net, weight_decay=0.05, layer_decay=f,
                                      no_weight_decay_list=net.no_weight_decay())
    for group in theirs:  # (timm: no decay for every 1-d tensor: norms and biases here)
        for p in group["params"]:
            ours = group_of(optimizer, p)
            assert ours["lr_scale"] == pytest.approx(group["lr_scale"])
            assert ours["weight_decay"] == group["weight_decay"]


def test_a_network_without_group_matcher_refuses_layer_decay():
    with pytest.raises(UserError, match="group_matcher.*simple_cnn"):
        built(networks.build_network("simple_cnn"), network="simple_cnn", layer_decay=0.8)


def test_unfrozen_parameters_join_in_groups_of_their_own():
    net = vit()
    ops.freeze(net, ["blocks.*"])
    optimizer, c = built(net, layer_decay=0.5, unfreeze_lr_scale=0.1)
    assert all(not g["unfrozen"] for g in optimizer.param_groups)
    names = ops.unfreeze(net, ["blocks.*"])
    param_groups.add_unfrozen(optimizer, net, names, c)
    ops.set_hyperparameters(optimizer, c)
    block = group_of(optimizer, net.blocks[1].mlp.fc1.weight)
    assert block["unfrozen"]
    depth = param_groups.layer_ids(net)[1] - 2
    assert block["base_lr"] == pytest.approx(c["lr"] * 0.1 * 0.5 ** depth)
    assert group_of(optimizer, net.head.weight)["base_lr"] == c["lr"]


def test_resume_with_other_groups_is_refused_and_the_same_is_not():
    net = vit()
    optimizer, _ = built(net, layer_decay=0.7)
    saved = optimizer.state_dict()
    same, _ = built(vit(), layer_decay=0.7)
    param_groups.check_resume(saved, same, "last.pt")
    other, _ = built(vit(), layer_decay=0.8)
    with pytest.raises(UserError, match="parameter groups differ from 'last.pt'") as e:
        param_groups.check_resume(saved, other, "last.pt")
    assert "\n" not in str(e.value)
    fewer, _ = built(vit())  # no layer decay: fewer groups
    with pytest.raises(UserError, match="parameter groups differ"):
        param_groups.check_resume(saved, fewer, "last.pt")


def test_the_groups_survive_a_resume_through_the_optimizers_state():
    net = vit()
    optimizer, c = built(net, layer_decay=0.7, norm_weight_decay=0.0)
    again, _ = built(vit(), layer_decay=0.7, norm_weight_decay=0.0)
    again.load_state_dict(optimizer.state_dict())
    ops.set_hyperparameters(again, c)
    assert [(g["base_lr"], g["weight_decay"]) for g in again.param_groups] == \
        [(g["base_lr"], g["weight_decay"]) for g in optimizer.param_groups]


def test_describe_counts_the_groups_parameters_scale_and_decay():
    net = vit()
    optimizer, _ = built(net, layer_decay=0.5, norm_weight_decay=0.0)
    line = param_groups.describe(optimizer, config())
    assert line.startswith(f"param groups: {len(optimizer.param_groups)} (")
    head = f"{net.head.weight.numel() + net.head.bias.numel():,} parameters, lr x1, decay 0.05"
    assert head in line
    assert "lr x0.5, decay 0" in line  # the last norm: one layer down, no decay
    assert "\n" not in line


def test_timm_reports_its_layers_as_we_count_them():
    net = vit()
    ids, last = param_groups.layer_ids(net)
    assert ids["patch_embed.proj.weight"] == 0 and ids["head.weight"] == last
    assert ids["blocks.1.mlp.fc1.weight"] == 2
    assert isinstance(net, timm.models.VisionTransformer)
