"""The run's configuration: the flags, YAML recipes and the checks on their values.

Precedence: built-in defaults < YAML recipe (``--config``) < command-line flags. The
resolved config is a flat dict keyed by the flags' names with underscores; it is saved as
config.yaml and inside every checkpoint, and nothing changes it after ``check_config``.
"""

import argparse
import difflib
import os

import yaml

import data
from networks import NETWORKS
from ops import UserError

NOT_SAVED_IN_CONFIG = ("config", "resume", "run_dir")  # per invocation, not per recipe

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: None)" says nothing: leave it out
        return action.help if action.default is None else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2 (argparse would print usage too)
        raise UserError(f"{message} (see python train.py --help)")


def build_parser():
    """The command-line flags; YAML recipes use the same names with underscores."""
    p = _Parser(description="Train an image classifier.",
                formatter_class=_HelpFormatter)
    add = p.add_argument
    add("--config", default=None, help="YAML recipe; its keys are these flags' names "
        "with underscores; flags given here override it (default: none)")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="cifar10", help=f"one of {', '.join(data.DATASETS)}")
    g.add_argument("--data-dir", default="data", help="where data lives or is downloaded to; "
                   "for imagefolder it holds train/ and val/ (or test/)")
    g.add_argument("--synthetic-size", type=int, default=512,
                   help="training samples of the synthetic set (validation: a fifth)")
    g.add_argument("--image-size", type=int, default=32,
                   help="image side for synthetic and imagefolder data")
    g.add_argument("--num-classes", type=int, default=10, help="classes of the synthetic set")
    g.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True,
                   help="random crop with padding and horizontal flip while training")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument("--prefetch", type=int, default=0, help="BackgroundGenerator queue depth "
                   "in front of the loader (0 = off; see README for when it helps)")

    g = p.add_argument_group("network")
    g.add_argument("--network", default=None, help="simple_cnn, resnet18, mlp, or "
                   "torchvision/<name>; default: resnet18, or simple_cnn for --dataset "
                   "synthetic (a smoke test that finishes in seconds on a CPU)")
    g.add_argument("--pretrained", default=None, help="start from the weights in this file "
                   "(a checkpoint of this project or a plain state_dict; default: the "
                   "network's own initialisation)")
    g.add_argument("--freeze", nargs="+", default=[], metavar="PATTERN",
                   help="freeze parameters whose names match these fnmatch patterns")
    g.add_argument("--unfreeze-at", type=int, default=0, metavar="EPOCH",
                   help="unfreeze them when this (1-based) epoch starts; 0 = never")
    g.add_argument("--unfreeze-lr-scale", type=float, default=0.1,
                   help="learning rate of unfrozen parameters relative to the others")

    g = p.add_argument_group("optimisation")
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
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True,
                   help="Nesterov momentum for SGD")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay")
    g.add_argument("--scheduler", default="cosine",
                   choices=["none", "step", "cosine", "onecycle"],
                   help="learning-rate schedule over optimizer steps (see ops.lr_factor)")
    g.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="linear warmup from 0, in epochs")
    g.add_argument("--grad-clip", type=float, default=0.0,
                   help="clip the gradient norm to this (0 = off)")
    g.add_argument("--label-smoothing", type=float, default=0.1,
                   help="label smoothing of the cross-entropy")
    g.add_argument("--max-nonfinite", type=int, default=10, help="stop after this many "
                   "consecutive non-finite losses")

    g = p.add_argument_group("hardware and speed")
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

    g = p.add_argument_group("run directory, checkpoints and logging")
    g.add_argument("--run-dir", default=None,
                   help="default: runs/<time>-<network>-<dataset>")
    g.add_argument("--resume", default=None, metavar="PATH|auto", help="continue from a "
                   "checkpoint; auto = the newest valid one in --run-dir, or a fresh start "
                   "if there is none (default: a fresh run)")
    g.add_argument("--ckpt-every-steps", type=int, default=0, help="also checkpoint every "
                   "N optimizer steps (0 = at epoch ends only)")
    g.add_argument("--keep-last", type=int, default=2, help="rotating checkpoints "
                   "(epoch-NNNN.pt, step-NNNNNNNN.pt) to keep besides last.pt and best.pt")
    g.add_argument("--eval-every", type=int, default=1, help="validate every N epochs "
                   "(and after the last)")
    g.add_argument("--log-every", type=int, default=50,
                   help="log the training loss every N optimizer steps")
    return p


def _actions(parser):
    return {a.dest: a for a in parser._actions if a.dest not in ("help",)}


def _read_yaml(path, parser):
    """The YAML recipe as a dict of flag values, each checked like a command-line value."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise UserError(f"cannot read config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config {path!r} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise UserError(f"config {path!r} must be a mapping of flag names to values")
    actions = _actions(parser)
    for key, value in values.items():
        if key not in actions or key == "config":
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            hint = f"; did you mean {close[0]!r} (--{close[0].replace('_', '-')})?" \
                if close else ""
            raise UserError(f"unknown key {key!r} in {path}{hint}")
        action = actions[key]
        if action.type is not None and value is not None and not isinstance(value, list):
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                raise UserError(f"{path}: {key} must be {action.type.__name__}, "
                                f"not {value!r}") from None
        if action.choices and value not in action.choices:
            raise UserError(f"{path}: {key} must be one of {list(action.choices)}, "
                            f"not {value!r}")
        values[key] = value
    return values


def parse_config(argv):
    """Resolves the config: built-in defaults < YAML recipe < command-line flags.

    Returns:
        ``(config, explicit)``: the config dict, and the keys the user set (YAML or
        command line), which override a resumed checkpoint's config.
    """
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    from_yaml = _read_yaml(known.config, parser) if known.config else {}
    parser.set_defaults(**from_yaml)
    config = vars(parser.parse_args(argv))
    if config["network"] is None:
        config["network"] = "simple_cnn" if config["dataset"] == "synthetic" else "resnet18"
    # The same parser with no defaults tells which flags were given on the command line.
    bare = build_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    explicit = set(vars(bare.parse_args(argv))) | set(from_yaml)
    return config, explicit - {"config"}


def check_config(c):
    """Rejects impossible combinations with one clear message."""
    if c["dataset"] not in data.DATASETS:
        raise UserError(f"unknown dataset {c['dataset']!r}; choose one of: "
                        f"{', '.join(data.DATASETS)}")
    if c["network"] not in NETWORKS and not c["network"].startswith("torchvision/"):
        raise UserError(f"unknown network {c['network']!r}; choose one of: "
                        f"{', '.join(sorted(NETWORKS))}, or torchvision/<name>")
    if c["batch_size"] < 1:
        raise UserError("--batch-size must be at least 1")
    if c["virtual_batch_size"] and c["virtual_batch_size"] % c["batch_size"]:
        raise UserError(f"--virtual-batch-size {c['virtual_batch_size']} must be a multiple "
                        f"of --batch-size {c['batch_size']}")
    if c["epochs"] < 1 and not c["max_steps"]:
        raise UserError("--epochs must be at least 1")
    for key in ("num_workers", "prefetch", "max_steps", "ckpt_every_steps", "keep_last",
                "unfreeze_at"):
        if c[key] < 0:
            raise UserError(f"--{key.replace('_', '-')} must not be negative")
    for key in ("eval_every", "log_every", "max_nonfinite"):
        if c[key] < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1")
    if c["unfreeze_at"] and not c["freeze"]:
        raise UserError("--unfreeze-at needs --freeze")
    if c["resume"] == "auto" and not c["run_dir"]:
        raise UserError("--resume auto needs --run-dir (the run to continue)")


def merge_resumed_config(saved, config, explicit):
    """The checkpoint's config, with the keys the user set explicitly taking precedence."""
    merged = dict(config)
    merged.update({k: v for k, v in saved.items() if k in config and k not in explicit})
    for key in sorted(explicit):
        if key in saved and saved[key] != config[key] and key not in ("resume", "run_dir") \
                and int(os.environ.get("RANK", "0")) == 0:  # once, not once per process
            print(f"override: {key} = {config[key]!r} (checkpoint had {saved[key]!r})")
    if not config["run_dir"] or "run_dir" not in explicit:
        merged["run_dir"] = saved.get("run_dir") or config["run_dir"]
    return merged
