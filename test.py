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

Every output (--json, --export) is checked to be writable before anything is loaded; a
write that fails later (a full disk) is one ``error:`` line, exit code 1, and the file
that was there before is left as it was.

This file is not importable as ``test`` (the standard library owns that name): run it,
or load it by path as tests/conftest.py does.
"""

import argparse
import contextlib
import copy
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import warnings

import torch

import checkpoint
import data
import engine
import runtime
from networks import build_network
from ops import UserError

EXIT_USER_ERROR, EXIT_FAILED = 2, 1
EXPORT_KINDS = {".pt2": "torch.export", ".ts": "frozen TorchScript", ".onnx": "ONNX"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
EXPORT_BATCHES = (2, 1, 5)  # traced with the first; checked at the others (1: no specialising)
EXPORT_RTOL, EXPORT_ATOL = 1e-4, 1e-4  # float32 graph rewrites (conv-BN folding) stay far below


class OutputError(Exception):
    """Writing an output failed mid-run (a full disk, say); exit code 1, old file intact."""


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
    for flag, path in (("--json", args.json), ("--export", args.export)):
        if path is not None and not path.strip():
            raise UserError(f"{flag} needs a file name")
    if args.export is None:
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


def check_output(flag, path, checkpoint_path):
    """Rejects an output that could not be written, before any slow work.

    The nearest existing directory above ``path`` must take a new file: a temporary file
    is made there and removed (the mode bits alone would mislead root, and a read-only
    mount or a full inode table are only seen by trying).

    Args:
        flag: ``--json`` or ``--export``, for the message.
        path: the output file; its directory may not exist yet.
        checkpoint_path: the checkpoint, which an output must not replace.
    """
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise UserError(f"{flag} {path!r} is a directory; name a file (in it)")
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise UserError(f"{flag} {path!r} exists and is not a regular file")
        if os.path.isfile(checkpoint_path) and os.path.samefile(path, checkpoint_path):
            raise UserError(f"{flag} {path!r} is the checkpoint being evaluated; name "
                            f"another file")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):  # created when written
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path!r}: {existing!r} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {existing!r} "
                        f"({e.strerror or e})") from None


def check_outputs(args):
    """check_output for --json and --export, which must name two different files."""
    outputs = [(flag, path) for flag, path in (("--json", args.json),
                                               ("--export", args.export)) if path]
    for flag, path in outputs:
        check_output(flag, path, args.checkpoint)
    if len(outputs) == 2 and os.path.abspath(args.json) == os.path.abspath(args.export):
        raise UserError(f"--json and --export both name {args.json!r}; name two files")


# ------------------------------------------------------------------------ checkpoint

def load_training_checkpoint(path):
    """The checkpoint at ``path``, checked to be a training checkpoint of this project.

    Returns:
        The state dict: ``model`` a state_dict (string keys, dense CPU tensors with finite
        values) and ``config`` a dict.

    Raises:
        checkpoint.CheckpointError: anything else, in one line.
    """
    with warnings.catch_warnings():  # a sparse tensor's check; the weights are refused below
        warnings.filterwarnings("ignore", message="Validating sparse tensor invariants")
        state = checkpoint.load_checkpoint(path)
    if "model" not in state or not isinstance(state.get("config"), dict):
        raise checkpoint.CheckpointError(f"{path!r} is not a training checkpoint "
                                         f"of this project (no model and config)")
    weights = state["model"]
    if not isinstance(weights, dict):
        raise checkpoint.CheckpointError(f"{path!r}: its model is a {type(weights).__name__}, "
                                         f"not a state_dict (a dict of tensors)")
    for key, value in weights.items():
        if not isinstance(key, str):
            raise checkpoint.CheckpointError(f"{path!r}: its model has a key {_short(key)}, "
                                             f"not a parameter name")
        if not isinstance(value, torch.Tensor):
            raise checkpoint.CheckpointError(f"{path!r}: its model's {key} is "
                                             f"{_short(value)}, not a tensor")
        if value.layout != torch.strided or value.device.type != "cpu" or \
                value.is_complex():
            raise checkpoint.CheckpointError(
                f"{path!r}: its model's {key} is a {value.dtype} {value.layout} tensor on "
                f"{value.device}, not a plain real one")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise checkpoint.CheckpointError(f"{path!r}: its model's {key} holds NaN or "
                                             f"infinite values")
    return state


def _short(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int_at_least(low):
    return lambda v: type(v) is int and v >= low  # not bool, not float (NaN included)


_CONFIG_NEEDS = (  # key, check, what it must be, whether the key may be absent
    ("network", lambda v: isinstance(v, str) and v != "", "a network name", False),
    ("dataset", lambda v: isinstance(v, str) and v != "", "a dataset name", False),
    ("data_dir", lambda v: isinstance(v, str), "a directory (or pass --data-dir)", False),
    ("seed", lambda v: type(v) is int, "an integer", False),
    ("image_size", _int_at_least(1), "an integer of at least 1", True),
    ("in_channels", _int_at_least(1), "an integer of at least 1", True),
    ("amp", lambda v: isinstance(v, str) and v in runtime.AMP_DTYPES,
     f"one of {', '.join(runtime.AMP_DTYPES)}", True),
)
_SYNTHETIC_NEEDS = (
    ("synthetic_size", _int_at_least(1), "an integer of at least 1", False),
    ("num_classes", _int_at_least(2), "an integer of at least 2", False),
)


def check_config(config, path, need_batch_size):
    """Raises a CheckpointError when the config lacks, or holds a senseless value for, a
    key that evaluation reads (``batch_size`` only when ``need_batch_size``)."""
    needs = list(_CONFIG_NEEDS)
    if need_batch_size:
        needs.append(("batch_size", _int_at_least(1),
                      "an integer of at least 1 (or pass --batch-size)", False))
    if config.get("dataset") == "synthetic":
        needs.extend(_SYNTHETIC_NEEDS)
    for key, ok, expected, optional in needs:
        if key not in config:
            if optional:
                continue
            raise checkpoint.CheckpointError(f"{path!r}: its config has no {key}; expected "
                                             f"{expected}")
        if not ok(config[key]):
            raise checkpoint.CheckpointError(f"{path!r}: its config's {key} is "
                                             f"{_short(config[key])}; expected {expected}")


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
    dtype = runtime.amp_dtype(config["amp"], device, remedy="evaluate with --device cpu")
    loop = engine.LoopSettings(device=device, amp_dtype=dtype, memory_format=memory_format,
                               show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers,
                               pin_memory=device.type == "cuda")
    try:
        return engine.evaluate(model, loader, loop, val_set.num_classes)
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


def _write_failed(flag, path, error):
    kept = ("the previous file there is unchanged" if os.path.isfile(path)
            else "nothing was written")
    return OutputError(f"{flag} {path!r}: writing failed ({error.strerror or error}); {kept}")


def write_json(report, path):
    """Writes the report atomically (checkpoint.atomic_write).

    Raises:
        OutputError: the write failed (a full disk); a previous file at ``path`` is intact.
    """
    text = json.dumps(report, indent=2) + "\n"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        checkpoint.atomic_write(path, lambda f: f.write(text))
    except OSError as e:
        raise _write_failed("--json", path, e) from None


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


def _not_about_the_pt2_name(record):
    # torch.export.save logs that a path should end in .pt2; a staging file's does not.
    return not record.getMessage().startswith("Expect archive file to be a file ending in")


def _save_pt2(net, example, path):
    program = torch.export.export(net, (example,), dynamic_shapes=({0: _batch_dim()},))
    logger = logging.getLogger("torch.export.pt2_archive._package")
    logger.addFilter(_not_about_the_pt2_name)
    try:
        torch.export.save(program, path)
    finally:
        logger.removeFilter(_not_about_the_pt2_name)


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
    temporary file is removed and an existing OUT is left as it was. (.pt2 and .ts are
    serialised into memory first where Linux allows: see _staging_file.)

    Args:
        net: the network in eval mode, on the CPU, float32, contiguous.
        path: OUT.
        suffix: ``.pt2``, ``.ts`` or ``.onnx``.
        sample_shape: shape of one input sample, e.g. ``(3, 32, 32)``.

    Returns:
        ``(ok, max_abs_diff)``.

    Raises:
        OutputError: writing the file failed (a full disk).
    """
    save, load = EXPORTERS[suffix]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, *sample_shape, generator=g) for n in EXPORT_BATCHES]
    check = {}

    def write_and_check(tmp):  # raises _Mismatch so that atomic_write keeps OUT as it was
        with torch.no_grad():
            with _staging_file(suffix) as staged:
                save(net, inputs[0], staged or tmp)
                if staged:
                    with open(staged, "rb") as src, open(tmp, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            reloaded = load(tmp)
            ok, worst = True, 0.0
            for x in inputs:
                want, got = net(x), reloaded(x)
                same_shape = tuple(got.shape) == tuple(want.shape)
                ok = ok and same_shape and torch.allclose(got, want, EXPORT_RTOL, EXPORT_ATOL)
                worst = max(worst, float((got - want).abs().max()) if same_shape else math.inf)
        check["worst"] = worst
        if not ok:
            raise _Mismatch

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        checkpoint.atomic_write(path, write_and_check, mode=None)
    except _Mismatch:
        return False, check["worst"]
    except OSError as e:
        raise _write_failed("--export", path, e) from None
    return True, check["worst"]


class _Mismatch(Exception):
    """The exported artifact's outputs differ from the eager network's."""


@contextlib.contextmanager
def _staging_file(suffix):
    """The path of an anonymous in-memory file for torch's own writers (.pt2, .ts), or None.

    Those writers abort the whole process (a C++ error thrown in a destructor) when the
    disk fills up under them; written to memory first, the artifact reaches the disk
    through Python, whose OSError becomes one ``error:`` line. None where there is no
    memfd (not Linux): the artifact is then written in place.
    """
    fd = None
    if suffix in (".pt2", ".ts") and hasattr(os, "memfd_create") and \
            os.path.isdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fd = os.memfd_create("test.py-export")
    try:
        yield None if fd is None else f"/proc/self/fd/{fd}"
    finally:
        if fd is not None:
            os.close(fd)


# ------------------------------------------------------------------------------ main

def main(argv=None):
    """Evaluates (and exports) a checkpoint with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        exported artifact's outputs differ from the eager network's or an output could not
        be written (one ``error:`` line; a file that was there is left as it was).
    """
    try:
        return evaluate_and_export(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # checkpoint.CheckpointError included
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def evaluate_and_export(argv):
    """The script: flags, checkpoint, evaluation, report, export; returns 0."""
    # 1. Flags, checked before any slow work.
    args = build_parser().parse_args(argv)
    suffix = check_args(args)
    device = runtime.parse_device(args.device)
    check_outputs(args)

    # 2. The checkpoint and the training run's config.
    state = load_training_checkpoint(args.checkpoint)
    config = dict(state["config"])
    if args.data_dir is not None:
        config["data_dir"] = args.data_dir
    check_config(config, args.checkpoint, need_batch_size=args.batch_size is None)
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
