"""The optimizer's parameter groups, for every network: weight decay by kind of parameter
and timm's layer-wise learning-rate decay, with the reference scripts' flag names.

* ``--norm-weight-decay X``: the parameters of normalisation layers (BatchNorm, LayerNorm,
  GroupNorm, InstanceNorm, RMSNorm and timm's norms) decay by X;
* ``--bias-weight-decay X``: every ``bias`` (a norm's too, as torchvision's
  ``set_weight_decay`` checks its custom keys first) decays by X;
* a model's ``no_weight_decay()`` names (timm's: a ViT's ``pos_embed``, ``cls_token``)
  get none, whatever the flags;
* ``--layer-decay F``: each parameter's learning rate is ``F ** (last - layer)`` of the
  head's, its layer from the model's own ``group_matcher`` (timm's ``group_parameters``,
  as timm's ``param_groups_layer_decay``: what no rule matches is the head's).

Without any of them (the default: both decays equal ``--weight-decay``, no layer decay, a
network without ``no_weight_decay``) the optimizer keeps the one group it always had, so
every recipe trains as before, bit for bit. A split group carries ``group`` (its name),
``decay`` (the config key of its weight decay, or ``"none"``), ``lr_scale`` and
``unfrozen``: ``ops.set_hyperparameters`` reads them at the build and after every resume,
and the checkpoint keeps them with the optimizer's state (``check_resume`` compares them:
a resume whose groups differ is one line).
"""

import re

import torch

import ops
from ops import UserError

NORMS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm,
         torch.nn.LocalResponseNorm, torch.nn.RMSNorm)
_NORM_NAME = re.compile(r"Norm(Act)?([123]d)?$")  # timm's RmsNorm, LayerNorm2d, ...


def is_norm(module):
    """Whether ``module`` is a normalisation layer (torch's, or named like timm's)."""
    return isinstance(module, NORMS) or bool(_NORM_NAME.search(type(module).__name__))


def no_weight_decay(net):
    """The parameter names ``net.no_weight_decay()`` names (timm's models), or none."""
    names = net.no_weight_decay() if hasattr(net, "no_weight_decay") else ()
    return set(names or ())


def layer_ids(net, network="this network"):
    """``({parameter name: layer}, last layer)`` from ``net.group_matcher`` (timm's
    fine-grained groups: stem 0, each block its own, the head the last).

    Raises:
        ops.UserError: ``net`` has no ``group_matcher`` (one line).
    """
    if not hasattr(net, "group_matcher"):
        raise UserError(f"--layer-decay needs a network that names its blocks "
                        f"(group_matcher, as timm's models do): {network} has none; use "
                        f"--network timm/<name> or drop --layer-decay")
    from timm.models import group_parameters

    ids = group_parameters(net, net.group_matcher(coarse=False), reverse=True)
    return ids, max(ids.values(), default=0)  # (a name no rule matched: the last's)


def kind_of(name, module, skip, config):
    """The config key whose weight decay the parameter ``name`` of ``module`` takes, or
    ``"none"`` (a ``no_weight_decay`` name)."""
    if name in skip:
        return "none"
    if name.rsplit(".", 1)[-1] == "bias" and config.get("bias_weight_decay") is not None:
        return "bias_weight_decay"
    if is_norm(module) and config.get("norm_weight_decay") is not None:
        return "norm_weight_decay"
    return "weight_decay"


def split_wanted(net, config):
    """Whether ``net``'s parameters are split into groups (else the one group of old)."""
    wd = config["weight_decay"]
    return (config.get("layer_decay") is not None
            or config.get("norm_weight_decay") not in (None, wd)
            or config.get("bias_weight_decay") not in (None, wd)
            or bool(no_weight_decay(net) & {n for n, _ in net.named_parameters()}))


def split(net, params, config, unfrozen=False):
    """The param groups of ``params`` (parameters of ``net``, in its order).

    Args:
        net: the network (plain, not wrapped).
        params: the parameters to put in groups (the trainable ones, or those
            --unfreeze-at adds).
        config: the run's config (``weight_decay``, ``norm_weight_decay``,
            ``bias_weight_decay``, ``layer_decay``, ``network``).
        unfrozen: the groups are --unfreeze-at's (their rate scaled by --unfreeze-lr-scale).

    Returns:
        A list of group dicts for ``torch.optim``: ``[{"params": params}]`` where nothing
        asks for a split, else one group per (layer, kind) in order of appearance.
    """
    if not split_wanted(net, config):
        return [{"params": list(params)}]
    wanted = {id(p) for p in params}
    skip = no_weight_decay(net)
    decay = config.get("layer_decay")
    ids, last = layer_ids(net, config.get("network")) if decay is not None else ({}, 0)
    groups = {}
    for module_name, module in net.named_modules():
        for short, p in module.named_parameters(recurse=False):
            if id(p) not in wanted:
                continue
            name = f"{module_name}.{short}" if module_name else short
            kind = kind_of(name, module, skip, config)
            layer = ids.get(name, last) if decay is not None else None
            key = (layer, kind)
            if key not in groups:
                groups[key] = {"params": [], "group": group_name(layer, kind),
                               "decay": kind, "unfrozen": unfrozen,
                               "lr_scale": decay ** (last - layer) if decay is not None
                               else 1.0}
            groups[key]["params"].append(p)
    return list(groups.values())


def group_name(layer, kind):
    """A group's name: ``layer 3/norm_weight_decay`` (``kind`` alone without layers)."""
    return kind if layer is None else f"layer {layer}/{kind}"


def add_unfrozen(optimizer, net, names, config):
    """--unfreeze-at: the parameters ``names`` of ``net`` join ``optimizer`` in groups of
    their own (split as the first ones were)."""
    params = dict(net.named_parameters())
    for group in split(net, [params[n] for n in names], config, unfrozen=True):
        optimizer.add_param_group(group)


def signature(groups):
    """What a resume compares of a list of param groups (an optimizer's, or the saved
    ``state_dict()["param_groups"]``): name, size, decay kind and lr scale of each."""
    return [(g.get("group"), len(g["params"]), g.get("decay", "weight_decay"),
             g.get("lr_scale", 1.0)) for g in groups]


def check_resume(saved, optimizer, path):
    """Refuses a resume whose parameter groups differ from the checkpoint's.

    Args:
        saved: the checkpoint's optimizer state (by name for several networks).
        optimizer: the freshly built optimizer (an ``ops.Optimizers`` for several).
        path: the checkpoint, for the message.

    Raises:
        ops.UserError: one line naming the first group that differs.
    """
    named = optimizer.named.items() if hasattr(optimizer, "named") else [(None, optimizer)]
    for name, one in named:
        state = saved.get(name) if name is not None else saved
        if not isinstance(state, dict) or "param_groups" not in state:
            continue  # (the optimizer's own check says what is missing)
        was, now = signature(state["param_groups"]), signature(one.param_groups)
        if was != now:
            diff = next((i for i, (a, b) in enumerate(zip(was, now)) if a != b),
                        min(len(was), len(now)))
            a = describe_one(*was[diff]) if diff < len(was) else "none"
            b = describe_one(*now[diff]) if diff < len(now) else "none"
            raise UserError(f"the parameter groups differ from {path!r}'s ({len(was)} "
                            f"there, {len(now)} now; group {diff + 1}: {a} there, {b} now): "
                            f"resume with the checkpoint's --weight-decay, "
                            f"--norm-weight-decay, --bias-weight-decay and --layer-decay")


def describe_one(name, count, decay, lr_scale):
    return f"{name or 'all'} ({count} tensors, {decay}, lr x{lr_scale:.4g})"


def describe(optimizer, config):
    """One line of the optimizer's groups: their count, and each one's parameters, lr
    scale and weight decay (``--preflight`` prints it)."""
    optimizers = optimizer.named.items() if hasattr(optimizer, "named") \
        else [(None, optimizer)]
    parts, count = [], 0
    for name, one in optimizers:
        for group in one.param_groups:
            count += 1
            n = sum(p.numel() for p in group["params"])
            parts.append(f"{(name + ' ') if name else ''}{group.get('group', 'all')}: "
                         f"{n:,} parameters, lr x{group.get('lr_scale', 1.0):.4g}, "
                         f"decay {group['weight_decay']:g}")
    return f"param groups: {count} ({'; '.join(parts)})"


def unfreeze_into(net, optimizer, config):
    """--unfreeze-at: unfreezes the frozen parameters and adds them to the optimizer, split
    into groups as the first ones were (``add_unfrozen``); returns their names."""
    names = ops.unfreeze(net, config["freeze"])
    add_unfrozen(optimizer, net, names, config)  # split as the first ones
    ops.set_hyperparameters(optimizer, config)
    return names
