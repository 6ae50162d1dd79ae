"""The run's configuration: the flags, YAML recipes and the checks on their values.

Precedence: built-in defaults < YAML recipe (``--config``) < command-line flags. The
resolved config is a flat dict keyed by the flags' names with underscores; it is saved as
config.yaml and inside every checkpoint, and nothing changes it after ``check_config``.
"""

import argparse
import difflib
import glob
import math
import os
import sys

import torch
import yaml

import tasks
from machinery import runtime
from machinery.runtime import say, shown
from networks import NETWORKS, is_segmentation, timm_architecture
from ops import UserError
from pipeline import presets, sample_transforms, sources, timm_hub


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: None)" says nothing: leave it out
        return action.help if action.default is None else super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a UserError: one ``error:`` line and exit code 2
    from the script's main (argparse would print the usage and exit itself). train.py's
    and test.py's parsers are both one."""

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")


def build_parser():
    """The command-line flags; YAML recipes use the same names with underscores."""
    p = OneLineParser(prog="train.py", formatter_class=_HelpFormatter,
                      description="Train an image model; --task says what is trained ("
                      + ", ".join(tasks.TASKS) + ", or your own).")
    p.add_argument("--config", default=None, help="YAML recipe; its keys are these flags' "
                   "names with underscores; flags given here override it (default: none)")
    _data_flags(p.add_argument_group("data"))
    _network_flags(p.add_argument_group("network"))
    _optimisation_flags(p.add_argument_group("optimisation"))
    _hardware_flags(p.add_argument_group("hardware and speed"))
    _run_flags(p.add_argument_group("run directory, checkpoints and logging"))
    _inspection_flags(p.add_argument_group("looking into a run: early stopping, profiler, "
                                           "LR range test"))
    for task in tasks.built_in():  # each task's own flags, in a group of its own
        if task.flags_title:
            task.flags(p.add_argument_group(task.flags_title))
    return p


def _data_flags(g):
    """The task, datasets, augmentation and the data path."""
    g.add_argument("--task", default=tasks.TASKS[0], choices=tasks.TASKS,
                   help="what is trained: its data, networks, loss and figures (tasks/<name>.py), "
                        "or your own: FILE.py:Class (a tasks.Task; README: Add a task)")
    g.add_argument("--dataset", default="cifar10", help="; ".join(
        f"--task {t.name}: one of {', '.join(t.datasets_named)}" for t in tasks.built_in()))
    g.add_argument("--data-dir", default="data", help="where data lives or is downloaded to; "
                   "for imagefolder it holds train/ and val/ (or test/); hf: a saved "
                   "dataset, Parquet files or a cached hub name; shards: a brace pattern")
    sources.add_flags(g)  # --train-split, --val-data-dir, ... (pipeline/sources.py)
    g.add_argument("--synthetic-size", type=int, default=512,
                   help="training samples of the synthetic set (validation: a fifth)")
    g.add_argument("--image-size", type=int, default=32,
                   help="image side for synthetic and imagefolder data; an image folder at "
                   "64 and above is photos: a random-resized crop for training, the "
                   "centre crop for evaluation (with --pretrained torchvision: the "
                   "weights' own crop, e.g. 224)")
    g.add_argument("--crop-pct", type=float, default=0.875, help="photos: evaluation "
                   "crops the centre image-size of the image resized to image-size / "
                   "crop-pct on its short side (224 of 256); the decoded cache keeps that "
                   "(default with --pretrained torchvision: the weights' own)")
    g.add_argument("--crop-min-scale", type=float, default=0.08, help="photos: the "
                   "smallest area fraction of the training random-resized crop")
    g.add_argument("--num-classes", type=int, default=10, help="classes of the synthetic set")
    g.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True,
                   help="random crop with padding and horizontal flip while training")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument("--prefetch", type=int, default=0, help="BackgroundGenerator queue depth "
                   "in front of the loader (0 = off; see README for when it helps)")

    g.add_argument("--data-on-device", default="auto", choices=["auto", "on", "off"],
                   help="hold the sets as uint8 tensors on the training device and augment "
                   "whole batches there (no DataLoader workers); auto: on for CUDA when "
                   "the sets fit and every augmentation can run there (see README)")
    g.add_argument("--auto-augment", default="none",
                   choices=["none", "trivialaugment", "randaugment", "autoaugment"],
                   help="torchvision's augmentation policy, per sample, after crop and flip")
    g.add_argument("--randaugment-magnitude", type=int, default=9,
                   help="RandAugment's magnitude (0-30)")
    g.add_argument("--random-erase", type=float, default=0.0, metavar="P",
                   help="probability of torchvision's RandomErasing, after normalisation")
    g.add_argument("--mixup-alpha", type=float, default=0.0, help="MixUp's Beta(a, a) "
                   "(0 = off); the training loss is then the soft-target loss")
    g.add_argument("--cutmix-alpha", type=float, default=0.0, help="CutMix's Beta(a, a) "
                   "(0 = off); with --mixup-alpha too, one of the two per batch")
    g.add_argument("--mix-prob", type=float, default=1.0,
                   help="probability that a batch is mixed (MixUp/CutMix)")


def _network_flags(g):
    """The network, its starting weights and freezing."""
    g.add_argument("--network", default=None, help="simple_cnn, resnet18, resnet9, mlp, "
                   "torchvision/<name>, or timm/<name> (any timm model: its data "
                   "configuration with it); default: resnet18, or simple_cnn for --dataset "
                   "synthetic (a smoke test that finishes in seconds on a CPU)")
    g.add_argument("--pretrained", default=None, metavar="PATH|torchvision[:NAME]|timm[:TAG]",
                   help="start from the weights in this file (a checkpoint of this project "
                   "or a plain state_dict), or, for --network torchvision/<name>, "
                   "torchvision's pretrained ones (DEFAULT or NAME, e.g. IMAGENET1K_V1; "
                   "downloaded once into TORCH_HOME, hash-checked; the classifier head is "
                   "replaced, the normalisation and crop follow the weights), or, for "
                   "--network timm/<name>, timm's (its default tag or TAG) from the Hugging "
                   "Face cache (HF_HOME); a .safetensors or .pth file: a state_dict; a path "
                   "that exists wins (default: the network's own initialisation)")
    g.add_argument("--pretrained-weights", default="ema", choices=["ema", "raw"],
                   help="from a --pretrained checkpoint with a moving average (--ema-decay), "
                   "take the average (ema) or the trained weights (raw)")
    g.add_argument("--freeze", nargs="+", default=[], metavar="PATTERN",
                   help="freeze parameters whose names match these fnmatch patterns")
    g.add_argument("--unfreeze-at", type=int, default=0, metavar="EPOCH",
                   help="unfreeze them when this (1-based) epoch starts; 0 = never")
    g.add_argument("--unfreeze-lr-scale", type=float, default=0.1,
                   help="learning rate of unfrozen parameters relative to the others")


def _optimisation_flags(g):
    """Optimizer, schedule, EMA, loss."""
    g.add_argument("--epochs", type=int, default=30, help="epochs to train")
    g.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps if sooner (0 = no limit)")
    g.add_argument("--batch-size", type=int, default=128,
                   help="samples per forward pass per process")
    g.add_argument("--virtual-batch-size", type=int, default=0, help="samples per optimizer "
                   "step per process (gradient accumulation); 0 = --batch-size")
    g.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                   help="optimizer")
    g.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999],
                   metavar=("BETA1", "BETA2"), help="Adam's and AdamW's betas")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True,
                   help="Nesterov momentum for SGD")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay")
    g.add_argument("--norm-weight-decay", type=float, default=None, metavar="X",
                   help="weight decay of normalisation layers' parameters (default: "
                   "--weight-decay)")
    g.add_argument("--bias-weight-decay", type=float, default=None, metavar="X",
                   help="weight decay of biases (default: --weight-decay)")
    g.add_argument("--layer-decay", type=float, default=None, metavar="F",
                   help="layer-wise learning-rate decay (timm's): each block's learning rate "
                   "is F times the next one's, the head's 1; from the network's "
                   "group_matcher (timm models)")
    g.add_argument("--scheduler", default="cosine",
                   choices=["none", "step", "cosine", "onecycle", "poly"],
                   help="learning-rate schedule over optimizer steps (see ops.lr_factor)")
    g.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="linear warmup from 0, in epochs")
    g.add_argument("--grad-clip", type=float, default=0.0,
                   help="clip the gradient norm to this (0 = off)")
    g.add_argument("--ema-decay", type=float, default=0.0, help="keep an exponential "
                   "moving average of the weights with this decay, e.g. 0.999 (0 = off); "
                   "it is validated too, and best.pt follows its accuracy")
    g.add_argument("--ema-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="ramp the EMA decay up over the first steps (as timm does)")
    g.add_argument("--label-smoothing", type=float, default=0.1,
                   help="label smoothing of the cross-entropy")
    g.add_argument("--max-nonfinite", type=int, default=10, help="stop after this many "
                   "consecutive non-finite losses")


def _hardware_flags(g):
    """Devices, precision, memory, speed, seeds."""
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, "
                   "cuda:N")
    g.add_argument("--gpus", default=None, help="comma-separated GPU ids for "
                   "nn.DataParallel in one process, e.g. 0,1 (default: no DataParallel)")
    g.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm across processes (torchrun)")
    g.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"],
                   help="autocast dtype; fp16 uses a GradScaler")
    g.add_argument("--channels-last", action="store_true",
                   help="channels_last memory format for model and inputs")
    g.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute block activations in backward to save memory")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--seed", type=int, default=0, help="seeds data order, augmentation, "
                   "initialisation")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms (slower on CUDA)")
    g.add_argument("--gpu-memory-fraction", type=float, default=0.0, metavar="F",
                   help="cap this process's share of its GPU's memory (each GPU of --gpus) "
                   "to F (0..1] so that several runs share one GPU "
                   "(torch.cuda.set_per_process_memory_fraction; the CUDA context, a few "
                   "hundred MiB, is not counted); 0 = no cap; without CUDA a warning")
    g.add_argument("--memory-snapshot", action="store_true",
                   help="CUDA: record the allocator's history and, on an out-of-memory "
                   "error, write memory_snapshot.pickle into the run directory for "
                   "https://pytorch.org/memory_viz")

    g.add_argument("--tta", default="none", choices=["none", "flip"],
                   help="test-time augmentation for validation: flip averages the logits of "
                   "each image and its mirror (not for digits)")


def _run_flags(g):
    """Where the run goes, resuming, checkpoints and logs."""
    g.add_argument("--run-dir", default=None,
                   help="default: runs/<time>-<network>-<dataset>")
    g.add_argument("--resume", default=None, metavar="PATH|auto", help="continue from a "
                   "checkpoint; auto = the newest valid one in --run-dir, or a fresh start "
                   "if there is none (default: a fresh run)")
    g.add_argument("--requeue-signal", default="USR1",
                   choices=["USR1", "USR2", "TERM", "INT", "HUP"],
                   help="the signal that, like SIGTERM, saves at the next step and exits, and "
                   "under SLURM then requeues the job (scontrol requeue): sbatch's "
                   "--signal=USR1@90 warns before a time limit")
    g.add_argument("--ckpt-every-steps", type=int, default=0, help="also checkpoint every "
                   "N optimizer steps (0 = at epoch ends only)")
    g.add_argument("--keep-last", type=int, default=2, help="rotating checkpoints "
                   "(epoch-NNNN.pt, step-NNNNNNNN.pt) to keep besides last.pt and best.pt")
    g.add_argument("--eval-every", type=int, default=1, help="validate every N epochs "
                   "(and after the last)")
    g.add_argument("--log-every", type=int, default=50,
                   help="log the training loss every N optimizer steps")
    g.add_argument("--mlflow", nargs="?", const="local", default=None, metavar="URI",
                   help="also record the run in MLflow: params, metrics, artifacts; "
                   "without URI MLflow's default SQLite store, mlflow.db in the working "
                   "directory; or any tracking URI or path (default: off)")
    g.add_argument("--sample-ledger", action="store_true",
                   help="each process appends the sample indices of each optimizer step to "
                   "RUN_DIR/samples/rank<N>.jsonl (cut back to the checkpoint on resume); "
                   "python -m machinery.ledger RUN_DIR checks that every epoch is a "
                   "permutation of the training set")
    g.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="when no optimizer step finishes in this time, every process "
                   "writes the Python stacks of its threads to RUN_DIR/hang-rank<N>.txt "
                   "(and the collectives' flight recorder), says so and exits with 3 "
                   "(torchrun/SLURM can restart it); validation, checkpoint saves and "
                   "the set-up before the first step are not timed; 0 = off (default: "
                   "max(300 s, 20 x the median step time), 300 s until 5 steps are timed)")


def _inspection_flags(g):
    """Early stopping, the profiler, the LR range test."""
    g.add_argument("--early-stop-patience", type=int, default=0, metavar="N",
                   help="stop after N validations without improvement of the metric "
                   "best.pt follows (val_acc, or val_acc_ema with --ema-decay); 0 = off")
    g.add_argument("--early-stop-min-delta", type=float, default=0.0, metavar="D",
                   help="an improvement smaller than D (accuracy, 0..1) does not count")
    g.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="record N optimizer steps (after a short wait and warm-up) with "
                   "torch.profiler into <run-dir>/profile/ (TensorBoard, Perfetto) and "
                   "print the top operators; 0 = off")
    g.add_argument("--find-lr", action="store_true",
                   help="LR range test instead of training: sweep the learning rate "
                   "exponentially, write lr_find.png and lr_find.json, suggest --lr, "
                   "save no checkpoint")
    g.add_argument("--find-lr-steps", type=int, default=200,
                   help="optimizer steps of the LR range test")
    g.add_argument("--find-lr-min", type=float, default=1e-7,
                   help="the learning rate the range test starts from")
    g.add_argument("--find-lr-max", type=float, default=10.0,
                   help="the learning rate the range test ends at")
    g.add_argument("--verify-resume", action="store_true",
                   help="instead of training: run this command for --verify-resume-steps "
                   "steps, stop it inside an accumulation window at a step drawn from "
                   "--seed, resume it in a fresh process, and compare every tensor of the "
                   "state with an uninterrupted run (in a temporary directory); prints "
                   "'resume exact' (exit 0) or the first difference (exit 1)")
    g.add_argument("--verify-resume-steps", type=int, default=6, metavar="N",
                   help="optimizer steps --verify-resume runs (fewer if the run is shorter)")
    g.add_argument("--preflight", nargs="?", const="only", default="none",
                   choices=["none", "only", "train"],
                   help="every stage of the run once: one accumulation window of the real "
                   "step, one batch of each evaluation, a checkpoint written (elsewhere), "
                   "read back and compared, every output directory written to; then all is "
                   "put back. --preflight: exit 0 after it (1 and one error: line naming the "
                   "stage on a failure); --preflight train: then train, bit-identical to a "
                   "run without it")
    g.add_argument("--replay", default=None, metavar="RECORD",
                   help="replay the step a non-finite loss or gradient norm was recorded at "
                   "(RUN_DIR/checkpoints/nonfinite-step-NNNNNNNN.json): from its last good "
                   "checkpoint, in a scratch directory, with anomaly detection and hooks on "
                   "every module; names the first module whose output or gradient is not "
                   "finite, and the samples")



def _actions(parser):
    # argparse has no public list of a parser's actions (its types, choices and defaults
    # check YAML values like command-line ones); _actions is the documented-by-use one.
    return {a.dest: a for a in parser._actions if a.dest not in ("help",)}


def _flag(key):
    return "--" + key.replace("_", "-")


def _kind(action):
    """The Python type a flag's value has: bool, list (of str), int, float or str."""
    if action.nargs == 0:  # store_true and BooleanOptionalAction
        return bool
    if action.nargs in ("+", "*"):
        return list
    if isinstance(action.nargs, int) and action.nargs > 1:  # --betas: a fixed count of numbers
        return tuple
    return action.type or str


_KIND_NAMES = {bool: "true or false", list: "a list of strings", int: "int", float: "float",
               str: "a string", tuple: "two numbers"}


def _typed(key, value, action, from_yaml=False):
    """``value`` as the flag's type, or a UserError naming the flag and the value.

    A resolved config must hold exactly the flag's type (an int for a float flag is fine).
    ``from_yaml`` also takes what a YAML file spells differently from the resolved value:
    a number as text (``lr: 1e-3`` is a string to YAML, as on the command line), one
    pattern for a list flag, a whole number for a string flag (``gpus: 0``).
    """
    kind = _kind(action)
    if value is None:
        if action.default is None:  # an optional flag: None means "not given"
            return None
    elif kind is bool:
        if isinstance(value, bool):  # never a truthy string: "no" and "false" are true
            return value
    elif kind is list:
        if from_yaml and isinstance(value, str):
            return [value]  # one pattern, not a list of its characters
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif kind is tuple:
        if isinstance(value, (list, tuple)) and len(value) == action.nargs and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return [float(v) for v in value]
    elif isinstance(value, bool):
        pass  # true is no number, though bool is an int subclass
    elif kind is int:
        if isinstance(value, int):  # never a float: 12.7 would silently become 12
            return value
        if from_yaml and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) or (from_yaml and isinstance(value, str)):
            try:
                number = float(value)
            except (ValueError, OverflowError):  # not a number, or an int beyond floats
                pass
            else:
                return number if from_yaml else value
    elif isinstance(value, str) or (from_yaml and isinstance(value, int)):
        return str(value)
    raise UserError(f"{_flag(key)} must be {_KIND_NAMES[kind]}, not {shown(value)}")


def _check_choice(key, value, action):
    if action.choices and value not in action.choices:
        raise UserError(f"{_flag(key)} must be one of {list(action.choices)}, "
                        f"not {shown(value)}")


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader without anchors and aliases (a few hundred bytes of nested aliases, a
    "billion laughs", expand to gigabytes when the config is saved): every recipe's."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:  # &name, or *name (an AliasEvent)
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name, *name) are not allowed",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        """A mapping, refusing a key given twice (YAML would silently keep the last)."""
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class says what is wrong
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _yaml_problem(e):
    """One line for a YAMLError: the problem and where (yaml's own text spans lines)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if problem and mark:
        context = getattr(e, "context", None)
        return (f"{context + ', ' if context else ''}{problem} "
                f"(line {mark.line + 1}, column {mark.column + 1})")
    return _one_line(str(e))


def _one_line(text, width=200):
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _read_yaml(path, parser):
    """The YAML recipe as a dict of flag values, each checked like a command-line value."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"cannot read config {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"config {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                        f"at offset {e.start})") from None
    try:
        values = yaml.load(text, Loader=RecipeLoader)
    except yaml.YAMLError as e:
        raise UserError(f"config {path!r} is not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise UserError(f"config {path!r} is not valid YAML: nested too deeply") from None
    except ValueError as e:  # a date like 2024-13-45, an int of more digits than Python takes
        raise UserError(f"config {path!r} is not valid YAML: {_one_line(str(e))}") from None
    if values is None:  # an empty file, or only comments
        values = {}
    if not isinstance(values, dict):
        raise UserError(f"config {path!r} must be a mapping of flag names to values")
    actions = _actions(parser)
    for key, value in values.items():
        if key not in actions or key == "config":
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            hint = f"; did you mean {close[0]!r} (--{close[0].replace('_', '-')})?" \
                if close else ""
            raise UserError(f"unknown key {key!r} in {path}{hint}")
        try:
            values[key] = _typed(key, value, actions[key], from_yaml=True)
            _check_choice(key, values[key], actions[key])
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    return values


def parse_config(argv):
    """Resolves the config: built-in defaults < YAML recipe < command-line flags.

    Returns:
        ``(config, explicit)``: the config dict, and the keys the user set (YAML or
        command line), which override a resumed checkpoint's config.
    """
    _warned.clear()  # a new run: its warnings are shown once each
    parser = build_parser()
    pre = OneLineParser(prog="train.py", add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    from_yaml = _read_yaml(known.config, parser) if known.config else {}
    parser.set_defaults(**from_yaml)
    config = vars(parser.parse_args(argv))
    # The same parser with no defaults tells which flags were given on the command line.
    bare = build_parser()
    for action in bare._actions:  # no public way: set_defaults would type-convert SUPPRESS
        action.default = argparse.SUPPRESS
    explicit = set(vars(bare.parse_args(argv))) | set(from_yaml)
    if "task" in explicit:  # a task file is imported only when the user names it
        tasks.allow(config["task"])
    if config["network"] is None:
        config["network"] = default_network(config["dataset"], config["image_size"],
                                            config["pretrained"], config["task"])
    tasks.of(config).defaults(config, explicit)  # the task's own (a GAN's recipe)
    resumes = config["replay"] or config["resume"] and (config["resume"] != "auto" or glob.glob(
        os.path.join(glob.escape(str(config["run_dir"] or "")), "checkpoints", "*.pt")))
    if not resumes or "task" in explicit:  # else the task is the checkpoint's, and
        warn_foreign_flags(config, explicit)  # merge_resumed_config says
    return apply_pretrained_preset(config, explicit), explicit - {"config"}


def warn_foreign_flags(config, explicit):
    """One warning naming the flags the user gave (``explicit``) that only other tasks
    read, each with the tasks that read it (round 5's F11; review 6's F7: a resume's are
    judged against the checkpoint's task, in ``merge_resumed_config``)."""
    foreign = [flag for flag, _ in tasks.foreign_flags(config, explicit)]
    if not foreign:  # a recipe of another task, say: one line, not silence
        return
    owners = {flag: " and ".join(f"--task {task.name}'s" for task in tasks.built_in()
                                 if flag[2:].replace("-", "_") in task.own_flags)
              for flag in foreign}
    if len(set(owners.values())) == 1:
        named = f"{', '.join(foreign)}: {owners[foreign[0]]}"
    else:
        named = ", ".join(f"{flag} ({owner})" for flag, owner in owners.items())
    _warn(f"{named}, ignored by --task {config.get('task', tasks.TASKS[0])}")


def default_network(dataset, image_size=32, pretrained=None, task=tasks.TASKS[0]):
    """The network a run gets without --network: resnet18 (the CIFAR one: full
    resolution), simple_cnn for the synthetic set (the README's smoke run takes seconds),
    the task's own where it has one (``Task.default_network``: segmentation's unet), and
    for photos (an image folder at 64 px and above) or ``--pretrained torchvision``
    torchvision's resnet18, whose ImageNet stem downsamples 4x at once (the CIFAR
    resnet18 would cost 15x its FLOPs at 224 px)."""
    if tasks.default_network(task):  # the task's own (segmentation's unet)
        return tasks.default_network(task)
    if pretrained and presets.torchvision_weights("torchvision/resnet18", pretrained):
        return "torchvision/resnet18"
    if dataset == "synthetic":
        return "simple_cnn"
    if dataset in sample_transforms.FOLDERS and image_size >= sample_transforms.PHOTO_SIDE:
        return "torchvision/resnet18"
    return "resnet18"


def apply_pretrained_preset(config, explicit):
    """``--pretrained torchvision``: the image size and crop fraction the weights were
    trained with, where the user set none (their own transforms' crop and resize; a
    detector's weights have none: their task's geometry stays)."""
    if timm_hub.is_timm(config["network"]):  # its data configuration: size, crop_pct
        return timm_hub.apply_data_config(config, explicit, _warn)
    weights = presets.torchvision_weights(config["network"], config["pretrained"])
    if weights is None or is_segmentation(config["network"]):  # (their own geometry)
        return config
    t = weights.transforms()
    if getattr(t, "crop_size", None) is None:  # (detection's: images of any size)
        return config
    if "image_size" not in explicit:
        config["image_size"] = t.crop_size[0]
    if "crop_pct" not in explicit:
        config["crop_pct"] = t.crop_size[0] / t.resize_size[0]
    return config


def with_defaults(stored):
    """A stored config (a checkpoint's, an export's) with every flag it lacks set to the
    flag's default: the one place where an older run's config meets flags added since.

    Args:
        stored: a config dict, maybe of an older version of this project.

    Returns:
        A new dict: the flags' defaults, then ``stored``'s values (keys that are not flags,
        e.g. ``in_channels`` of an export, are kept).
    """
    config = {**vars(build_parser().parse_args([])), **stored}
    if config["network"] is None:
        config["network"] = default_network(config["dataset"], config["image_size"],
                                            task=config["task"])
    return config


def _at_least(low):
    return (lambda v: v >= low), ("must not be negative" if low == 0
                                  else f"must be at least {low}")


def _within(low, high, high_open=False):
    if high_open:
        return (lambda v: low <= v < high), f"must be in [{low}, {high})"
    return (lambda v: low <= v <= high), f"must be in [{low}, {high}]"


_UNIT = ((lambda v: 0 < v <= 1), "must be in (0, 1]")
_UNSET_OR_POSITIVE = ((lambda v: v is None or v >= 0), "must not be negative")
MAX_SEED = 2**31 - 1  # numpy seeds must be below 2**32, and train.py seeds with seed + rank
MAX_SYNTHETIC_BYTES = 8 * 2**30  # the synthetic set lives in memory as float32

RANGES = {  # every numeric flag's allowed values: (test, the rule as its error says it)
    "synthetic_size": _at_least(1),
    "image_size": _within(4, 4096),  # every network takes any side; 4096 is already huge
    "crop_pct": _UNIT, "crop_min_scale": _UNIT,
    "num_classes": _within(2, 100_000),
    "num_workers": _at_least(0),
    "shuffle_buffer": _at_least(1),  # (--dataset shards, streamed)
    "prefetch": _at_least(0),
    "unfreeze_at": _at_least(0),
    "unfreeze_lr_scale": _at_least(0),
    "epochs": _at_least(1),  # also with --max-steps: 0 epochs train nothing
    "max_steps": _at_least(0),
    "batch_size": _at_least(1),
    "virtual_batch_size": _at_least(0),
    "lr": _at_least(0),  # 0: the weights stay (a check, a BatchNorm recalibration)
    "momentum": _within(0, 1, high_open=True),
    "weight_decay": _at_least(0),
    "norm_weight_decay": _UNSET_OR_POSITIVE, "bias_weight_decay": _UNSET_OR_POSITIVE,
    "layer_decay": ((lambda v: v is None or 0 < v <= 1), "must be in (0, 1]"),
    "warmup_epochs": _at_least(0),
    "grad_clip": _at_least(0),
    "label_smoothing": _within(0, 1, high_open=True),
    "max_nonfinite": _at_least(1),
    "seed": _within(0, MAX_SEED),
    "ckpt_every_steps": _at_least(0),
    "keep_last": _at_least(0),
    "eval_every": _at_least(1),
    "log_every": _at_least(1),
    "randaugment_magnitude": _within(0, 30),
    "random_erase": _within(0, 1),
    "mixup_alpha": _at_least(0),
    "cutmix_alpha": _at_least(0),
    "mix_prob": _within(0, 1),
    "ema_decay": _within(0, 1, high_open=True),
    "gpu_memory_fraction": _within(0, 1),
    "early_stop_patience": _at_least(0),
    "early_stop_min_delta": _at_least(0),
    "profile_steps": _at_least(0),
    "find_lr_steps": _at_least(2),
    "verify_resume_steps": _at_least(2),  # a stop at step 1 or later, before the last
    "find_lr_min": ((lambda v: v > 0), "must be above 0"),
    "find_lr_max": ((lambda v: v > 0), "must be above 0"),
    "hang_timeout": ((lambda v: v is None or v >= 0), "must not be negative"),
    "betas": ((lambda v: all(0 <= b < 1 for b in v)), "must each be in [0, 1)"),
}

_warned = set()  # warnings already shown for this run (check_config runs twice on resume)


def _warn(message):
    if message not in _warned and int(os.environ.get("RANK", "0")) == 0:  # once, not per process
        say(f"warning: {message}", file=sys.stderr)
    _warned.add(message)


def check_config(c):
    """Rejects wrong types, out-of-range values and impossible combinations, each with one
    clear message naming the flag and the value; warns about suspicious ones."""
    actions = _actions(build_parser())
    for key, value in c.items():
        if key in actions:
            _typed(key, value, actions[key])
            _check_choice(key, value, actions[key])
    if tasks.owner_of(c["network"], tasks.of(c)) is None and \
            c["network"] not in NETWORKS and not str(c["network"]).startswith("torchvision/"):
        if str(c["network"]).startswith("timm/"):
            try:
                timm_architecture(c["network"].split("/", 1)[1])
            except ValueError as e:
                raise UserError(f"--network {c['network']}: {e}") from None
        else:
            raise UserError(f"unknown network {c['network']!r}; choose one of: "
                            f"{', '.join(sorted(NETWORKS))}, or torchvision/<name>, "
                            f"timm/<name>")
    for key, action in actions.items():
        values = c[key] if _kind(action) is tuple else [c[key]]
        if action.type is float and c[key] is not None and \
                not all(math.isfinite(v) for v in values):
            raise UserError(f"{_flag(key)} must be a finite number (got {c[key]!r})")
    ranges = dict(RANGES)
    for task in tasks.built_in():  # the tasks' own flags (each parser has them all)
        ranges.update(task.ranges)
    for key, (valid, rule) in ranges.items():
        if not valid(c[key]):
            raise UserError(f"{_flag(key)} {rule} (got {c[key]!r})")
    if c["virtual_batch_size"] and c["virtual_batch_size"] % c["batch_size"]:
        raise UserError(f"--virtual-batch-size {c['virtual_batch_size']} must be a multiple "
                        f"of --batch-size {c['batch_size']}")
    if c["unfreeze_at"] and not c["freeze"]:
        raise UserError("--unfreeze-at needs --freeze")
    if not c["augment"] and (c["auto_augment"] != "none" or c["random_erase"]):
        raise UserError("--auto-augment and --random-erase are training augmentations: "
                        "they need --augment")
    if c["prefetch"] and not c["num_workers"] and c["augment"] \
            and c["data_on_device"] != "on":
        raise UserError("--prefetch with --num-workers 0 would augment in a thread that "
                        "shares torch's random generator with the training thread (dropout "
                        "would not be reproducible); use --num-workers 1 or more")
    if c["run_dir"] and not _utf8(str(c["run_dir"])):  # TensorBoard writes paths as UTF-8
        raise UserError(f"--run-dir {shown(c['run_dir'])}: its name is not UTF-8, which "
                        f"TensorBoard's event files need; name the directory in UTF-8")
    if c["resume"] == "auto" and not c["run_dir"]:
        raise UserError("--resume auto needs --run-dir (the run to continue)")
    if c["compile"] and c["gpus"] and len([i for i in str(c["gpus"]).split(",")
                                           if i.strip()]) > 1:
        # torch.compile does not trace DataParallel's replicate-and-thread forward: it
        # falls back to eager for it, or fails, untested here; DDP is what compiles.
        raise UserError(f"--compile does not work with --gpus {c['gpus']} (DataParallel); "
                        f"for several GPUs use torchrun (DistributedDataParallel), which "
                        f"compiles, or drop --compile")
    tasks.check_config(c)  # the task's refusals (its dataset, its network)
    _check_device(c["device"])
    if c["dataset"] == "synthetic":
        _check_synthetic(c)
    if c["find_lr_min"] >= c["find_lr_max"]:
        raise UserError(f"--find-lr-min {c['find_lr_min']} must be below --find-lr-max "
                        f"{c['find_lr_max']}")
    clash = [f for f in ("resume", "find_lr", "replay", "preflight")
             if c["verify_resume"] and c[f] not in (None, False, "none")]
    if clash:  # it makes fresh runs of its own, in a temporary directory
        raise UserError(f"--verify-resume starts and resumes runs of its own: drop "
                        f"{_flag(clash[0])}")
    if c["preflight"] != "none" and c["find_lr"]:  # the LR range test is no run to check
        raise UserError("--preflight checks a run, --find-lr trains none: drop one")
    if c["unfreeze_at"] > c["epochs"]:
        _warn(f"--unfreeze-at {c['unfreeze_at']} is beyond --epochs {c['epochs']}: the "
              f"frozen parameters stay frozen for the whole run")


def _utf8(text):
    try:
        text.encode("utf-8")  # a name read with surrogateescape (bytes not UTF-8) fails
    except UnicodeEncodeError:
        return False
    return True


def _check_device(device):
    mps = torch.backends.mps.is_available()
    if runtime.DEVICE_NAMES.fullmatch(device) and (device != "mps" or mps):
        return
    raise UserError(f"--device must be auto, cpu, cuda or cuda:N{', or mps' if mps else ''} "
                    f"(got {device!r})")


def _check_synthetic(c):
    size, classes, side = c["synthetic_size"], c["num_classes"], c["image_size"]
    if classes > size:
        raise UserError(f"--num-classes {classes} is more than --synthetic-size {size}: "
                        f"some classes would have no sample")
    samples = size + max(size // 5, 1)  # the training set and the validation fifth
    need = samples * c.get("in_channels", 3) * side * side * 4
    if need > MAX_SYNTHETIC_BYTES:
        raise UserError(f"--synthetic-size {size} with --image-size {side} needs "
                        f"{need / 2**30:.1f} GiB of memory (at most "
                        f"{MAX_SYNTHETIC_BYTES // 2**30} GiB); lower one of them")


def merge_resumed_config(saved, config, explicit):
    """The checkpoint's config, with the keys the user set explicitly taking precedence;
    one warning names those that the run's task (the checkpoint's) does not read."""
    merged = dict(config)
    merged.update({k: v for k, v in saved.items() if k in config and k not in explicit})
    for key in sorted(explicit):
        if key in saved and saved[key] != config[key] and key not in ("resume", "run_dir") \
                and int(os.environ.get("RANK", "0")) == 0:  # once, not once per process
            say(f"override: {key} = {config[key]!r} (checkpoint had {saved[key]!r})")
    if not config["run_dir"] or "run_dir" not in explicit:
        merged["run_dir"] = saved.get("run_dir") or config["run_dir"]
    warn_foreign_flags(merged, explicit)  # against the run's task, the checkpoint's
    return merged
