"""Evaluate a trained checkpoint, export it for inference, quantize it, and check the file.

    python test.py --checkpoint runs/exp1/checkpoints/best.pt
    python test.py --checkpoint runs/exp1/checkpoints/last.pt --json results.json
    python test.py --checkpoint best.pt --export model.pt2    # torch.export (Python serving)
    python test.py --checkpoint best.pt --export model.ts     # frozen TorchScript (C++, mobile)
    python test.py --checkpoint best.pt --export model.onnx   # ONNX (onnxruntime, TensorRT...)
    python test.py --checkpoint best.pt --export model.onnx --quantize int8  # + model.int8.onnx
    python test.py --model model.int8.onnx                    # evaluate a file you ship

The network is rebuilt from the checkpoint's config and evaluated on the validation (or
test) split the way training validated it: eval mode, the same transforms, batch size,
autocast and memory format. So the accuracy printed here equals the ``val_acc`` that
training logged in metrics.jsonl for that checkpoint.

An export is made on the CPU from a fresh, plain network holding the checkpoint's weights
(never the compiled or channels_last module of training), in float32 with a dynamic batch
dimension. The artifact is written to a temporary file next to OUT, loaded back, and its
outputs compared with the eager network on random inputs of several batch sizes; only an
artifact that matches is renamed to OUT, so OUT is never a half-written or wrong file.
Every artifact carries what evaluating it needs (the dataset, image size, classes and
normalisation: ONNX metadata_props, or a ``metadata.json`` extra file in .pt2/.ts), so
``--model FILE`` evaluates it later without the checkpoint.

An ONNX export is then evaluated itself, through onnxruntime, on the validation split, next
to the eager network: loss, accuracy, per-class accuracy, file size and CPU samples/s at
batch 64 (THROUGHPUT_BATCH). ``--quantize int8`` adds a static int8 copy next to OUT
(``model.onnx`` -> ``model.int8.onnx``; QDQ format, per-channel int8 weights, uint8
activations calibrated on ``--calibration-samples`` training images chosen by ``--seed``),
``--quantize int8-dynamic`` a dynamic one (weights only; no calibration), measured the
same way; an accuracy drop beyond ``--max-accuracy-drop`` is a warning.

Every output (--json, --export and the int8 file) is checked to be writable before anything
is loaded; a write that fails later (a full disk) is one ``error:`` line, exit code 1, and
the file that was there before is left as it was.

This file is not importable as ``test`` (the standard library owns that name): run it,
or load it by path as tests/conftest.py does.
"""

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

import checkpoint
import data
import engine
import runtime
from config import parse_config as train_defaults
from networks import build_network
from ops import UserError

EXIT_USER_ERROR, EXIT_FAILED = 2, 1
EXPORT_KINDS = {".pt2": "torch.export", ".ts": "frozen TorchScript", ".onnx": "ONNX"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
EXPORT_BATCHES = (2, 1, 5)  # traced with the first; checked at the others (1: no specialising)
EXPORT_RTOL, EXPORT_ATOL = 1e-4, 1e-4  # float32 graph rewrites (conv-BN folding) stay far below
QUANTIZE_KINDS = {"int8": "static int8 (QDQ, per-channel int8 weights, uint8 activations "
                          "calibrated on training images)",
                  "int8-dynamic": "dynamic int8 (per-channel int8 weights, activations "
                                  "quantized at run time)"}
CALIBRATION_SAMPLES = 256   # --calibration-samples default
CALIBRATION_BATCH = 32      # images per calibration batch (MinMax: the batching changes nothing)
THROUGHPUT_BATCH = 64       # samples/s are measured at this batch size, on the CPU
THROUGHPUT_SECONDS = 0.5    # ... for at least this long and THROUGHPUT_MIN_BATCHES batches
THROUGHPUT_MIN_BATCHES = 5
METADATA_FILE = "metadata.json"  # the extra file of .pt2 and .ts that holds the metadata
STORED_CONFIG = ("network", "dataset", "data_dir", "seed", "batch_size", "synthetic_size")


class OutputError(Exception):
    """Writing an output failed mid-run (a full disk, say); exit code 1, old file intact."""


class QuantizationError(Exception):
    """onnxruntime could not quantize the network, or its int8 file does not run; exit 1."""


# ----------------------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (argparse prints usage too)
        print(f"error: {message} (see python test.py --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def build_parser():
    """The command-line flags."""
    p = _Parser(description="Evaluate a checkpoint (or an exported file) on the "
                "validation/test split, and optionally export and quantize the network for "
                "inference.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint written by train.py, e.g. "
                        "runs/exp1/checkpoints/best.pt")
    source.add_argument("--model", metavar="FILE", help="evaluate a file written by "
                        "--export instead (.onnx, int8 .onnx, .pt2, .ts), on the CPU, "
                        "without the checkpoint: the dataset, image size, classes and "
                        "normalisation stored in it at export apply (the flags below "
                        "override them)")
    add("--data-dir", default=None, help="where the data lives; default: the training "
        "run's --data-dir")
    add("--dataset", default=None, choices=data.DATASETS, help="default: the training "
        "run's (from the checkpoint, or stored in the --model file)")
    add("--image-size", type=int, default=None, help="default: the training run's")
    add("--num-classes", type=int, default=None, help="synthetic data: default: the "
        "training run's")
    add("--synthetic-size", type=int, default=None, help="synthetic data: default: the "
        "training run's")
    add("--batch-size", type=int, default=None, help="samples per batch; default: the "
        "training run's --batch-size")
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N; "
        "exported files (--model, and the ONNX comparison) always run on the CPU")
    add("--num-workers", type=int, default=2, help="DataLoader worker processes")
    add("--weights", default="auto", choices=["auto", "raw", "ema"], help="which weights "
        "of the checkpoint: the moving average (ema, from --ema-decay) or the trained ones "
        "(raw); auto: ema when the checkpoint has it. Exports use the same")
    add("--tta", default=None, choices=["none", "flip"], help="average the logits of each "
        "image and its mirror (never for digits); default: the training run's --tta")
    add("--json", default=None, metavar="OUT", help="also write loss, accuracy, per-class "
        "accuracy and the confusion matrix to this JSON file (with --export .onnx: of "
        "each exported file too, with sizes and samples/s)")
    add("--export", default=None, metavar="OUT", help="write an inference artifact with a "
        "dynamic batch dimension, by suffix: .pt2 (torch.export; load with "
        "torch.export.load(OUT).module()), .ts (frozen TorchScript via torch.jit.trace; "
        "TorchScript is deprecated upstream, prefer .pt2) or .onnx (input 'images', output "
        "'logits'; evaluated through onnxruntime next to the eager network); its outputs "
        "are checked against the eager network")
    add("--quantize", default=None, choices=list(QUANTIZE_KINDS), help="with --export "
        "OUT.onnx: also write an int8 copy next to OUT (model.onnx -> model.int8.onnx) "
        "with onnxruntime.quantization: int8 = static (QDQ, per-channel weights, "
        "activations calibrated on training images), int8-dynamic = weights only, for "
        "networks where static fails")
    add("--calibration-samples", type=int, default=None, metavar="N", help="--quantize "
        f"int8: calibrate on N training images (default {CALIBRATION_SAMPLES}; all of them "
        "when the split is smaller)")
    add("--seed", type=int, default=None, help="--quantize int8: which training images "
        "calibrate (the same seed gives the same int8 file); default: the training run's "
        "seed")
    add("--max-accuracy-drop", type=float, default=0.01, metavar="DELTA", help="warn when "
        "the int8 file's accuracy is more than DELTA (0.01 = 1 point) below the eager "
        "network's")
    return p


def int8_path(path):
    """Where --quantize writes: next to OUT, ``model.onnx`` -> ``model.int8.onnx``."""
    root, ext = os.path.splitext(path)
    return f"{root}.int8{ext}"


def check_args(args):
    """Rejects impossible values before any work; returns the export suffix or None."""
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if args.num_workers < 0:
        raise UserError("--num-workers must not be negative")
    for flag, value, low in (("--image-size", args.image_size, 1),
                             ("--num-classes", args.num_classes, 2),
                             ("--synthetic-size", args.synthetic_size, 1),
                             ("--calibration-samples", args.calibration_samples, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}")
    if not 0 <= args.max_accuracy_drop <= 1:  # NaN fails too
        raise UserError(f"--max-accuracy-drop must be in [0, 1] (0.01 = 1 point), not "
                        f"{args.max_accuracy_drop}")
    for flag, path in (("--json", args.json), ("--export", args.export),
                       ("--checkpoint", args.checkpoint), ("--model", args.model)):
        if path is not None and not path.strip():
            raise UserError(f"{flag} needs a file name")
    if args.model is not None:
        _check_model_args(args)
    if args.calibration_samples is not None and args.quantize != "int8":
        without = f"with --quantize {args.quantize}" if args.quantize else "without it"
        raise UserError(f"--calibration-samples is for --quantize int8 (static); {without} "
                        f"nothing is calibrated")
    if args.seed is not None and args.quantize != "int8":
        raise UserError("--seed picks the calibration images of --quantize int8; it does "
                        "nothing without it")
    if args.export is None:
        if args.quantize:
            raise UserError(f"--quantize {args.quantize} needs --export OUT.onnx: the ONNX "
                            f"export is what is quantized (the int8 file goes next to it)")
        return None
    suffix = os.path.splitext(args.export)[1].lower()
    if suffix not in EXPORT_KINDS:
        kinds = ", ".join(f"{s} ({name})" for s, name in EXPORT_KINDS.items())
        raise UserError(f"--export {args.export!r}: unknown suffix {suffix or '(none)'!r}; "
                        f"use one of {kinds}")
    if args.quantize and suffix != ".onnx":
        raise UserError(f"--quantize {args.quantize} works on ONNX exports only: "
                        f"{EXPORT_KINDS[suffix]} ({suffix}) files cannot be quantized here; "
                        f"use --export {os.path.splitext(args.export)[0]}.onnx (the int8 "
                        f"file is written next to it)")
    if suffix == ".onnx":
        _check_onnx_installed("--export .onnx")
    return suffix


def _check_model_args(args):
    suffix = os.path.splitext(args.model)[1].lower()
    if suffix not in EXPORT_KINDS:
        raise UserError(f"--model {args.model!r}: unknown suffix {suffix or '(none)'!r}; "
                        f"it takes a file written by --export ({', '.join(EXPORT_KINDS)})")
    if args.export is not None or args.quantize is not None:
        flag = "--export" if args.export is not None else "--quantize"
        raise UserError(f"{flag} needs --checkpoint: --model only evaluates an exported "
                        f"file")
    if args.device not in ("auto", "cpu"):
        raise UserError(f"--model files are evaluated on the CPU, as they were exported; "
                        f"drop --device {args.device}")
    if suffix == ".onnx":
        _check_onnx_installed("--model .onnx")


def _check_onnx_installed(what):
    missing = [m for m in ONNX_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{what} needs {', '.join(missing)}, not installed here: "
                        f"pip install onnx onnxscript onnxruntime (or pip install -r "
                        f"requirements.txt)")


def check_output(flag, path, checkpoint_path):
    """Rejects an output that could not be written, before any slow work.

    The nearest existing directory above ``path`` must take a new file
    (``checkpoint.probe_writable``).

    Args:
        flag: ``--json`` or ``--export``, for the message.
        path: the output file; its directory may not exist yet.
        checkpoint_path: the checkpoint (or --model file), which an output must not
            replace.
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
        checkpoint.probe_writable(existing)
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {existing!r} "
                        f"({e.strerror or e})") from None


def check_outputs(args):
    """check_output for --json, --export and the int8 file, which must be different files."""
    outputs = [(flag, path) for flag, path in (("--json", args.json),
                                               ("--export", args.export)) if path]
    if args.quantize:
        outputs.append((f"--quantize {args.quantize}", int8_path(args.export)))
    for flag, path in outputs:
        check_output(flag, path, args.checkpoint or args.model)
    for i, (flag, path) in enumerate(outputs):
        for other_flag, other in outputs[i + 1:]:
            if os.path.abspath(path) == os.path.abspath(other):
                raise UserError(f"{flag} and {other_flag} both name {path!r}; name two "
                                f"files")


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

def choose_weights(state, which, path):
    """``"ema"`` or ``"raw"``: the weights --weights asks for (auto: ema when present)."""
    if which == "ema" and "ema" not in state:
        raise UserError(f"--weights ema: {path!r} has no moving average (train with "
                        f"--ema-decay)")
    if which == "auto":
        return "ema" if "ema" in state else "raw"
    return which


def load_network(state, config, val_set, path, weights="raw"):
    """A fresh network holding the checkpoint's weights: CPU, float32, eval mode, contiguous.

    Args:
        state: the loaded checkpoint.
        config: the training run's config.
        val_set: the dataset (its classes, channels and image size shape the network).
        path: the checkpoint file, for messages.
        weights: ``"raw"`` (``model``) or ``"ema"`` (the moving average, ``ema``).

    Returns:
        The nn.Module.
    """
    try:
        net = build_network(config["network"], val_set.num_classes, val_set.in_channels,
                            val_set.image_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    tensors = checkpoint.unwrap_state_dict(state["ema" if weights == "ema" else "model"])
    checkpoint.check_compatible(net, tensors, path)
    net.load_state_dict(tensors)  # copies into the fresh (contiguous) tensors
    return net.eval()


# ------------------------------------------------------------------------ evaluation

def evaluate(net, val_set, config, device, batch_size, num_workers, tta=False):
    """Evaluates like training's validation (autocast and memory format of the run; with
    ``tta``, each image and its mirror).

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
        return engine.evaluate(model, loader, loop, val_set.num_classes, tta=tta)
    finally:
        data.shutdown_loader(loader)


def make_report(path, result, classes, key="checkpoint"):
    """The results as plain JSON types (an absent class's accuracy is None).

    ``key`` names what was evaluated: ``checkpoint``, or ``model`` for an exported file.
    """
    per_class = engine.per_class_accuracy(result["confusion"])
    return {key: path, "loss": result["loss"], "accuracy": result["acc"],
            "per_class": {name: None if math.isnan(acc) else acc
                          for name, acc in zip(classes, per_class)},
            "confusion": result["confusion"].tolist(), "count": result["count"]}


def format_report(report, state, config, title=None):
    """The report as text: headline, per-class accuracy, confusion matrix.

    ``title`` replaces the first line (which names the checkpoint, its epoch and step).
    """
    confusion = report["confusion"]
    names = list(report["per_class"])
    correct = sum(row[i] for i, row in enumerate(confusion))
    extras = "".join(f", {what}" for what, on in (
        ("the moving average of the weights", report.get("weights") == "ema"),
        ("flip TTA", report.get("tta") == "flip")) if on)
    title = title or (f"checkpoint {report['checkpoint']} (epoch {state.get('epoch', '?')}, "
                      f"step {state.get('step', '?')}{extras}): {config['network']} on "
                      f"{config['dataset']}")
    lines = [title,
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


def _save_pt2(net, example, path, metadata):
    program = torch.export.export(net, (example,), dynamic_shapes=({0: _batch_dim()},))
    logger = logging.getLogger("torch.export.pt2_archive._package")
    logger.addFilter(_not_about_the_pt2_name)
    try:
        torch.export.save(program, path, extra_files={METADATA_FILE: json.dumps(metadata)})
    finally:
        logger.removeFilter(_not_about_the_pt2_name)


def _load_pt2(path, extra_files=None):
    return torch.export.load(path, extra_files=extra_files).module()


def _save_ts(net, example, path, metadata):
    # torch.jit.freeze inlines the weights and runs the frozen-graph optimisations
    # (conv-BN folding...). torch.jit.optimize_for_inference is applied when loading
    # (_load_ts): it bakes in this machine's MKLDNN build, and a module it has converted
    # cannot be serialised (upstream says so; its file does not load back).
    with _torchscript_quietly():
        frozen = torch.jit.freeze(torch.jit.trace(net, example))
        torch.jit.save(frozen, path, _extra_files={METADATA_FILE: json.dumps(metadata)})


def _load_ts(path, extra_files=None):
    with _torchscript_quietly():
        module = torch.jit.load(path, map_location="cpu", _extra_files=extra_files or {})
        return torch.jit.optimize_for_inference(module)


def _save_onnx(net, example, path, metadata):
    program = torch.onnx.export(net, (example,), dynamo=True, verbose=False,
                                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                                dynamic_shapes=({0: _batch_dim()},))
    program.model.metadata_props.update(metadata)
    program.save(path, external_data=False)


def _onnx_session(path):
    """An onnxruntime CPU session with as many threads as torch uses (a fair comparison)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3  # errors only
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _onnx_runner(session):
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.contiguous().numpy()})[0])


def _load_onnx(path):
    return _onnx_runner(_onnx_session(path))


EXPORTERS = {".pt2": (_save_pt2, _load_pt2), ".ts": (_save_ts, _load_ts),
             ".onnx": (_save_onnx, _load_onnx)}
INPUT_NAME, OUTPUT_NAME = "images", "logits"


def export_metadata(config, val_set, state, source):
    """What evaluating the artifact needs, stored in it: ONNX metadata_props (strings).

    ``training_config`` (JSON: network, dataset, data_dir, seed, batch_size, image size,
    channels, classes count), ``classes`` (JSON list, in label order), ``normalize`` (JSON
    ``{"mean", "std"}``, or null where the dataset is not normalised), ``input``,
    ``output`` (plain text for whoever serves the file), ``quantization`` and ``source``.
    """
    stored = {key: config[key] for key in STORED_CONFIG if key in config}
    if config["dataset"] != "synthetic":
        stored.pop("synthetic_size", None)
    stored.update(image_size=val_set.image_size, in_channels=val_set.in_channels,
                  num_classes=val_set.num_classes)
    stats = data.STATS.get(config["dataset"])
    normalize = None if stats is None else {"mean": list(stats[0]), "std": list(stats[1])}
    side, channels = val_set.image_size, val_set.in_channels
    scaling = ("pixels scaled to [0, 1], then (x - mean) / std per channel (see normalize)"
               if stats else "as the dataset makes them (not normalised)")
    return {"training_config": json.dumps(stored), "classes": json.dumps(val_set.classes),
            "normalize": json.dumps(normalize),
            "input": f"{INPUT_NAME}: float32 (batch, {channels}, {side}, {side}), {scaling}",
            "output": f"{OUTPUT_NAME}: float32 (batch, {val_set.num_classes}); the argmax "
                      f"indexes classes",
            "quantization": "none",
            "source": json.dumps({"checkpoint": source, "epoch": state.get("epoch"),
                                  "step": state.get("step")})}


def export(net, path, suffix, sample_shape, metadata=None):
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
        metadata: strings stored in the artifact (export_metadata), or None.

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
                save(net, inputs[0], staged or tmp, metadata or {})
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


# ------------------------------------------------------------- exported files, measured

class _Exported(torch.nn.Module):
    """An exported file's callable as a module that engine.evaluate can run (CPU, float32)."""

    def __init__(self, run):
        super().__init__()
        # Kept out of the submodules: eval() must not reach an exported program's module
        # (which refuses train/eval) or a ScriptModule.
        object.__setattr__(self, "run", run)

    def forward(self, x):
        return self.run(x)


def evaluate_exported(run, val_set, batch_size, num_workers):
    """Evaluates an exported file's callable on the CPU, with engine.evaluate (as training).

    Returns:
        engine.evaluate's dict: ``loss``, ``acc``, ``count``, ``confusion``.
    """
    loop = engine.LoopSettings(device=torch.device("cpu"), show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers)
    try:
        return engine.evaluate(_Exported(run), loader, loop, val_set.num_classes)
    finally:
        data.shutdown_loader(loader)


def samples_per_second(run, sample_shape, batch=THROUGHPUT_BATCH):
    """CPU throughput of ``run`` on random float32 batches of ``batch``: batch / the median
    time of a batch, over at least THROUGHPUT_MIN_BATCHES batches and THROUGHPUT_SECONDS,
    after one warm-up batch."""
    x = torch.randn(batch, *sample_shape, generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        run(x)
        start = time.perf_counter()
        while len(times) < THROUGHPUT_MIN_BATCHES or \
                time.perf_counter() - start < THROUGHPUT_SECONDS:
            began = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - began)
    return batch / statistics.median(times)


def weights_bytes(net):
    """The size of the network's state_dict saved with torch.save (the eager 'file')."""
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    return buffer.tell()


def _size(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def measured(report, size, speed, reference=None, file=None):
    """A row of the comparison: the report's metrics, the file and its size, samples/s and
    the accuracy delta against ``reference`` (the eager row)."""
    row = {"file": file, "bytes": size, "samples_per_sec": speed,
           **{k: report[k] for k in ("loss", "accuracy", "per_class", "confusion", "count")}}
    row["accuracy_delta"] = 0.0 if reference is None else \
        report["accuracy"] - reference["accuracy"]
    return row


def format_comparison(rows, batch):
    """The comparison as text: size, loss, accuracy, delta, samples/s; per-class accuracy."""
    width = max(len(name) for name in rows)
    lines = [f"the exported files evaluated on the validation split (onnxruntime, CPU) next "
             f"to the eager network; samples/s on the CPU at batch {batch}, "
             f"{torch.get_num_threads()} threads:",
             f"  {'':<{width}}  {'size':>10}  {'loss':>7}  {'accuracy':>8}  {'delta':>7}  "
             f"{'samples/s':>10}"]
    for name, row in rows.items():
        delta = "-" if row is next(iter(rows.values())) else f"{row['accuracy_delta']:+.4f}"
        lines.append(f"  {name:<{width}}  {_size(row['bytes']):>10}  {row['loss']:7.4f}  "
                     f"{row['accuracy']:8.4f}  {delta:>7}  {row['samples_per_sec']:10.1f}")
    classes = list(next(iter(rows.values()))["per_class"])
    cw = max(len(c) for c in classes)
    cols = [max(len(name), 6) for name in rows]
    lines.append("  per-class accuracy:")
    lines.append(f"  {'':<{cw}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(rows, cols)))
    for c in classes:
        cells = [row["per_class"][c] for row in rows.values()]
        lines.append(f"  {c:<{cw}}  " + "  ".join(
            f"{'-' if v is None else f'{v:.4f}':>{w}}" for v, w in zip(cells, cols)))
    return "\n".join(lines)


# ---------------------------------------------------------------------- quantization

def calibration_set(train_set, samples, seed):
    """``samples`` training images (all of them if fewer), chosen by ``seed`` alone."""
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.Subset(train_set, order[:samples].tolist())


def quantize(fp32_path, out_path, kind, calibration, num_workers, metadata):
    """Writes an int8 copy of the ONNX file ``fp32_path`` to ``out_path`` with
    onnxruntime.quantization, atomically, after checking that it runs.

    The fp32 file is pre-processed first (quant_pre_process: shape inference and graph
    optimisation; skipped with a warning where it fails). ``int8``: static quantization in
    QDQ format, per-channel symmetric int8 weights, asymmetric uint8 activations whose
    ranges (MinMax) come from running ``calibration`` (a dataset): onnxruntime's "U8S8"
    (resnet18 on an AVX512-VNNI CPU: 3.4x the samples/s of int8 activations, which were
    no faster than float32). ``int8-dynamic``: per-channel int8 weights, activations
    quantized at run time. The result is loaded in a fresh
    onnxruntime session and run at several batch sizes before it replaces ``out_path``.

    Args:
        fp32_path: the checked fp32 ONNX file.
        out_path: where the int8 file goes.
        kind: ``int8`` or ``int8-dynamic``.
        calibration: the calibration images (``int8``), or None.
        num_workers: DataLoader workers for the calibration images.
        metadata: the fp32 file's metadata; ``quantization`` is replaced.

    Returns:
        ``(seconds, metadata)``: the time quantization took (pre-processing included, the
        calibration images' loading too) and the metadata stored in the int8 file.

    Raises:
        QuantizationError: onnxruntime failed, or its file does not run.
        OutputError: writing failed (a full disk); a previous file at ``out_path`` is kept.
    """
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    flag = f"--quantize {kind}"
    if kind == "int8":
        method = (f"int8 static: QDQ, per-channel int8 weights, uint8 activations calibrated "
                  f"(MinMax) on {len(calibration)} training images")
    else:
        method = "int8 dynamic: per-channel int8 weights, activations quantized at run time"
    metadata = dict(metadata, quantization=method)
    start = time.perf_counter()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".tmp-", dir=os.path.dirname(
                os.path.abspath(out_path))) as work:
            source = os.path.join(work, "preprocessed.onnx")
            try:
                quant_pre_process(fp32_path, source)
            except OSError:
                raise
            except Exception as e:
                print(f"warning: onnxruntime's quant_pre_process failed ({_one_line(e)}); "
                      f"quantizing the exported file as it is", file=sys.stderr)
                source = fp32_path
            quantized = os.path.join(work, "int8.onnx")
            _run_quantizer(source, quantized, kind, calibration, num_workers, fp32_path)
            model = onnx.load(quantized)
            seconds = time.perf_counter() - start
            _set_metadata(model, metadata)
            checkpoint.atomic_write(out_path, lambda tmp: _save_and_try(model, tmp, flag),
                                    mode=None)
    except OSError as e:
        raise _write_failed(flag, out_path, e) from None
    return seconds, metadata


def _calibration_reader(loader):
    """onnxruntime's CalibrationDataReader over a loader's images."""
    from onnxruntime import quantization as ortq

    class Reader(ortq.CalibrationDataReader):
        def __init__(self):
            self.batches = iter(loader)

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {INPUT_NAME: batch[0].contiguous().numpy()}

    return Reader()


def _run_quantizer(source, quantized, kind, calibration, num_workers, fp32_path):
    """onnxruntime's static (calibrated) or dynamic quantization of ``source``."""
    from onnxruntime import quantization as ortq

    loader = None
    try:
        if kind == "int8":
            loader = data.build_loader(calibration, batch_size=CALIBRATION_BATCH,
                                       num_workers=num_workers)
            ortq.quantize_static(source, quantized, _calibration_reader(loader),
                                 quant_format=ortq.QuantFormat.QDQ, per_channel=True,
                                 activation_type=ortq.QuantType.QUInt8,
                                 weight_type=ortq.QuantType.QInt8,
                                 calibrate_method=ortq.CalibrationMethod.MinMax)
        else:
            ortq.quantize_dynamic(source, quantized, per_channel=True,
                                  weight_type=ortq.QuantType.QInt8)
    except (OSError, UserError):
        raise
    except Exception as e:
        remedy = "; try --quantize int8-dynamic" if kind == "int8" else ""
        raise QuantizationError(f"--quantize {kind}: onnxruntime could not quantize "
                                f"{fp32_path} ({_one_line(e)}){remedy}; {fp32_path} is "
                                f"written") from None
    finally:
        if loader is not None:
            data.shutdown_loader(loader)


def _set_metadata(model, metadata):
    """Puts ``metadata`` into an ONNX model's metadata_props (replacing equal keys)."""
    for prop in model.metadata_props:
        if prop.key in metadata:
            prop.value = metadata[prop.key]
    known = {prop.key for prop in model.metadata_props}
    for key, value in metadata.items():
        if key not in known:
            model.metadata_props.add(key=key, value=value)


def _save_and_try(model, path, flag):
    """Saves the int8 model to ``path`` and runs it in a fresh session at several batch
    sizes; raises QuantizationError when it does not load or gives the wrong shapes."""
    import onnx

    onnx.save(model, path)
    try:
        session = _onnx_session(path)
        run = _onnx_runner(session)
        classes = session.get_outputs()[0].shape[1]
        shape = session.get_inputs()[0].shape[1:]
        g = torch.Generator().manual_seed(0)
        for n in EXPORT_BATCHES:
            out = run(torch.randn(n, *shape, generator=g))
            if tuple(out.shape) != (n, classes) or not bool(torch.isfinite(out).all()):
                raise ValueError(f"batch {n} gave {tuple(out.shape)} outputs, "
                                 f"{'' if torch.isfinite(out).all() else 'not '}finite")
    except Exception as e:
        raise QuantizationError(f"{flag}: the int8 file does not run in onnxruntime "
                                f"({_one_line(e)}); nothing was written") from None


def _one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else 'no message'}"


def compare_onnx(args, net, val_set, train_set, config, batch_size, report, metadata):
    """Evaluates the ONNX export (and writes and evaluates its int8 copy) next to the eager
    network; prints the comparison, warns about an accuracy drop; fills report["export"].
    """
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    rows = {"eager": measured(report, weights_bytes(net), samples_per_second(net, shape))}
    files = [("onnx fp32", args.export)]
    summary = report["export"]
    if args.quantize:
        path = int8_path(args.export)
        calibration = None
        if args.quantize == "int8":
            seed = config["seed"] if args.seed is None else args.seed
            wanted = args.calibration_samples or CALIBRATION_SAMPLES
            calibration = calibration_set(train_set, wanted, seed)
            summary.update(calibration_samples=len(calibration), calibration_seed=seed)
        seconds, _ = quantize(args.export, path, args.quantize, calibration,
                              args.num_workers, metadata)
        summary.update(quantize=args.quantize, int8_file=path, quantize_seconds=seconds)
        print(f"quantized {args.export} to {path} in {seconds:.2f} s: "
              f"{QUANTIZE_KINDS[args.quantize]}"
              + (f"; {len(calibration)} calibration images, seed {seed}" if calibration
                 else ""))
        files.append((f"onnx {args.quantize}", path))
    for name, path in files:
        run = _load_onnx(path)
        result = evaluate_exported(run, val_set, batch_size, args.num_workers)
        file_report = make_report(path, result, val_set.classes, key="model")
        rows[name] = measured(file_report, os.path.getsize(path),
                              samples_per_second(run, shape), rows["eager"], path)
    print(format_comparison(rows, THROUGHPUT_BATCH))
    summary.update(throughput_batch_size=THROUGHPUT_BATCH, threads=torch.get_num_threads(),
                   models=rows)
    if args.quantize:
        drop = rows["eager"]["accuracy"] - rows[f"onnx {args.quantize}"]["accuracy"]
        summary.update(accuracy_drop=drop, max_accuracy_drop=args.max_accuracy_drop,
                       accuracy_warning=drop > args.max_accuracy_drop)
        if drop > args.max_accuracy_drop:
            print(f"warning: the {args.quantize} file's accuracy is {drop:.4f} below the "
                  f"eager network's (more than --max-accuracy-drop "
                  f"{args.max_accuracy_drop:g}); quantization-aware training (fine-tuning "
                  f"with simulated int8, e.g. torch.ao.quantization's QAT) is the remedy"
                  + ("; more --calibration-samples or --quantize int8-dynamic may help"
                     if args.quantize == "int8" else ""), file=sys.stderr)


# ------------------------------------------------------------------ --model FILE

def open_exported(path, suffix):
    """Loads a file written by --export, for the CPU.

    Returns:
        ``(run, metadata, sample_shape, outputs)``: a callable on float32 batches, the
        metadata stored at export (a dict of strings; empty when there is none), and the
        input's ``(C, H, W)`` and the number of outputs where the file states them (ONNX,
        None otherwise or where a dimension is dynamic).
    """
    if not os.path.isfile(path):
        raise UserError(f"--model {path!r} does not exist" if not os.path.exists(path)
                        else f"--model {path!r} is not a file")
    shape = outputs = None
    try:
        if suffix == ".onnx":
            session = _onnx_session(path)
            inputs = session.get_inputs()
            if len(inputs) != 1 or len(session.get_outputs()) != 1:
                raise ValueError(f"{len(inputs)} inputs and {len(session.get_outputs())} "
                                 f"outputs, not one of each")
            dims = inputs[0].shape[1:]
            shape = tuple(dims) if all(isinstance(d, int) for d in dims) else None
            out = session.get_outputs()[0].shape
            outputs = out[1] if len(out) == 2 and isinstance(out[1], int) else None
            return (_onnx_runner(session), dict(session.get_modelmeta().custom_metadata_map),
                    shape, outputs)
        extra = {METADATA_FILE: ""}
        if suffix == ".pt2":
            # torch.export.load logs a traceback before raising on a file that is no .pt2
            with _logger_silenced("torch.export"):
                module = _load_pt2(path, extra)
        else:
            module = _load_ts(path, extra)
    except Exception as e:
        raise UserError(f"--model {path!r} cannot be loaded as {EXPORT_KINDS[suffix]} "
                        f"({_one_line(e)})") from None
    text = extra[METADATA_FILE]
    text = text.decode() if isinstance(text, bytes) else text
    try:
        metadata = json.loads(text) if text else {}
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise UserError(f"--model {path!r}: its {METADATA_FILE} is not a JSON object")
    return (lambda x: module(x)), metadata, shape, outputs


@contextlib.contextmanager
def _logger_silenced(name):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _stored(metadata, key, path, default=None):
    """A JSON value of the metadata, or ``default`` when absent; UserError when unreadable."""
    if key not in metadata:
        return default
    try:
        return json.loads(metadata[key])
    except (TypeError, ValueError):
        raise UserError(f"--model {path!r}: its metadata {key!r} is not JSON "
                        f"({_short(metadata[key])})") from None


def apply_data_flags(config, args):
    """The data flags given on the command line override the training run's values."""
    for key in ("dataset", "data_dir", "image_size", "num_classes", "synthetic_size"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    return config


def exported_config(args, metadata, shape, outputs):
    """The config that evaluates a --model file: train.py's defaults < what the file
    states (metadata; the input's shape and the number of outputs of an ONNX file) <
    the flags given."""
    path = args.model
    stored = _stored(metadata, "training_config", path, {})
    if not isinstance(stored, dict):
        raise UserError(f"--model {path!r}: its training_config is not a JSON object")
    if not stored and args.dataset is None:
        raise UserError(f"--model {path!r} holds no training config (it was not written by "
                        f"test.py --export): pass --dataset and what it needs (--data-dir; "
                        f"--image-size, --num-classes, --synthetic-size...)")
    config, _ = train_defaults([])
    if shape is not None:
        config.update(in_channels=shape[0], image_size=shape[1])
    if outputs is not None:
        config["num_classes"] = outputs
    config.update(stored)
    config["augment"] = False
    return apply_data_flags(config, args)


def check_exported_data(args, metadata, val_set, config, shape):
    """The data must be what the file was exported for: its input shape, its classes and
    its normalisation; a mismatch (a wrong --data-dir or --dataset) is a UserError."""
    path = args.model
    if "normalize" in metadata:
        stored = _stored(metadata, "normalize", path)
        stats = data.STATS.get(config["dataset"])
        now = None if stats is None else {"mean": list(stats[0]), "std": list(stats[1])}
        if stored != now:
            raise UserError(f"--model {path!r} was exported for inputs {_normalised(stored)}; "
                            f"--dataset {config['dataset']} {_normalised(now, 'them ')}")
    have = (val_set.in_channels, val_set.image_size, val_set.image_size)
    if shape is not None and tuple(shape) != have:
        raise UserError(f"--model {path!r} takes {_shape(shape)} images; the data gives "
                        f"{_shape(have)} (check --dataset and --image-size)")
    classes = _stored(metadata, "classes", path)
    if classes is not None and classes != val_set.classes:
        raise UserError(f"--model {path!r} was exported for the classes {_names(classes)}; "
                        f"the data has {_names(val_set.classes)} (check --data-dir)")


def _normalised(stats, them=""):
    if not isinstance(stats, dict):
        return "not normalised" if them == "" else "does not normalise"
    return f"normalise{'s ' + them if them else 'd '}with mean {stats.get('mean')}, std " \
           f"{stats.get('std')}"


def _shape(shape):
    return "x".join(str(d) for d in shape)


def _names(names, limit=6):
    shown = ", ".join(str(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def evaluate_model_file(args):
    """--model FILE: evaluates an exported file on the validation split; returns 0."""
    path = args.model
    suffix = os.path.splitext(path)[1].lower()
    run, metadata, shape, outputs = open_exported(path, suffix)
    config = exported_config(args, metadata, shape, outputs)
    check_config(config, path, need_batch_size=False)
    batch_size = args.batch_size or config["batch_size"]
    _, val_set = data.build_datasets(config)
    check_exported_data(args, metadata, val_set, config, shape)
    result = evaluate_exported(run, val_set, batch_size, args.num_workers)
    report = make_report(path, result, val_set.classes, key="model")
    sample_shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    report.update(format=EXPORT_KINDS[suffix], quantization=metadata.get("quantization"),
                  bytes=os.path.getsize(path), throughput_batch_size=THROUGHPUT_BATCH,
                  threads=torch.get_num_threads(),
                  samples_per_sec=samples_per_second(run, sample_shape))
    source = _stored(metadata, "source", path, {}) or {}
    origin = "" if not isinstance(source, dict) or source.get("epoch") is None else \
        f", exported at epoch {source['epoch']}, step {source.get('step', '?')}"
    quantized = report["quantization"] not in (None, "none")
    title = (f"model {path} ({EXPORT_KINDS[suffix]}"
             f"{', ' + report['quantization'] if quantized else ''}{origin}): "
             f"{config['network']} on {config['dataset']}")
    print(format_report(report, {}, config, title=title))
    print(f"file {_size(report['bytes'])}; {report['samples_per_sec']:.1f} samples/s on the "
          f"CPU at batch {THROUGHPUT_BATCH}, {torch.get_num_threads()} threads", flush=True)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


# ------------------------------------------------------------------------------ main

def main(argv=None):
    """Evaluates (and exports) a checkpoint with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        exported artifact's outputs differ from the eager network's, quantization failed,
        or an output could not be written (one ``error:`` line; a file that was there is
        left as it was).
    """
    try:
        return evaluate_and_export(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # checkpoint.CheckpointError included
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (OutputError, QuantizationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def evaluate_and_export(argv):
    """The script: flags, checkpoint, evaluation, report, export; returns the exit code."""
    # 1. Flags, checked before any slow work.
    args = build_parser().parse_args(argv)
    suffix = check_args(args)
    device = runtime.parse_device(args.device)
    check_outputs(args)
    if args.model is not None:
        return evaluate_model_file(args)

    # 2. The checkpoint and the training run's config.
    state = load_training_checkpoint(args.checkpoint)
    config = apply_data_flags(dict(state["config"]), args)
    check_config(config, args.checkpoint, need_batch_size=args.batch_size is None)
    batch_size = args.batch_size or config["batch_size"]

    # 3. Data and network, evaluated as training validated (the training split unaugmented:
    #    --quantize int8 calibrates on it).
    train_set, val_set = data.build_datasets(dict(config, augment=False))
    weights = choose_weights(state, args.weights, args.checkpoint)
    tta = (args.tta or config.get("tta", "none")) == "flip" and \
        data.mirror_keeps_class(config["dataset"])
    net = load_network(state, config, val_set, args.checkpoint, weights)
    result = evaluate(net, val_set, config, device, batch_size, args.num_workers, tta)
    report = make_report(args.checkpoint, result, val_set.classes)
    report.update(weights=weights, tta="flip" if tta else "none")
    print(format_report(report, state, config), flush=True)

    # 4. Export: a fresh CPU network, checked against itself after reloading; an ONNX file
    #    is also evaluated (and quantized). The JSON holds whatever was done.
    failure, code = None, 0
    if suffix is not None:
        try:
            code = export_and_compare(args, suffix, net, state, config, train_set, val_set,
                                      batch_size, report)
        except (OutputError, QuantizationError) as e:
            failure = e
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if failure is not None:
        raise failure
    return code


def export_and_compare(args, suffix, net, state, config, train_set, val_set, batch_size,
                       report):
    """--export (and --quantize): writes, checks and measures; returns the exit code."""
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    metadata = export_metadata(config, val_set, state, args.checkpoint)
    ok, worst = export(net, args.export, suffix, shape, metadata)
    sizes = ", ".join(str(n) for n in sorted(EXPORT_BATCHES))
    if not ok:
        print(f"error: the {EXPORT_KINDS[suffix]} artifact's outputs differ from the eager "
              f"network's (max abs difference {worst:.3g} at batch sizes {sizes}; tolerance "
              f"rtol {EXPORT_RTOL:g}, atol {EXPORT_ATOL:g}); {args.export} not written",
              file=sys.stderr)
        return EXIT_FAILED
    size = os.path.getsize(args.export)
    report["export"] = {"format": EXPORT_KINDS[suffix], "file": args.export, "bytes": size,
                        "max_abs_diff": worst}
    print(f"exported {EXPORT_KINDS[suffix]} to {args.export} ({_size(size)}, dynamic batch); "
          f"max abs difference from the eager network {worst:.3g} at batch sizes {sizes}",
          flush=True)
    if suffix == ".onnx":
        compare_onnx(args, net, val_set, train_set, config, batch_size, report, metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
