"""Evaluate a trained checkpoint, or a file exported from one.

    python test.py --checkpoint runs/exp1/checkpoints/best.pt
    python test.py --checkpoint runs/exp1/checkpoints/last.pt --json results.json
    python test.py --checkpoint best.pt --export model.pt2    # torch.export (Python serving)
    python test.py --checkpoint best.pt --export model.ts     # frozen TorchScript (C++, mobile)
    python test.py --checkpoint best.pt --export model.onnx   # ONNX (onnxruntime, TensorRT...)
    python test.py --checkpoint best.pt --export model.onnx --quantize int8  # + model.int8.onnx
    python test.py --model model.int8.onnx                    # evaluate a file you ship
    python test.py --checkpoint made.pt --samples 64 --out samples/  # images made: PNGs
    python test.py --checkpoint made.pt --fid-samples 10000 --export generator.onnx
    python test.py --checkpoint det.pt --samples 8 --out boxes/ --predictions results.json

The network is rebuilt from the checkpoint's config and evaluated on the validation (or
test) split the way training validated it: eval mode, the same transforms, batch size,
autocast and memory format. So the accuracy printed here equals the ``val_acc`` that
training logged in metrics.jsonl for that checkpoint. ``evaluate_and_export`` is the
script, top to bottom.

Exporting, checking an exported file, quantizing and opening an exported file live in
export.py. After an ONNX export this script evaluates each file itself, through
onnxruntime, next to the eager network (``compare_onnx``): loss, accuracy, per-class
accuracy, file size and CPU samples/s at batch 64 (THROUGHPUT_BATCH); an int8 accuracy
drop beyond ``--max-accuracy-drop`` is a warning.

The checkpoint of a task that makes images (``Task.generates``) holds a generator, not
predictions: its images of the run's seeded inputs as PNGs, FID and KID against the first
validation images (gan_metrics.py), and the generator's export are what test.py gives for
it (the task's ``test_checkpoint``); the accuracy table and --tta are refused in one line.
A task of predictions may have its own report too (detection's: ``test_checkpoint``) and
flags of its own (``Report.test_flags``: --predictions), refused for other checkpoints.

Every output (--json, --export, the int8 file and --out) is checked to be writable before
anything is loaded; a write that fails later (a full disk) is one ``error:`` line, exit
code 1, and the file that was there before is left as it was.

This file is not importable as ``test`` (the standard library owns that name): run it,
or load it by path as tests/helpers.py does (load_test_py).
"""

import argparse
import copy
import json
import os
import sys
import warnings

import torch

import export
import tasks
from config import OneLineParser, with_defaults
from export import (  # noqa: F401
    EXPORT_BATCHES,
    EXPORT_KINDS,
    QUANTIZE_KINDS,
    THROUGHPUT_BATCH,
    OutputError,
    QuantizationError,
    format_comparison,
    measured,
    samples_per_second,
    size_text,  # (test.py's names: bench/export.py)
    weights_bytes,
)
from machinery import checkpoint, engine, files, runtime
from machinery.runtime import say, shown
from ops import UserError
from pipeline import data

EXIT_USER_ERROR, EXIT_FAILED = 2, 1


# ----------------------------------------------------------------------------- flags

def build_parser():
    """The command-line flags."""
    p = OneLineParser(prog="test.py", description="Evaluate a checkpoint (or an exported "
                      "file) on the validation/test split, and optionally export and quantize "
                      "the network for inference.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint written by train.py, e.g. "
                        "runs/exp1/checkpoints/best.pt")
    own = [t for t in tasks.built_in() if t.test_checkpoint is not None]  # own reports
    source.add_argument("--model", metavar="FILE", help="evaluate a file written by "
                        "--export (.onnx, int8 .onnx, .pt2, .ts, .safetensors), on the CPU, "
                        "without the checkpoint: the dataset, image size, classes and "
                        "normalisation stored in it at export apply (the flags below "
                        f"override them); not a --task {', '.join(t.name for t in own)} one")
    add("--task", default=None, metavar="FILE.py:Class", help="the task file of a run "
        "trained with --task FILE.py:Class: a checkpoint's own never is imported (it is "
        "code); name it here if you trust it")
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
        "'logits'; evaluated through onnxruntime next to the eager network) or .safetensors "
        "(weights and metadata, read with no code run); checked against the eager network")
    add("--quantize", default=None, choices=list(QUANTIZE_KINDS), help="with --export "
        "OUT.onnx: also write an int8 copy next to OUT (model.onnx -> model.int8.onnx) "
        "with onnxruntime.quantization: int8 = static (QDQ, per-channel weights, "
        "activations calibrated on training images), int8-dynamic = weights only, for "
        "networks where static fails")
    add("--calibration-samples", type=int, default=None, metavar="N", help="--quantize "
        f"int8: calibrate on N training images (default {export.CALIBRATION_SAMPLES}; all of them "
        "when the split is smaller)")
    add("--seed", type=int, default=None, help="--quantize int8: which training images "
        "calibrate (the same seed gives the same int8 file); a task that makes images: "
        "the seed of its inputs (latents, noise) and of KID's subsets; "
        "default: the training run's seed")
    add("--max-accuracy-drop", type=float, default=0.01, metavar="DELTA", help="warn when "
        "the int8 file's accuracy is more than DELTA (0.01 = 1 point) below the eager "
        "network's")
    making, drawing = (", ".join(t.name for t in own if t.generates == g) for g in (1, 0))
    made = p.add_argument_group(f"a checkpoint of a task that makes images (--task {making})",
                                "its generator (the moving average by default: --weights), "
                                "from the fixed inputs of --seed; --export writes it: its "
                                "inputs in, images (N, C, H, W) in [-1, 1] out. --samples "
                                f"and --out also serve --task {drawing}: the first "
                                "validation images with their predictions drawn")
    made.add_argument("--samples", type=int, default=None, metavar="N", help="write N "
                      "images as PNGs into --out (000000.png, ...): the same command writes "
                      "the same files")
    made.add_argument("--out", default=None, metavar="DIR", help="where --samples writes "
                      "(created if need be)")
    made.add_argument("--fid-samples", type=int, default=None, metavar="N", help="FID and "
                      "KID of N generated images against the first N validation images, "
                      "on Inception-v3 (its weights file under TORCH_HOME, never downloaded)")
    made.add_argument("--fid-features", default=None, metavar="CHECKPOINT", help="with "
                      "--fid-samples: on the penultimate features of a classifier this "
                      "project trained instead (fid_classifier, kid_classifier: comparable "
                      "only with the same checkpoint)")
    made.add_argument("--sample-steps", type=int, default=None, metavar="N", help="a task "
                      "that samples in steps: the timesteps a sample walks (default: the "
                      "training run's)")
    made.add_argument("--sampler", default=None, help="a task that samples in steps: how "
                      "(its --sampler choices; default: the training run's)")
    tasks.add_test_flags(p)  # each task's own (detection's --predictions)
    return p


def check_args(args):
    """Rejects impossible values before any work; returns the export suffix or None."""
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if args.num_workers < 0:
        raise UserError("--num-workers must not be negative")
    for flag, value, low in (("--image-size", args.image_size, 1),
                             ("--num-classes", args.num_classes, 2),
                             ("--synthetic-size", args.synthetic_size, 1),
                             ("--calibration-samples", args.calibration_samples, 1),
                             ("--samples", args.samples, 1),
                             ("--fid-samples", args.fid_samples, 2)):  # two covariances
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}")
    if not 0 <= args.max_accuracy_drop <= 1:  # NaN fails too
        raise UserError(f"--max-accuracy-drop must be in [0, 1] (0.01 = 1 point), not "
                        f"{args.max_accuracy_drop}")
    for flag, path in (("--json", args.json), ("--export", args.export),
                       ("--checkpoint", args.checkpoint), ("--model", args.model),
                       ("--out", args.out), ("--fid-features", args.fid_features),
                       *tasks.test_outputs(args)):
        if path is not None and not path.strip():
            raise UserError(f"{flag} needs a {'directory' if flag == '--out' else 'file'} "
                            f"name")
    _check_sample_args(args)
    if args.model is not None:
        _check_model_args(args)
    if args.calibration_samples is not None and args.quantize != "int8":
        without = f"with --quantize {args.quantize}" if args.quantize else "without it"
        raise UserError(f"--calibration-samples is for --quantize int8 (static); {without} "
                        f"nothing is calibrated")
    if args.seed is not None and args.quantize != "int8" and \
            not (args.samples or args.fid_samples):
        raise UserError("--seed picks the calibration images of --quantize int8, or the "
                        "inputs of a generator's --samples and --fid-samples; it does "
                        "nothing without them")
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
        export.check_onnx_installed("--export .onnx")
    return suffix


def _check_sample_args(args):
    """--samples goes with --out, --fid-features with --fid-samples; none with --model."""
    if (args.samples is None) != (args.out is None):
        raise UserError("--samples N needs --out DIR (where the PNGs go)" if args.out is None
                        else "--out DIR is where --samples N writes; give --samples")
    if args.fid_features is not None and args.fid_samples is None:
        raise UserError("--fid-features CHECKPOINT picks the features of FID; give "
                        "--fid-samples N too")
    given = [flag for flag, value in (("--samples", args.samples),
                                      ("--fid-samples", args.fid_samples)) if value]
    if args.model is not None and given:
        raise UserError(f"{given[0]} needs --checkpoint (of a task that makes or draws "
                        f"images): --model evaluates an exported network's predictions")


def _check_model_args(args):
    suffix = os.path.splitext(args.model)[1].lower()
    if suffix not in EXPORT_KINDS:
        raise UserError(f"--model {args.model!r}: unknown suffix {suffix or '(none)'!r}; "
                        f"it takes a file written by --export ({', '.join(EXPORT_KINDS)})")
    if args.export is not None or args.quantize is not None:
        flag = "--export" if args.export is not None else "--quantize"
        raise UserError(f"{flag} needs --checkpoint: --model only evaluates an exported "
                        f"file")
    tasks.refuse_test_flags(args, None, args.model)
    if args.device not in ("auto", "cpu"):
        raise UserError(f"--model files are evaluated on the CPU, as they were exported; "
                        f"drop --device {args.device}")
    if suffix == ".onnx":
        export.check_onnx_installed("--model .onnx")


def check_output(flag, path, checkpoint_path):
    """Rejects an output that could not be written, before any slow work.

    The nearest existing directory above ``path`` must take a new file
    (``files.probe_writable``).

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
    _check_writable(flag, path, os.path.dirname(os.path.abspath(path)))


def _check_writable(flag, path, directory):
    """The nearest existing directory at or above ``directory`` takes a new file."""
    existing = directory
    while not os.path.exists(existing):  # created when written
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path!r}: {existing!r} is a file, not a directory")
    try:
        files.probe_writable(existing)
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {existing!r} "
                        f"({e.strerror or e})") from None


def check_output_dir(flag, path):
    """Rejects an output directory (--out) that is a file or could not be written in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path!r} exists and is not a directory; name a directory")
    _check_writable(flag, path, os.path.abspath(path))


def check_outputs(args):
    """check_output for --json, --export and the int8 file, which must be different files,
    and check_output_dir for --out."""
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--export", args.export),
                                               *tasks.test_outputs(args)) if path]
    if args.quantize:
        outputs.append((f"--quantize {args.quantize}", export.int8_path(args.export)))
    for flag, path in outputs:
        check_output(flag, path, args.checkpoint or args.model)
    if args.out is not None:
        check_output_dir("--out", args.out)
        outputs.append(("--out", args.out))
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
        values), or for a task of named networks ``networks[name]`` one (and
        ``ema[name]`` where there is a moving average; ``name``: the task's
        ``averaged_name``: a generator), and ``config`` a dict.

    Raises:
        checkpoint.CheckpointError: anything else, in one line.
    """
    with warnings.catch_warnings():  # a sparse tensor's check; the weights are refused below
        warnings.filterwarnings("ignore", message="Validating sparse tensor invariants")
        state = checkpoint.load_checkpoint(path)
    if not ({"model", "networks"} & set(state)) or \
            not ({"config", "progress", "format"} & set(state)):
        raise checkpoint.CheckpointError(f"{path!r} is not a training checkpoint "
                                         f"of this project (no model and config)")
    checkpoint.require(state, path, ("config",), "evaluating rebuilds the network and "
                       "the data from it")
    if not isinstance(state["config"], dict):
        raise checkpoint.CheckpointError(f"{path!r} is not a training checkpoint of this "
                                         f"project: its config is a "
                                         f"{type(state['config']).__name__}, not a dict")
    if "model" in state:
        _check_weights(state["model"], path, "model")
        return state
    name = tasks.of(state["config"]).averaged_name or "generator"  # the network it reads
    for what, key in ((name, "networks"), (f"moving average of the {name}", "ema")):
        if key in state:
            held = state[key]
            if not isinstance(held, dict) or name not in held:
                raise checkpoint.CheckpointError(f"{path!r}: its {key} entry holds no "
                                                 f"{name}")
            _check_weights(held[name], path, what)
    return state


def _check_weights(weights, path, what):
    """Raises a CheckpointError unless ``weights`` is a state_dict of plain finite tensors."""
    if not isinstance(weights, dict):
        raise checkpoint.CheckpointError(f"{path!r}: its {what} is a {type(weights).__name__}, "
                                         f"not a state_dict (a dict of tensors)")
    for key, value in weights.items():
        if not isinstance(key, str):
            raise checkpoint.CheckpointError(f"{path!r}: its {what} has a key {shown(key)}, "
                                             f"not a parameter name")
        if not isinstance(value, torch.Tensor):
            raise checkpoint.CheckpointError(f"{path!r}: its {what}'s {key} is "
                                             f"{shown(value)}, not a tensor")
        if value.layout != torch.strided or value.device.type != "cpu" or \
                value.is_complex():
            raise checkpoint.CheckpointError(
                f"{path!r}: its {what}'s {key} is a {value.dtype} {value.layout} tensor on "
                f"{value.device}, not a plain real one")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise checkpoint.CheckpointError(f"{path!r}: its {what}'s {key} holds NaN or "
                                             f"infinite values")


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


def check_stored_config(config, path, need_batch_size):
    """Raises a CheckpointError when a stored config lacks a key that says which run it is
    (network, data, seed; ``batch_size`` when ``need_batch_size``), or holds a senseless
    value for a key that evaluation reads. Keys absent from an older run's config take
    the flags' defaults afterwards (``config.with_defaults``)."""
    needs = list(_CONFIG_NEEDS)
    if need_batch_size:
        needs.append(("batch_size", _int_at_least(1),
                      "an integer of at least 1 (or pass --batch-size)", False))
    if config.get("dataset") == "synthetic":
        needs.extend(_SYNTHETIC_NEEDS)
    needs.extend(tasks.of(config).stored_needs)  # what the task rebuilds its network from
    for key, ok, expected, optional in needs:
        if key not in config:
            if optional:
                continue
            raise checkpoint.CheckpointError(f"{path!r}: its config has no {key}; expected "
                                             f"{expected}")
        if not ok(config[key]):
            raise checkpoint.CheckpointError(f"{path!r}: its config's {key} is "
                                             f"{shown(config[key])}; expected {expected}")


# --------------------------------------------------------------------------- network

def choose_weights(state, which, path):
    """``"ema"`` or ``"raw"``: the weights --weights asks for (auto: ema when present)."""
    if which == "ema" and "ema" not in state:
        raise UserError(f"--weights ema: {path!r} has no moving average (train with "
                        f"--ema-decay)")
    if which == "auto":
        return "ema" if "ema" in state else "raw"
    return which


def load_network(state, config, val_set, path, weights="raw", kind=None):
    """A fresh network holding the checkpoint's weights: CPU, float32, eval mode, contiguous.

    Args:
        state: the loaded checkpoint.
        config: the training run's config.
        val_set: the dataset (its classes, channels and image size shape the network).
        path: the checkpoint file, for messages.
        weights: ``"raw"`` (``model``) or ``"ema"`` (the moving average, ``ema``).
        kind: the task class (None: the config's).

    Returns:
        The nn.Module.
    """
    net = (kind or tasks.of(config)).build_networks(config, val_set)
    tensors = checkpoint.unwrap_state_dict(state["ema" if weights == "ema" else "model"])
    checkpoint.check_compatible(net, tensors, path)
    net.load_state_dict(tensors)  # copies into the fresh (contiguous) tensors
    return net.eval()


# ------------------------------------------------------------------------ evaluation

def evaluate_checkpoint(net, val_set, config, device, batch_size, num_workers, task,
                        tta=False):
    """Evaluates like training's validation (autocast and memory format of the run; with
    ``tta``, each image and its mirror).

    Returns:
        engine.evaluate's dict: the task's figures (``loss``, ``acc``, ``count``, ``confusion``
        of a classifier, ...).
    """
    memory_format = torch.channels_last if config["channels_last"] \
        else torch.contiguous_format
    model = copy.deepcopy(net).to(device, memory_format=memory_format)
    dtype = runtime.amp_dtype(config["amp"], device, remedy="evaluate with --device cpu")
    loop = engine.LoopSettings(device=device, amp_dtype=dtype, memory_format=memory_format,
                               show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers,
                               pin_memory=device.type == "cuda")
    try:
        return engine.evaluate(model, loader, loop, task, tta=tta)
    finally:
        data.shutdown_loader(loader)


def _title(report, state, config):
    extras = "".join(f", {what}" for what, on in (
        ("the moving average of the weights", report.get("weights") == "ema"),
        ("flip TTA", report.get("tta") == "flip")) if on)
    return (f"checkpoint {report['checkpoint']} (epoch {state.get('epoch', '?')}, step "
            f"{state.get('step', '?')}{extras}): {config['network']} on {config['dataset']}")


def write_json(report, path):
    """Writes the report atomically (files.atomic_write).

    Raises:
        OutputError: the write failed (a full disk); a previous file at ``path`` is intact.
    """
    text = json.dumps(report, indent=2) + "\n"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, lambda f: f.write(text))
    except OSError as e:
        raise export.output_failed("--json", path, e) from None


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


def evaluate_exported(run, val_set, batch_size, num_workers, task):
    """Evaluates an exported file's callable on the CPU, with engine.evaluate (as training).

    Returns:
        engine.evaluate's dict: ``loss``, ``acc``, ``count``, ``confusion``.
    """
    loop = engine.LoopSettings(device=torch.device("cpu"), show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers)
    try:
        return engine.evaluate(_Exported(run), loader, loop, task)
    finally:
        data.shutdown_loader(loader)


# ---------------------------------------------------------------------- quantization


def compare_onnx(args, net, val_set, train_set, config, batch_size, report, metadata):
    """Evaluates the ONNX export (and writes and evaluates its int8 copy) next to the eager
    network; prints the comparison, warns about an accuracy drop; fills report["export"].
    """
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    rows = {"eager": measured(report, weights_bytes(net), samples_per_second(net, shape))}
    files = [("onnx fp32", args.export)]
    summary = report["export"]
    if args.quantize:
        path = export.int8_path(args.export)
        calibration = None
        if args.quantize == "int8":
            seed = config["seed"] if args.seed is None else args.seed
            wanted = args.calibration_samples or export.CALIBRATION_SAMPLES
            calibration = export.calibration_set(train_set, wanted, seed)
            summary.update(calibration_samples=len(calibration), calibration_seed=seed)
        seconds, _ = export.quantize(args.export, path, args.quantize, calibration,
                              args.num_workers, metadata)
        summary.update(quantize=args.quantize, int8_file=path, quantize_seconds=seconds)
        say(f"quantized {args.export} to {path} in {seconds:.2f} s: "
            f"{QUANTIZE_KINDS[args.quantize]}"
            + (f"; {len(calibration)} calibration images, seed {seed}" if calibration
               else ""))
        files.append((f"onnx {args.quantize}", path))
    for name, path in files:
        run = export.load_onnx(path)
        task = tasks.built(tasks.of(config), config, val_set)
        result = evaluate_exported(run, val_set, batch_size, args.num_workers, task)
        file_report = task.report(result, "model", path)
        rows[name] = measured(file_report, os.path.getsize(path),
                              samples_per_second(run, shape), rows["eager"], path)
    say(format_comparison(rows, THROUGHPUT_BATCH))
    summary.update(throughput_batch_size=THROUGHPUT_BATCH, threads=torch.get_num_threads(),
                   models=rows)
    if args.quantize:
        drop = rows["eager"]["accuracy"] - rows[f"onnx {args.quantize}"]["accuracy"]
        summary.update(accuracy_drop=drop, max_accuracy_drop=args.max_accuracy_drop,
                       accuracy_warning=drop > args.max_accuracy_drop)
        if drop > args.max_accuracy_drop:
            say(f"warning: the {args.quantize} file's accuracy is {drop:.4f} below the "
                f"eager network's (more than --max-accuracy-drop "
                f"{args.max_accuracy_drop:g}); quantization-aware training (fine-tuning "
                f"with simulated int8, e.g. torch.ao.quantization's QAT) is the remedy"
                + ("; more --calibration-samples or --quantize int8-dynamic may help"
                   if args.quantize == "int8" else ""), file=sys.stderr)


# ------------------------------------------------------------------ --model FILE


def apply_data_flags(config, args):
    """The data flags given on the command line override the training run's values."""
    for key in ("task", "dataset", "data_dir", "image_size", "num_classes", "synthetic_size"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    return config


def exported_config(args, metadata, shape, outputs):
    """The config that evaluates a --model file: train.py's defaults < what the file
    states (metadata; the input's shape and the number of outputs of an ONNX file) <
    the flags given."""
    path = args.model
    stored = export.stored_value(metadata, "training_config", path, {})
    if not isinstance(stored, dict):
        raise UserError(f"--model {path!r}: its training_config is not a JSON object")
    if tasks.of(stored).generates:
        raise UserError(f"--model {path!r} is a {stored.get('task')} generator (it makes images): "
                        f"there is nothing to evaluate on a validation split; run test.py "
                        f"--checkpoint with --samples or --fid-samples on its checkpoint")
    if tasks.of(stored).test_checkpoint is not None:  # (its own report, of a checkpoint)
        raise UserError(f"--model {path!r} is a {stored.get('task')} network: test.py "
                        f"evaluates it from its checkpoint (--checkpoint), not its export")
    if not stored and args.dataset is None:
        raise UserError(f"--model {path!r} holds no training config (it was not written by "
                        f"test.py --export): pass --dataset and what it needs (--data-dir; "
                        f"--image-size, --num-classes, --synthetic-size...)")
    found = {}  # what an ONNX file's graph says
    if shape is not None and len(shape) == 3:  # (C, H, W); not a generator's (latent,)
        found.update(in_channels=shape[0], image_size=shape[1])
    if outputs is not None:
        found["num_classes"] = outputs
    config = with_defaults({**found, **stored, "augment": False})
    return apply_data_flags(config, args)


def evaluate_model_file(args):
    """--model FILE: evaluates an exported file on the validation split; returns 0."""
    path = args.model
    suffix = os.path.splitext(path)[1].lower()
    run, metadata, shape, outputs = export.open_exported(path, suffix)
    config = exported_config(args, metadata, shape, outputs)
    check_stored_config(config, path, need_batch_size=False)
    batch_size = args.batch_size or config["batch_size"]
    kind = tasks.of(config)  # the task class, looked up once
    _, val_set = kind.datasets(config, say)
    export.check_exported_data(path, metadata, val_set, config, shape)
    task = tasks.built(kind, config, val_set)
    result = evaluate_exported(run, val_set, batch_size, args.num_workers, task)
    report = task.report(result, "model", path)
    sample_shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    report.update(format=EXPORT_KINDS[suffix], quantization=metadata.get("quantization"),
                  bytes=os.path.getsize(path), throughput_batch_size=THROUGHPUT_BATCH,
                  threads=torch.get_num_threads(),
                  samples_per_sec=samples_per_second(run, sample_shape))
    source = export.stored_value(metadata, "source", path, {}) or {}
    origin = "" if not isinstance(source, dict) or source.get("epoch") is None else \
        f", exported at epoch {source['epoch']}, step {source.get('step', '?')}"
    quantized = report["quantization"] not in (None, "none")
    title = (f"model {path} ({EXPORT_KINDS[suffix]}"
             f"{', ' + report['quantization'] if quantized else ''}{origin}): "
             f"{config['network']} on {config['dataset']}")
    say(task.format_report(report, title))
    say(f"file {size_text(report['bytes'])}; {report['samples_per_sec']:.1f} samples/s on the "
        f"CPU at batch {THROUGHPUT_BATCH}, {torch.get_num_threads()} threads")
    if args.json:
        write_json(report, args.json)
        say(f"wrote {args.json}")
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
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # flags that do not parse exit as argparse does (--help: 0)
        say(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    try:
        return evaluate_and_export(args)
    except UserError as e:  # checkpoint.CheckpointError included
        say(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (OutputError, QuantizationError) as e:
        say(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def evaluate_and_export(args):
    """The script: flags, checkpoint, evaluation, report, export; returns the exit code."""
    # 1. Flags, checked before any slow work.
    if args.task is not None:  # a task file: imported only when named here
        tasks.allow(args.task)
    suffix = check_args(args)
    device = runtime.select_device(runtime.parse_device(args.device))
    check_outputs(args)
    if args.model is not None:
        return evaluate_model_file(args)

    # 2. The checkpoint and the training run's config.
    state = load_training_checkpoint(args.checkpoint)
    stored = apply_data_flags(dict(state["config"]), args)  # what identifies the run and
    check_stored_config(stored, args.checkpoint, need_batch_size=args.batch_size is None)
    config = with_defaults(stored)  # must be there; flags added since take their defaults
    batch_size = args.batch_size or config["batch_size"]
    kind = tasks.of(config)  # the task: what is reported of its checkpoints
    if args.quantize and not kind.measured_export:
        raise UserError(f"--quantize measures a classifier's accuracy cost; {args.checkpoint!r} "
                        f"is a {config['task']} checkpoint: export it without --quantize")
    for key in ("sample_steps", "sampler"):  # read by the tasks that own the flag alone
        if getattr(args, key) is not None and key not in kind.own_flags:
            raise UserError(f"--{key.replace('_', '-')} is for a task that samples in steps; "
                            f"{args.checkpoint!r} is a {config['task']} checkpoint")
    tasks.refuse_test_flags(args, kind, args.checkpoint)  # another task's own flags
    kind.check_test_flags(args, args.checkpoint)
    weights = choose_weights(state, args.weights, args.checkpoint)
    if kind.test_checkpoint is not None:  # images made, or the task's own report
        return evaluate_own(args, suffix, kind, state, config, device, batch_size, weights)

    # 3. Data and network, evaluated as training validated (the training split unaugmented:
    #    --quantize int8 calibrates on it).
    train_set, val_set = kind.datasets(dict(config, augment=False), say)
    task = tasks.built(kind, config, val_set)
    tta = (args.tta or config["tta"]) == "flip" and \
        data.mirror_keeps_class(config["dataset"])
    net = load_network(state, config, val_set, args.checkpoint, weights, kind)
    result = evaluate_checkpoint(net, val_set, config, device, batch_size, args.num_workers,
                                 task, tta)
    net = task.inference_network(net)  # (a network whose forward returns a dict: the logits)
    report = task.report(result, "checkpoint", args.checkpoint)
    report.update(weights=weights, tta="flip" if tta else "none")
    say(task.format_report(report, _title(report, state, config)))

    # 4. Export: a fresh CPU network, checked against itself after reloading; an ONNX file
    #    is also evaluated (and quantized). The JSON holds whatever was done.
    export_step = None if suffix is None else lambda: export_and_compare(
        args, suffix, net, state, config, train_set, val_set, batch_size, report)
    return export_and_report(args, report, export_step)


def evaluate_own(args, suffix, kind, state, config, device, batch_size, weights):
    """A checkpoint of a task with its own report (``kind.test_checkpoint``: a generator's,
    detection's): its figures, --samples, its own flags, then --export of the network it
    names and --json; returns the exit code."""
    report, (generator, shape, described, names) = kind.test_checkpoint(
        args, state, config, device, batch_size, weights)

    def export_generator():  # the CPU generator, checked
        metadata = export.generator_metadata(config, state, args.checkpoint, weights,
                                             described)
        ok = export_checked(args, suffix, generator, shape, metadata, report, names)
        return 0 if ok else EXIT_FAILED

    return export_and_report(args, report, export_generator if suffix else None)


def export_and_report(args, report, export_step):
    """Runs ``export_step`` (or nothing: None), then writes --json whatever it did; a
    write or quantization failure is raised after the JSON is written. Returns the exit
    code."""
    failure, code = None, 0
    if export_step:
        try:
            code = export_step()
        except (OutputError, QuantizationError) as e:
            failure = e
    if args.json:
        write_json(report, args.json)
        say(f"wrote {args.json}")
    if failure is not None:
        raise failure
    return code


def export_and_compare(args, suffix, net, state, config, train_set, val_set, batch_size,
                       report):
    """--export (and --quantize): writes, checks and measures; returns the exit code."""
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    metadata = export.export_metadata(config, val_set, state, args.checkpoint)
    if not export_checked(args, suffix, net, shape, metadata, report):
        return EXIT_FAILED
    if suffix == ".onnx" and tasks.of(config).measured_export:  # measured: accuracy
        compare_onnx(args, net, val_set, train_set, config, batch_size, report, metadata)
    return 0


def export_checked(args, suffix, net, shape, metadata, report, names=None):
    """export.export_network to --export, and its parity check said: the ``error:`` line
    (False), or report["export"] and a line (True). ``names``: ONNX's input and output."""
    ok, worst = export.export_network(net, args.export, suffix, shape, metadata, names)
    sizes = ", ".join(str(n) for n in sorted(EXPORT_BATCHES))
    if not ok:
        say(f"error: the {EXPORT_KINDS[suffix]} artifact's outputs differ from the eager "
            f"network's (max abs difference {worst:.3g} at batch sizes {sizes}; tolerance "
            f"rtol {export.EXPORT_RTOL:g}, atol {export.EXPORT_ATOL:g}); {args.export} not "
            f"written", file=sys.stderr)
        return False
    size = os.path.getsize(args.export)
    report["export"] = {"format": EXPORT_KINDS[suffix], "file": args.export, "bytes": size,
                        "max_abs_diff": worst}
    say(f"exported {EXPORT_KINDS[suffix]} to {args.export} ({size_text(size)}, dynamic batch); "
        f"max abs difference from the eager network {worst:.3g} at batch sizes {sizes}")
    return True


if __name__ == "__main__":
    sys.exit(main())
