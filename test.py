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

Every task goes through one checkpoint route (``evaluate_and_export``): load, choose the
weights, build the sets, evaluate with the task's own ``evaluation`` (its validation: a
GAN's FID is its run's FID), say the one title line, report; then the task adds what it
writes besides its figures (``outputs``: a generator's PNGs, a detector's COCO results)
and what --export writes (``exported``: a generator, where that is what it ships). The
tasks' own flags (--samples, --fid-samples, --predictions, ...) are theirs
(``TestFlags``), read through a ``Request`` (tasks/_report.py); test.py names no kind of task.

Every output (--json, --export, the int8 file and --out) is checked to be writable before
anything is loaded; a write that fails later (a full disk) is one ``error:`` line, exit
code 1, and the file that was there before is left as it was.

This file is not importable as ``test`` (the standard library owns that name): run it,
or load it by path as tests/helpers.py does (load_test_py).
"""

import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (or as it exits): quietly, 130
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import argparse
import copy
import json
import os
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
from machinery import checkpoint, engine, files, hardware, runtime
from machinery.runtime import say, shown
from ops import UserError
from pipeline import data
from tasks import _testpy as seam  # what test.py asks of every task
from tasks._report import Request

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
    own = [t for t in tasks.built_in() if t.exported_is is not None]  # their checkpoints
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
    seam.add_test_flags(p)  # the tasks' own (a generator's --samples, --predictions, ...)
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
    seam.check_test_flags(args)  # the tasks' own flags, together
    if args.model is not None:
        _check_model_args(args)
    if args.calibration_samples is not None and args.quantize != "int8":
        without = f"with --quantize {args.quantize}" if args.quantize else "without it"
        raise UserError(f"--calibration-samples is for --quantize int8 (static); {without} "
                        f"nothing is calibrated")
    if args.seed is not None and args.quantize != "int8" and \
            not seam.seeded_test_flags(args):
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


def _check_model_args(args):
    suffix = os.path.splitext(args.model)[1].lower()
    if suffix not in EXPORT_KINDS:
        raise UserError(f"--model {args.model!r}: unknown suffix {suffix or '(none)'!r}; "
                        f"it takes a file written by --export ({', '.join(EXPORT_KINDS)})")
    if args.export is not None or args.quantize is not None:
        flag = "--export" if args.export is not None else "--quantize"
        raise UserError(f"{flag} needs --checkpoint: --model only evaluates an exported "
                        f"file")
    seam.refuse_test_flags(args, None, args.model)
    if args.device not in ("auto", "cpu"):
        raise UserError(f"--model files are evaluated on the CPU, as they were exported; "
                        f"drop --device {args.device}")
    if suffix == ".onnx":
        export.check_onnx_installed("--model .onnx")


def check_outputs(args):
    """check_output for --json, --export, the int8 file and the files the tasks' own flags
    name, check_output_dir for the directories they name; all of them different."""
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--export", args.export))
               if path]
    if args.quantize:
        outputs.append((f"--quantize {args.quantize}", export.int8_path(args.export)))
    for flag, path in outputs:
        files.check_output(flag, path, args.checkpoint or args.model)
    for flag, path, directory in seam.test_outputs(args):  # the tasks' own
        if directory:
            files.check_output_dir(flag, path)
        else:
            files.check_output(flag, path, args.checkpoint or args.model)
        outputs.append((flag, path))
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
    ("amp", lambda v: isinstance(v, str) and v in hardware.AMP_DTYPES,
     f"one of {', '.join(hardware.AMP_DTYPES)}", True),
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
    The one loader of every task's checkpoints: ``model`` (or ``ema``), or a task's named
    networks (``networks``; with ``ema``, its averaged network's moving average).

    Args:
        state: the loaded checkpoint.
        config: the training run's config.
        val_set: the dataset (its classes, channels and image size shape the network; None:
            a task that rebuilds its networks from the config alone).
        path: the checkpoint file, for messages.
        weights: ``"raw"`` or ``"ema"`` (the moving average).
        kind: the task class (None: the config's).

    Returns:
        The nn.Module (an ``nn.ModuleDict`` of named networks).
    """
    kind = kind or tasks.of(config)
    net = kind.build_networks(config, val_set)
    named = isinstance(net, torch.nn.ModuleDict)  # a task of several networks, by name
    checkpoint.require(state, path, ("networks" if named else "model",),
                       f"a {kind.__name__}'s {kind.averaged_name or 'network'} is in it")
    if not named:
        tensors = checkpoint.unwrap_state_dict(state["ema" if weights == "ema" else "model"])
    else:
        held = dict(state["networks"])
        if weights == "ema":
            held[kind.averaged_name] = state["ema"][kind.averaged_name]
        tensors = {f"{name}.{key}": value for name, part in held.items()
                   for key, value in checkpoint.unwrap_state_dict(part).items()}
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
    dtype = hardware.amp_dtype(config["amp"], device, remedy="evaluate with --device cpu")
    loop = engine.LoopSettings(device=device, amp_dtype=dtype, memory_format=memory_format,
                               show_progress=False)
    loader = data.build_loader(val_set, batch_size=batch_size, num_workers=num_workers,
                               pin_memory=device.type == "cuda")
    try:
        return engine.evaluate(model, loader, loop, task, tta=tta)
    finally:
        data.shutdown_loader(loader)


def _title(path, state, config, kind, weights, tta):
    """The one title line of a checkpoint's report."""
    average = f"the moving average of the {kind.averaged_name or 'weights'}"
    extras = "".join(f", {what}" for what, on in ((average, weights == "ema"),
                                                   ("flip TTA", tta)) if on)
    return (f"checkpoint {path} (epoch {state.get('epoch', '?')}, step "
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
    if args.task is not None and stored.get("task") not in (None, args.task):  # its file
        say(f"note: {path} was exported by a run of --task {stored['task']}; it is "  # is
            f"evaluated with --task {args.task}, as asked")  # never imported from there
        stored = dict(stored, task=args.task)
    exported_is = tasks.of(stored).exported_is
    if exported_is is not None:  # not a network of predictions on the validation split
        raise UserError(f"--model {path!r} is a {stored.get('task')} {exported_is}: test.py "
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
        or an output could not be written, or the task's own code raised (one ``error:``
        line; a file that was there is left as it was), 128 + the signal's number for
        SIGINT or SIGTERM (one line).
    """
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # flags that do not parse exit as argparse does (--help: 0)
        say(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    try:
        with runtime.signals_raise():  # SIGTERM too: Ctrl-C's one line, 128 + its number
            return evaluate_and_export(args)
    except UserError as e:  # checkpoint.CheckpointError included
        say(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (OutputError, QuantizationError) as e:
        say(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except runtime.Stopped as e:  # every file test.py writes is written whole, or not at all
        say(f"{e.name}: test.py stopped; what it wrote is whole, the rest not written",
            file=sys.stderr)
        return 128 + e.signum
    except Exception as e:  # a user's task code that raised: its traceback, then one line
        if (line := tasks.user_code_failed(e)) is None:
            raise  # (the project's own: its traceback alone)
        say(f"error: {line}", file=sys.stderr)
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

    # 2. The checkpoint, the training run's config, what is asked of its task.
    state = load_training_checkpoint(args.checkpoint)
    stored = apply_data_flags(dict(state["config"]), args)  # what identifies the run and
    check_stored_config(stored, args.checkpoint, need_batch_size=args.batch_size is None)
    config = with_defaults(stored)  # must be there; flags added since take their defaults
    kind = tasks.of(config)  # the task: what is reported of its checkpoints
    if args.quantize and not kind.measured_export:
        raise UserError(f"--quantize measures a classifier's accuracy cost; {args.checkpoint!r} "
                        f"is a {config['task']} checkpoint: export it without --quantize")
    if args.tta is not None and "tta" not in kind.test_reads:
        raise UserError(f"--tta averages a classifier's predictions over mirrored images; "
                        f"{args.checkpoint!r} is a {config['task']} checkpoint")
    seam.refuse_test_flags(args, kind, args.checkpoint)  # the flags of other tasks
    request = Request(
        checkpoint=args.checkpoint, weights=choose_weights(state, args.weights,
                                                           args.checkpoint),
        seed=config["seed"] if args.seed is None else args.seed, device=device,
        batch_size=args.batch_size or config["batch_size"], num_workers=args.num_workers,
        export=args.export, flags=seam.given_test_flags(args))

    # 3. Data, the task and the network, evaluated as training validated (the training
    #    split unaugmented: --quantize int8 calibrates on it); no data, no evaluation.
    train_set, val_set = kind.test_sets(config, request) or (None, None)
    task = kind.tested(config, val_set, request)
    tta = "tta" in kind.test_reads and (args.tta or config["tta"]) == "flip" and \
        data.mirror_keeps_class(config["dataset"])
    net = load_network(state, config, val_set, args.checkpoint, request.weights, kind)
    shipped = task.exported(net, config, val_set) if suffix else None  # (refusals first)
    result = {} if val_set is None else evaluate_checkpoint(
        net, val_set, config, device, request.batch_size, args.num_workers, task, tta)
    report = task.report(result, "checkpoint", args.checkpoint)
    report.update(weights=request.weights,
                  **({"tta": "flip" if tta else "none"} if "tta" in kind.test_reads else {}))
    say(task.format_report(report, _title(args.checkpoint, state, config, kind,
                                          request.weights, tta)))
    task.outputs(net, result, val_set, report)  # what the task writes besides its figures

    # 4. Export: a fresh CPU network, checked against itself after reloading; an ONNX file
    #    of predictions is also evaluated (and quantized). The JSON holds whatever was done.
    export_step = None if suffix is None else lambda: export_and_compare(
        args, suffix, shipped, state, config, train_set, val_set, request.batch_size, report)
    return export_and_report(args, report, export_step)


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


def export_and_compare(args, suffix, shipped, state, config, train_set, val_set, batch_size,
                       report):
    """--export (and --quantize): writes, checks and measures ``shipped`` (the task's
    ``exported``); returns the exit code."""
    net, shape, described, names = shipped
    if described is None:  # a network of predictions: what evaluating its file needs
        metadata = export.export_metadata(config, val_set, state, args.checkpoint)
    else:
        metadata = export.generator_metadata(config, state, args.checkpoint,
                                             report["weights"], described)
    if not export_checked(args, suffix, net, shape, metadata, report, names):
        return EXIT_FAILED
    if suffix == ".onnx" and described is None and tasks.of(config).measured_export:
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
