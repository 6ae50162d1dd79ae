"""Evaluate a trained checkpoint, and export it for inference.

    python test.py --checkpoint runs/exp1/checkpoints/best.pt
    python test.py --checkpoint runs/exp1/checkpoints/last.pt --json results.json
    python test.py --checkpoint best.pt --export model.pt2    # torch.export (recommended)
    python test.py --checkpoint best.pt --export model.ts     # frozen TorchScript (deprecated)
    python test.py --checkpoint best.pt --export model.onnx   # needs onnx, onnxscript, onnxruntime

The network is rebuilt from the checkpoint's config and evaluated on the validation (or
test) split the way training validated it: eval mode, the same transforms, batch size,
autocast and memory format. So the accuracy printed here equals the ``val_acc`` that
training logged in metrics.jsonl for that checkpoint.

An export is made on the CPU from a fresh, plain network holding the checkpoint's weights
(never the compiled or channels_last module of training), in float32 with a dynamic batch
dimension. The artifact is written to a temporary file next to OUT, loaded back, and its
outputs compared with the eager network on random inputs of two batch sizes; only an
artifact that matches is renamed to OUT, so OUT is never a half-written or wrong file.

This file is not importable as ``test`` (the standard library owns that name): run it,
or load it by path as tests/conftest.py does.
"""

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import sys
import tempfile
import warnings

import torch

import checkpoint
import data
import engine
from networks import build_network
from ops import UserError

EXIT_USER_ERROR, EXIT_FAILED = 2, 1
AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
EXPORT_KINDS = {".pt2": "torch.export", ".ts": "frozen TorchScript", ".onnx": "ONNX"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
EXPORT_BATCHES = (2, 1, 5)  # traced with the first; checked at the others (1: no specialising)
EXPORT_RTOL, EXPORT_ATOL = 1e-4, 1e-4  # float32 graph rewrites (conv-BN folding) stay far below


# ----------------------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (argparse prints usage too)
        print(f"error: {message} (see python test.py --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def build_parser():
    """The command-line flags."""
    p = _Parser(description="Evaluate a checkpoint on the validation/test split, and "
                "optionally export the network for inference.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--checkpoint", required=True, help="a checkpoint written by train.py, e.g. "
        "runs/exp1/checkpoints/best.pt")
    add("--data-dir", default=None, help="where the data lives; default: the training "
        "run's --data-dir")
    add("--batch-size", type=int, default=None, help="samples per batch; default: the "
        "training run's --batch-size")
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    add("--num-workers", type=int, default=2, help="DataLoader worker processes")
    add("--json", default=None, metavar="OUT", help="also write loss, accuracy, per-class "
        "accuracy and the confusion matrix to this JSON file")
    add("--export", default=None, metavar="OUT", help="write an inference artifact with a "
        "dynamic batch dimension, by suffix: .pt2 (torch.export; load with "
        "torch.export.load(OUT).module()), .ts (frozen TorchScript via torch.jit.trace; "
        "TorchScript is deprecated upstream, prefer .pt2) or .onnx (needs pip install onnx "
        "onnxscript onnxruntime); its outputs are checked against the eager network")
    return p


def check_args(args):
    """Rejects impossible values before any work; returns the export suffix or None."""
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if args.num_workers < 0:
        raise UserError("--num-workers must not be negative")
    if not args.export:
        return None
    suffix = os.path.splitext(args.export)[1].lower()
    if suffix not in EXPORT_KINDS:
        kinds = ", ".join(f"{s} ({name})" for s, name in EXPORT_KINDS.items())
        raise UserError(f"--export {args.export!r}: unknown suffix {suffix or '(none)'!r}; "
                        f"use one of {kinds}")
    if suffix == ".onnx":
        missing = [m for m in ONNX_PACKAGES if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"--export .onnx needs {', '.join(missing)}, not installed here: "
                            f"pip install onnx onnxscript onnxruntime")
    return suffix


def resolve_device(text):
    """The torch.device named by --device; one that is not here is a UserError."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r} is not a device; use auto, cpu, cuda or "
                        f"cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {text!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or
                                  (device.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"--device {text}: no such CUDA device here "
                        f"({torch.cuda.device_count()} visible)")
    return device


def autocast_dtype(config, device):
    """The training run's autocast dtype (``--amp``), or None; checked on ``device``."""
    dtype = AMP_DTYPES[config.get("amp", "none")]
    if dtype is None:
        return None
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"the run trained with --amp bf16, which "
                        f"{torch.cuda.get_device_name(device)} cannot do; use --device cpu")
    if not torch.amp.is_autocast_available(device.type):
        raise UserError(f"the run trained with --amp {config['amp']}: no autocast on "
                        f"{device.type}")
    return dtype


# --------------------------------------------------------------------------- network

def load_network(state, config, val_set, path):
    """A fresh network holding the checkpoint's weights: CPU, float32, eval mode, contiguous.

    Args:
        state: the loaded checkpoint.
        config: the training run's config.
        val_set: the dataset (its classes, channels and image size shape the network).
        path: the checkpoint file, for messages.

    Returns:
        The nn.Module.
    """
    try:
        net = build_network(config["network"], val_set.num_classes, val_set.in_channels,
                            val_set.image_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    weights = checkpoint.unwrap_state_dict(state["model"])
    checkpoint.check_compatible(net, weights, path)
    net.load_state_dict(weights)  # copies into the fresh (contiguous) tensors
    return net.eval()


# ------------------------------------------------------------------------ evaluation

def evaluate(net, val_set, config, device, batch_size, num_workers):
    """Evaluates like training's validation (autocast and memory format of the run).

    Returns:
        engine.evaluate's dict: ``loss``, ``acc``, ``count``, ``confusion``.
    """
    memory_format = torch.channels_last if config.get("channels_last") \
        else torch.contiguous_format
    model = copy.deepcopy(net).to(device, memory_format=memory_format)
    run = engine.RunSettings(device=device, amp_dtype=autocast_dtype(config, device),
                             memory_format=memory_format, show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers,
                               pin_memory=device.type == "cuda")
    try:
        return engine.evaluate(model, loader, run, val_set.num_classes)
    finally:
        data.shutdown_loader(loader)


def make_report(path, result, classes):
    """The results as plain JSON types (an absent class's accuracy is None)."""
    per_class = engine.per_class_accuracy(result["confusion"])
    return {"checkpoint": path, "loss": result["loss"], "accuracy": result["acc"],
            "per_class": {name: None if math.isnan(acc) else acc
                          for name, acc in zip(classes, per_class)},
            "confusion": result["confusion"].tolist(), "count": result["count"]}


def format_report(report, state, config):
    """The report as text: headline, per-class accuracy, confusion matrix."""
    confusion = report["confusion"]
    names = list(report["per_class"])
    correct = sum(row[i] for i, row in enumerate(confusion))
    lines = [f"checkpoint {report['checkpoint']} (epoch {state.get('epoch', '?')}, step "
             f"{state.get('step', '?')}): {config['network']} on {config['dataset']}",
             f"loss {report['loss']:.4f}  accuracy {report['accuracy']:.4f} "
             f"({correct}/{report['count']})", "per-class accuracy:"]
    width = max(len(n) for n in names)
    for i, name in enumerate(names):
        acc = report["per_class"][name]
        text = "-" if acc is None else f"{acc:.4f}"
        lines.append(f"  {name:<{width}}  {text:>6}  ({confusion[i][i]}/{sum(confusion[i])})")
    lines.append("confusion matrix (rows: true class, columns: predicted class):")
    cell = max(len(str(max(max(row) for row in confusion))), len(str(len(names) - 1)))
    lines.append(f"  {'':<{width}}  " + " ".join(f"{j:>{cell}}" for j in range(len(names))))
    for name, row in zip(names, confusion):
        lines.append(f"  {name:<{width}}  " + " ".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def write_json(report, path):
    """Writes the report atomically (temporary file, then rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- export

@contextlib.contextmanager
def _torchscript_quietly():
    # TorchScript is deprecated upstream and says so at every call; the help text says it
    # once. Other warnings (TracerWarning: a trace that may not generalise) stay visible.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=FutureWarning)
        yield


def _batch_dim():
    return torch.export.Dim("batch", min=1)


def _save_pt2(net, example, path):
    program = torch.export.export(net, (example,), dynamic_shapes=({0: _batch_dim()},))
    torch.export.save(program, path)


def _load_pt2(path):
    return torch.export.load(path).module()


def _save_ts(net, example, path):
    with _torchscript_quietly():
        frozen = torch.jit.freeze(torch.jit.trace(net, example))
        torch.jit.save(frozen, path)


def _load_ts(path):
    with _torchscript_quietly():
        return torch.jit.load(path, map_location="cpu")


def _save_onnx(net, example, path):
    torch.onnx.export(net, (example,), path, dynamo=True, external_data=False,
                      input_names=["images"], output_names=["logits"],
                      dynamic_shapes=({0: _batch_dim()},))


def _load_onnx(path):
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


EXPORTERS = {".pt2": (_save_pt2, _load_pt2), ".ts": (_save_ts, _load_ts),
             ".onnx": (_save_onnx, _load_onnx)}


def export(net, path, suffix, sample_shape):
    """Writes ``net`` as an inference artifact and checks it against the eager network.

    The artifact goes to a temporary file in OUT's directory, is loaded back and run on
    random inputs of several batch sizes; it replaces OUT (atomic rename) only when every
    output matches the eager network within EXPORT_RTOL/EXPORT_ATOL. On any failure the
    temporary file is removed and an existing OUT is left as it was.

    Args:
        net: the network in eval mode, on the CPU, float32, contiguous.
        path: OUT.
        suffix: ``.pt2``, ``.ts`` or ``.onnx``.
        sample_shape: shape of one input sample, e.g. ``(3, 32, 32)``.

    Returns:
        ``(ok, max_abs_diff)``.
    """
    save, load = EXPORTERS[suffix]
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=directory)
    except OSError as e:
        raise UserError(f"--export {path!r}: cannot write in {directory!r}: {e.strerror}") \
            from None
    os.close(fd)
    try:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(n, *sample_shape, generator=g) for n in EXPORT_BATCHES]
        with torch.no_grad():
            save(net, inputs[0], tmp)
            reloaded = load(tmp)
            ok, worst = True, 0.0
            for x in inputs:
                want, got = net(x), reloaded(x)
                same_shape = tuple(got.shape) == tuple(want.shape)
                ok = ok and same_shape and torch.allclose(got, want, EXPORT_RTOL, EXPORT_ATOL)
                worst = max(worst, float((got - want).abs().max()) if same_shape else math.inf)
        if ok:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; an artifact is not
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        return ok, worst
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ------------------------------------------------------------------------------ main

def main(argv=None):
    """Evaluates (and exports) a checkpoint with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        exported artifact's outputs differ from the eager network's.
    """
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # checkpoint.CheckpointError included
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def run(argv):
    # 1. Flags, checked before any slow work.
    args = build_parser().parse_args(argv)
    suffix = check_args(args)
    device = resolve_device(args.device)

    # 2. The checkpoint and the training run's config.
    state = checkpoint.load_checkpoint(args.checkpoint)
    if "model" not in state or not isinstance(state.get("config"), dict):
        raise checkpoint.CheckpointError(f"{args.checkpoint!r} is not a training checkpoint "
                                         f"of this project (no model and config)")
    config = dict(state["config"])
    if args.data_dir is not None:
        config["data_dir"] = args.data_dir
    batch_size = args.batch_size or config["batch_size"]

    # 3. Data and network, evaluated as training validated.
    _, val_set = data.build_datasets(config)
    net = load_network(state, config, val_set, args.checkpoint)
    result = evaluate(net, val_set, config, device, batch_size, args.num_workers)
    report = make_report(args.checkpoint, result, val_set.classes)
    print(format_report(report, state, config), flush=True)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")

    # 4. Export: a fresh CPU network, checked against itself after reloading.
    if suffix is None:
        return 0
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    ok, worst = export(net, args.export, suffix, shape)
    sizes = ", ".join(str(n) for n in sorted(EXPORT_BATCHES))
    if not ok:
        print(f"error: the {EXPORT_KINDS[suffix]} artifact's outputs differ from the eager "
              f"network's (max abs difference {worst:.3g} at batch sizes {sizes}; tolerance "
              f"rtol {EXPORT_RTOL:g}, atol {EXPORT_ATOL:g}); {args.export} not written",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"exported {EXPORT_KINDS[suffix]} to {args.export} (dynamic batch); max abs "
          f"difference from the eager network {worst:.3g} at batch sizes {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
