"""timm's side of ``--network timm/<name>``: the model's data configuration and its
pretrained weights, read from files without running any code.

* ``data_config``: timm's ``resolve_data_config`` of the model's pretrained configuration
  (the tag ``--pretrained timm:<tag>`` names, else the default): input size, mean and
  std, interpolation, crop_pct. ``presets.preset`` takes its normalisation and
  interpolation for photos on both data paths; ``apply_data_config`` its image size and
  crop fraction where the user set none (a flag the user set wins, said once).
* ``pretrained_state``: ``--pretrained timm[:TAG]`` reads ``model.safetensors`` from the
  local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``; the hub's layout: ``models--timm--<name>.<tag>/snapshots/
  <rev>/model.safetensors`` with ``refs/main``), downloads it there only where
  ``HF_HUB_OFFLINE`` is not set, and offline with nothing cached says in one line which
  repository and file to place where. ``--pretrained FILE.safetensors`` (or ``.pth``, read
  by ``torch.load(weights_only=True)``) is a state_dict. The model's own
  ``checkpoint_filter_fn`` (a ViT's position embedding at another size) and timm's
  ``adapt_input_conv`` (another number of input channels) fit it to the network.
"""

import os
import sys

import torch

from networks import timm_architecture
from ops import UserError

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


def is_timm(network):
    """Whether ``--network`` names a timm model."""
    return str(network).startswith("timm/")


def is_request(pretrained):
    """Whether ``--pretrained`` asks for timm's weights (``timm``, ``timm:TAG``; a file of
    that name that exists wins: it is a path)."""
    return pretrained is not None and (pretrained == "timm" or str(pretrained).startswith(
        "timm:")) and not os.path.exists(pretrained)


def pretrained_cfg(network, pretrained=None):
    """timm's pretrained configuration of ``--network timm/<name>[.<tag>]``: the tag
    ``--pretrained timm:<tag>`` names, else the one in the name, else the default.

    Raises:
        ops.UserError: not a timm network; timm has no such model or tag.
    """
    import timm

    if not is_timm(network):
        raise UserError(f"--pretrained {pretrained} takes timm's weights: it needs "
                        f"--network timm/<name>, not {network}")
    name = network.split("/", 1)[1]
    try:
        architecture = timm_architecture(name)
    except ValueError as e:
        raise UserError(f"--network {network}: {e}") from None
    tag = name.split(".", 1)[1] if "." in name else None
    if pretrained and str(pretrained).startswith("timm:"):
        tag = pretrained.split(":", 1)[1]
    try:
        cfg = timm.models.get_pretrained_cfg(f"{architecture}.{tag}" if tag else architecture)
    except RuntimeError:
        cfg = None
    if cfg is None:
        tags = [t.split(".", 1)[1] for t in timm.list_pretrained(architecture + ".*")]
        raise UserError(f"timm has no pretrained weights {architecture}.{tag}; its tags: "
                        f"{', '.join(tags) or 'none'}")
    return cfg


def data_config(config):
    """timm's data configuration of the run's network (``resolve_data_config`` of its
    pretrained configuration): ``input_size``, ``interpolation``, ``mean``, ``std``,
    ``crop_pct``."""
    import timm.data

    pretrained = config.get("pretrained")
    if not is_request(pretrained) and not _has_pretrained_cfg(config["network"]):
        return timm.data.resolve_data_config({})  # (timm's defaults: ImageNet's, 224)
    cfg = pretrained_cfg(config["network"], pretrained if is_request(pretrained) else None)
    return timm.data.resolve_data_config(pretrained_cfg=cfg.to_dict())


def _has_pretrained_cfg(network):
    """Whether timm has a pretrained configuration for ``network`` (an architecture
    registered without any has none: timm's defaults then)."""
    try:
        pretrained_cfg(network)
    except UserError:
        return False
    return True


def preset(config):
    """``presets.preset``'s answer for a timm network: its mean, std and interpolation
    (the crop and resize: the run's ``--image-size`` and ``--crop-pct``, set from the
    data configuration by ``apply_data_config``)."""
    from torchvision.transforms import v2

    dc = data_config(config)
    interpolation = dc["interpolation"] if dc["interpolation"] in INTERPOLATIONS \
        else "bicubic"  # (timm's "random" is a training choice; bicubic as its eval)
    return {"mean": tuple(dc["mean"]), "std": tuple(dc["std"]),
            "interpolation": v2.InterpolationMode(interpolation), "crop": None,
            "resize": None}


def apply_data_config(config, explicit, warn):
    """A timm network on photos: ``--image-size`` and ``--crop-pct`` from its data
    configuration where the user set neither; where the user set one that differs, the
    user's wins and ``warn`` says so once.

    Args:
        config: the parsed config (changed in place and returned).
        explicit: the flags the user gave.
        warn: prints one line.
    """
    if not is_timm(config["network"]) or config["dataset"] != "imagefolder":
        return config
    dc = data_config(config)
    size, crop_pct = dc["input_size"][-1], dc["crop_pct"]
    for key, value in (("image_size", size), ("crop_pct", crop_pct)):
        if key not in explicit:
            config[key] = value
        elif config[key] != value:
            warn(f"--{key.replace('_', '-')} {config[key]} (yours) over {config['network']}'s "
                 f"own {value} (its data configuration)")
    return config


def hub_cache():
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (read now, not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "hub")


def offline():
    """Whether ``HF_HUB_OFFLINE`` forbids the hub (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def cached_file(repo, filename="model.safetensors"):
    """The hub file ``repo``/``filename`` in the local cache (``refs/main``'s snapshot),
    downloaded there where the hub may be reached; None where it is not to be had."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache()
    path = try_to_load_from_cache(repo, filename, cache_dir=cache)
    if isinstance(path, str) and os.path.isfile(path):
        return path
    if offline():
        return None
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, filename, cache_dir=cache)
    except Exception:  # (no network, no such repository: the caller's one line)
        return None


def read_weights(path):
    """A state_dict from a ``.safetensors`` file (safetensors: no code) or a ``.pth``
    (``torch.load(weights_only=True)``).

    Raises:
        ops.UserError: the file does not read (one line naming it).
    """
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged header, a pickle that is not weights, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--pretrained {path!r} does not read as weights ({first[:200]})") \
            from None
    return state


def pretrained_state(network, pretrained):
    """The state_dict ``--pretrained`` names (``timm[:TAG]``: the hub cache's
    ``model.safetensors`` of the timm network; a ``.safetensors`` file), and what to call
    it in the log (``fit`` fits it to the network after).

    Raises:
        ops.UserError: offline with nothing cached: the repository, the file to place and
            where; weights that do not read.
    """
    if is_request(pretrained):
        cfg = pretrained_cfg(network, pretrained)
        repo = cfg.hf_hub_id
        if not repo:
            raise UserError(f"timm's weights {cfg.architecture}.{cfg.tag} are not on the "
                            f"Hugging Face hub ({cfg.url or 'no address'}): download them "
                            f"and pass --pretrained FILE")
        filename = cfg.hf_hub_filename or "model.safetensors"
        path = cached_file(repo, filename)
        if path is None:
            folder = os.path.join(hub_cache(), f"models--{repo.replace('/', '--')}")
            where = os.path.join(folder, "snapshots", "<revision>", filename)
            raise UserError(f"--pretrained {pretrained}: {repo}/{filename} is not in the "
                            f"Hugging Face cache and cannot be downloaded"
                            f"{' (HF_HUB_OFFLINE)' if offline() else ''}: place {filename} "
                            f"from https://huggingface.co/{repo} at {where} (and the "
                            f"revision's name in {os.path.join(folder, 'refs', 'main')}), "
                            f"or pass --pretrained FILE")
        label = f"timm's {cfg.architecture}.{cfg.tag} ({path})"
    else:
        path, label = pretrained, pretrained
    return read_weights(path), label


def fit(state, net):
    """timm's own fitting of a state_dict to ``net``: the model module's
    ``checkpoint_filter_fn`` (names of older releases, a position embedding resampled to
    the image size), and the first convolution adapted to another number of input
    channels (``adapt_input_conv``)."""
    from timm.models import adapt_input_conv

    state = dict(state)
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # (timm's own training checkpoints)
    module = sys.modules.get(type(net).__module__)
    filter_fn = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is not None and all(isinstance(v, torch.Tensor) for v in state.values()):
        try:
            state = filter_fn(state, net)
        except Exception:  # (a filter of another form: the names are checked after)
            pass
    first = getattr(net, "pretrained_cfg", {}).get("first_conv")
    for name in [first] if isinstance(first, str) else list(first or ()):
        key, own = f"{name}.weight", net.state_dict().get(f"{name}.weight")
        if own is not None and key in state and state[key].ndim == 4 \
                and state[key].shape[1] != own.shape[1]:
            state[key] = adapt_input_conv(own.shape[1], state[key])
    return state
