"""``test.py --export FILE.safetensors``: a network's weights and what evaluating them
needs, in one safetensors file, read back without running any code.

The tensors are the network's ``state_dict`` (safetensors' ``save_model``: a tensor
shared by two names is stored once); the header's metadata (strings) holds export.py's
``export_metadata`` (``training_config``: network, dataset, image size, channels,
classes count, crop_pct, pretrained; ``classes``; ``normalize``; ``preprocess``...) and,
for a timm network, its data configuration (``data_config``: input size, mean, std,
interpolation, crop_pct). ``load`` rebuilds the network by name from that
(``networks.build_network``) and fills it with safetensors' ``load_model``: the file is
read as tensors and JSON, never unpickled. ``test.py --model FILE.safetensors`` evaluates
it as any exported file (``export.open_exported``); ``--pretrained FILE.safetensors``
starts a run from its weights.
"""

import json

from networks import build_network
from ops import UserError

KIND = "weights and metadata (safetensors)"


def save(net, example, path, metadata):
    """Writes ``net``'s weights and ``metadata`` (a dict of strings) to ``path``.
    ``example`` (the export's traced input) is not needed: the file holds weights."""
    from safetensors.torch import save_model

    del example
    save_model(net, path, metadata={**metadata, "format": "weights"})


def read_metadata(path):
    """The metadata of a safetensors file (a dict of strings; empty where it has none).

    Raises:
        ops.UserError: the file is no safetensors file (one line).
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # a header that does not parse, a file cut short
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path!r} cannot be read as safetensors ({first[:200]})") from None


def rebuilt(metadata, path):
    """The network ``metadata``'s ``training_config`` names, built with random weights.

    Raises:
        ops.UserError: the metadata names no network or its sizes (a file of weights
            alone: export it with test.py --export), or a network this version cannot
            build.
    """
    try:
        stored = json.loads(metadata.get("training_config") or "null")
    except ValueError:
        stored = None
    needed = ("network", "num_classes", "in_channels", "image_size")
    if not isinstance(stored, dict) or any(k not in stored for k in needed):
        raise UserError(f"--model {path!r} holds weights without the network they fit "
                        f"(its metadata has no training_config with "
                        f"{', '.join(needed)}): write it with test.py --export")
    try:
        return build_network(stored["network"], int(stored["num_classes"]),
                             int(stored["in_channels"]), int(stored["image_size"]))
    except ValueError as e:
        raise UserError(f"--model {path!r}: {e}") from None


def load(path, extra_files=None):
    """The network of a file ``save`` wrote, in eval mode, its weights loaded (strictly:
    every tensor of the network, nothing else). ``extra_files``: a dict whose
    ``"metadata.json"`` is set to the file's metadata as JSON (as .pt2's and .ts's).

    Raises:
        ops.UserError: not a safetensors file; no network named; weights that do not fit.
    """
    from safetensors.torch import load_model

    metadata = read_metadata(path)
    net = rebuilt(metadata, path)
    try:
        missing, unexpected = load_model(net, path, strict=False)
    except Exception as e:  # a shape that differs
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--model {path!r}: its weights do not fit "
                        f"{json.loads(metadata['training_config'])['network']} "
                        f"({first[:200]})") from None
    if missing or unexpected:
        names = sorted(missing)[:3] + sorted(unexpected)[:3]
        raise UserError(f"--model {path!r}: {len(missing)} tensors missing and "
                        f"{len(unexpected)} unexpected for the network it names "
                        f"({', '.join(names)})")
    if extra_files is not None:
        extra_files["metadata.json"] = json.dumps(metadata)
    return net.eval()
