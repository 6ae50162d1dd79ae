"""The task seam: what is trained, apart from how a run runs.

A task is one file of this package (``classification.py`` is the reference; then
``segmentation.py`` and ``gan.py``), or a user's own file chosen with
``--task my_tasks.py:MyTask``: a subclass of ``Task`` that says what it builds (its
datasets, loaders and networks, its defaults and its refusals of flags), what a batch is and
how it reaches the device, its loss, its validation figures and which one picks best.pt,
the images TensorBoard shows, and what test.py reports of its checkpoints. The loop does the
rest for every task: precision, DDP and ``no_sync``, sample-weighted accumulation,
clipping, gradient norms, timing and out-of-memory handling (engine.py), and every log,
save, resume and stop decision (train.py). The anchors: timm's ``timm/task/`` (a task
returns the loss; the loop owns accumulation, precision, EMA and resume), Composer's
``ComposerModel`` (forward, loss, metrics), torchtitan's declared override points. No
Trainer class and no callbacks: a task is asked, it never calls back.

What a task provides (``Task`` declares each one with its default, with the command line's
part in ``CommandLine`` and test.py's in ``Report``; ``REQUIRED`` names what a task must
write, checked when it is loaded; README "Add a task" has the table and writes one):

  before the run (class methods: no task object exists yet)
    defaults(config, explicit)      its own defaults where the user set none
    check_config(config)            its refusals of flags, one ``UserError`` line each
    datasets(config, log, stop)     -> (train_set, val_set)
    loaders(config, procs, ...)     -> (train_loader, val_loader)
    set_identity(dataset)           what a checkpoint records of the training set
    build_networks(config, dataset) -> the network (an ``nn.ModuleDict`` for several)
    recorded(config, dataset)       the config the checkpoints record (what rebuilds it)
    build(config, train_set, val_set) -> the task
  a step and a validation
    to_device(batch, device, memory_format) -> (inputs, targets)
    prepare(inputs, targets, where)         -> (inputs, targets)   before the step's clock
    loss(model, inputs, targets, where)     -> the mean loss of the micro-batch; ``where``
                                               (a ``Where``) seeds split-proof draws
    predict(model, inputs, tta)             -> outputs for evaluation (--tta flip)
    evaluation(device, model)               -> an ``Evaluation`` (a torchmetrics Metric):
                                               update per batch, compute the figures,
                                               reduced over the processes
    extra_figures(result, names, suffix)    -> metrics.jsonl figures beyond the scalars
    images(result, names, title)            -> [(tag, HxWx3 uint8)] for TensorBoard
    example(dataset)                        -> one input sample's shape (FLOPs, summary)
    averaged(net), counted(net)             -> what --ema-decay averages, what a step's
                                               FLOPs are counted on
    class_heads(net)                        -> the modules --pretrained weights of another
                                               number of classes leave fresh
  test.py (one route for every task; a task says only what it adds)
    test_sets(config, request)        -> (train, val) for test.py, or None: no evaluation
    tested(config, val_set, request)  -> the task evaluating the checkpoint (``Request``:
                                         what test.py asks, checked against the data)
    report(result, key, path), format_report(report, title)   the JSON and the text
    outputs(net, result, val_set, report)   files besides the figures (PNGs, COCO results)
    exported(net, config, val_set)    -> what --export writes
    test_flags, test_reads            its own test.py flags (a ``TestFlags``: a built-in
                                      task's), and the flags it reads

A task with several networks (``GAN``) declares ``phases`` (``Phase``: the network each
trains, with the optimizer of the same name, and how often per step) and
``phase_loss(network, model, plain, inputs, targets, where, kept)`` instead of ``loss``;
the engine runs them (``engine._phase_steps``), and ``lower_is_better`` when its best
figure is one (an FID).

A micro-batch weighs its number of samples (the sampler's plan), for every task.
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys

import torch

import networks
from machinery import engine
from machinery.runtime import main_print
from ops import UserError, first_sentence
from pipeline import data, device_data
from reporting import metrics
from tasks._report import Report  # test.py's part of the seam (Request, TestFlags, ...)
from tasks._report import built as built  # (train.py and test.py: tasks.built)


class TaskNames(tuple):
    """--task's choices: the built-in tasks' names; ``in`` also holds a user's
    ``FILE.py:Class`` (checked when it is loaded: ``task_class``)."""

    def __contains__(self, name):
        return tuple.__contains__(self, name) or _is_user_task(name)


def _task_files():
    """The built-in tasks' names: this package's files (``tasks/<name>.py``, each with a
    ``TASK``), the reference classifier first; a new task is a new file, no list to edit."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    first = ("classification", "segmentation", "gan")  # the order they came in
    return tuple(sorted(names, key=lambda n: (first.index(n) if n in first else len(first),
                                              n)))


TASKS = TaskNames(_task_files())


def to_device(batch, device, memory_format):
    """``(images, targets)`` of a batch on ``device``, without waiting for the copy."""
    x, y = batch
    return (x.to(device, non_blocking=True, memory_format=memory_format),
            y.to(device, non_blocking=True))


IGNORE_INDEX = 255  # mask pixels that count nowhere (VOC's object borders, padding)


def new_confusion(num_classes, device=None):
    """A ``(num_classes, num_classes)`` int64 zero matrix on ``device``."""
    return torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)


def update_confusion(confusion, pred, target, ignore_index=IGNORE_INDEX):
    """Adds a batch into the confusion matrix, in place, on its device (no host read).

    Args:
        confusion: the ``(C, C)`` int64 matrix (``new_confusion``).
        pred: ``(N, C, H, W)`` logits or ``(N, H, W)`` predicted classes.
        target: ``(N, H, W)`` integer classes (any integer dtype: uint8 masks too);
            ``ignore_index`` pixels are not counted.
        ignore_index: the target value that counts nowhere.

    Returns:
        A 0-d int64 tensor on the device: the pixels whose target is neither a class in
        ``[0, C)`` nor ``ignore_index`` (a mask that does not match the number of
        classes). They are not counted; sum them over the batches and read the sum once,
        after the loop, to say so.
    """
    n = confusion.shape[0]
    if pred.dim() == target.dim() + 1:
        pred = pred.argmax(dim=1)
    if pred.shape != target.shape:
        raise ValueError(f"predictions {tuple(pred.shape)} and targets "
                         f"{tuple(target.shape)} differ in shape")
    # int64: a uint8 mask times C would wrap around at 256
    pred, target = pred.reshape(-1).long(), target.reshape(-1).to(pred.device, torch.long)
    valid = (target >= 0) & (target < n)
    invalid = (~valid & (target != ignore_index)).sum()
    # Ignored and invalid pixels add 0 at index 0: the same kernel and no boolean
    # indexing (whose output size would be read back to the host).
    index = torch.where(valid, target * n + pred, 0)
    confusion.view(-1).index_add_(0, index, valid.to(confusion.dtype))
    return invalid


class Evaluation:
    """One validation of a task, counted on the device: ``update(outputs, targets,
    inputs)`` per batch, ``compute()`` its figures (a dict). Its states are torchmetrics'
    (``add_state(name, default, dist_reduce_fx="sum")``, or ``"cat"`` for a list of what is
    not a sum): under torchrun ``compute`` first reduces them over the processes, in rank
    order, so every process gets the whole set's figures. A subclass adds its states in
    ``__init__`` and moves them to the device there (``self.to(device)``).

    Each one made is a torchmetrics ``Metric``: of its class with ``Metric`` after it, made
    at the first one (``_as_metric``). So defining a task imports no torchmetrics, which
    imports matplotlib and more (0.6 s) that --help, a refused flag and a run's steps up to
    its first validation do not need (issue 52; tests/test_optional_imports.py).

    Args:
        gather_objects: gather through ``all_gather_object`` (CPU tensors under NCCL)
            instead of ``all_gather``.
    """

    full_state_update = False

    def __new__(cls, *args, **kwargs):
        return super().__new__(_as_metric(cls))

    def __init__(self, gather_objects=False):
        super().__init__(**({"dist_sync_fn": _gather_objects} if gather_objects else {}))

    def __reduce_ex__(self, protocol):  # pickled and copied as of the class its module names
        _, args, *rest = super().__reduce_ex__(protocol)
        return (_unpickled, (type(self).__mro__[1], *args[1:]), *rest)


def _unpickled(cls, *args):
    """An ``Evaluation`` of class ``cls``, unpickled or copied (``__reduce_ex__``)."""
    return cls.__new__(cls, *args)


_metric_classes = {}  # an Evaluation subclass -> the same with torchmetrics' Metric after it


def _as_metric(cls):
    """``cls`` (an ``Evaluation`` subclass) with ``torchmetrics.Metric`` after it in its
    bases, of the same name and module: the class ``Evaluation.__new__`` makes."""
    import torchmetrics

    if issubclass(cls, torchmetrics.Metric):  # (a copy's: already one)
        return cls
    if cls not in _metric_classes:
        _metric_classes[cls] = type(cls.__name__, (cls, torchmetrics.Metric),
                                    {"__module__": cls.__module__,
                                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _metric_classes[cls]


def _gather_objects(tensor, group=None):
    """torchmetrics' ``dist_sync_fn`` for tensors NCCL cannot gather (on the CPU)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, tensor, group=group)
    return every


def check_own_network_and_data(config, task, network, model_file, datasets):
    """A task that trains a network of its own on some sets: --network must be it,
    --dataset one of ``datasets``, and --image-size a torchvision set's own side (MNIST's
    28, CIFAR-10's 32; ``data.native_geometry``), one ``UserError`` line each."""
    if config["network"] != network:
        raise UserError(f"--task {task} trains --network {network} ({model_file}), not "
                        f"{config['network']}")
    if config["dataset"] not in datasets:
        raise UserError(f"--task {task}: --dataset must be one of {', '.join(datasets)} "
                        f"(got {config['dataset']!r})")
    side, native = config["image_size"], data.native_geometry(config["dataset"])
    if native is not None and side != native[0]:
        raise UserError(f"--image-size {side}: {config['dataset']}'s images are {native[0]} "
                        f"px (--image-size {native[0]}, or leave it out)")


def refuse(task, refused):
    """Raises one ``UserError`` line for the first flag of ``refused`` that is on:
    ``[(on, flag, why)]``, said as "FLAG WHY: not for --task TASK"."""
    for on, flag, why in refused:
        if on:
            raise UserError(f"{flag} {why}: not for --task {task}")


def joined(state):
    """A ``"cat"`` state as one tensor (None: empty): a list before a reduction, a tensor
    after one."""
    if isinstance(state, torch.Tensor):
        return state
    return torch.cat(state) if state else None


# Where a micro-batch stands in its step, for draws that survive any split (``loss``,
# ``prepare``), and one integer seed from integers: the engine's, a task's to use
Where, key = engine.Where, engine.key


@dataclasses.dataclass(frozen=True)
class Phase:
    """One part of a training step (``engine._phase_steps``): the network it trains, whose
    optimizer has the same name, and how many times per step."""

    network: str
    repeats: int = 1


class CommandLine:
    """A task's part for train.py's command line (config.py asks it; no task object
    exists yet). Every member is optional; a ``FILE.py:Class`` task reads the flags that
    exist and may set its own defaults, refusals and networks."""

    flags_title = None        # train.py --help: the title of the group of its own flags
    ranges = {}               # its own numeric flags' rules: {key: (valid(value), rule)}
    own_flags = ()            # config keys only this task reads (warned about elsewhere)
    default_network = None    # --network's default (None: config.default_network's)
    own_networks = ()         # --network values only this task trains (refused elsewhere)
    own_networks_are = ""     # ... what they are, for that refusal
    datasets_named = data.DATASETS  # --dataset values it trains on (--help)

    @staticmethod
    def flags(group):
        """Adds the task's own flags to train.py's parser (``group``: an argparse group
        titled ``flags_title``); their keys belong in ``own_flags``."""

    @classmethod
    def defaults(cls, config, explicit):
        """Sets the task's own defaults in ``config`` where the user set none
        (``explicit``: the keys given)."""

    @classmethod
    def check_config(cls, config):
        """Refuses, in one ``UserError`` line each, the flags that make no sense for it."""


class Task(CommandLine, Report):
    """The thin base of every task: the loop's part, with the command line's
    (``CommandLine``) and test.py's (``Report``) beside it. What a task must write is in
    ``REQUIRED`` (checked when it is loaded: ``check_parts``); the rest is declared here
    with its default (an image classifier's).

    The loop reads these attributes and calls these methods; it never probes a task with
    ``getattr``. A task sets ``name``, ``figures`` and ``best``, writes ``build``, ``loss``
    (or ``phases`` and ``phase_loss``) and ``evaluation``, and overrides the rest only
    where it differs from the default here.
    """

    name = None               # --task's value, recorded in every checkpoint's config
    figures = ("loss",)       # validation figures: val_<figure>, val/<figure>
    best = "loss"             # the figure best.pt and --early-stop-* follow ...
    lower_is_better = None    # ... True: the lowest (a loss, an FID); False: the highest;
    #                           None: from its name (metrics.lower_is_better: a loss,
    #                           an error, a distance lower; said at load for a user's task)
    phases = None             # a task of several networks: its ``Phase``s, in order
    averaged_name = None      # ... and the network --ema-decay averages (by name, in the
    #                           checkpoint's ``ema``); None: the whole model, as ``ema``
    network_lr = {}           # a network's own learning-rate flag ({"name": "lr_x"})
    shown_figures = ()        # training figures on the epoch line (train_<figure>)
    criterion = None          # the training loss as a module, if any (--replay watches it)
    best_depends_on = ()      # config keys its best figure is measured with (a change on
    #                           resume: best.pt starts afresh)

    # ------------------------------------------------------------ before the run

    @classmethod
    def datasets(cls, config, log, should_stop=None):
        """``(train, val)``: SeededDatasets of (image, label) (data.py). ``should_stop``
        returns a stop signal's number (a decoded cache's build stops at it)."""
        return data.build_datasets(config, log, should_stop)

    @classmethod
    def loaders(cls, config, procs, train_set, val_set, sampler, stop=None):
        """The training and validation loaders: the device path or DataLoader workers, as
        --data-on-device decides (``device_data.build_loaders``)."""
        return device_data.build_loaders(config, procs, train_set, val_set, sampler, stop)

    @staticmethod
    def set_identity(dataset):
        """What a checkpoint records of the training set (a resume onto another says so)."""
        return data.set_identity(dataset)

    @classmethod
    def build_networks(cls, config, dataset):
        """The network --network names, for the set's classes, channels and image size
        (a network of the task's own file, ``@networks.register``, too)."""
        try:
            return networks.build_network(config["network"], dataset.num_classes,
                                          dataset.in_channels, dataset.image_size)
        except ValueError as e:
            raise UserError(str(e)) from None

    @classmethod
    def recorded(cls, config, dataset):
        """The config every checkpoint records: the flags, and what else rebuilds the
        networks without the data (test.py, export)."""
        return config

    @classmethod
    def build(cls, config, train_set, val_set=None):
        """The task for a run on ``train_set`` (``val_set``: its validation set). Required."""
        raise NotImplementedError(f"{cls.__name__}.build(config, train_set, val_set)")

    # ------------------------------------------------------------------- a step

    to_device = staticmethod(to_device)

    @staticmethod
    def prepare(x, y, where):
        """The micro-batch before the step's clock (MixUp, CutMix): ``(x, y)``. Draw from
        ``where`` (a ``Where``) so that any split of the step draws the same."""
        return x, y

    def loss(self, model, x, y, where):
        """The micro-batch's mean loss (0-d) of ``model`` on ``x`` against ``y``; random
        draws (noise, a mask, a timestep) from ``where.generator(x.device)``, the step's
        ``where.step_samples`` rows sliced by ``where.mine``. ``loss(self, model, x, y)``
        works too. Required of a task of one network."""
        raise NotImplementedError(f"{type(self).__name__}.loss(model, x, y, where)")

    def phase_loss(self, network, model, plain, x, y, where, kept):
        """A task of several networks (``phases``): ``(loss, figures)`` of ``network``'s
        phase for one micro-batch (``engine._phase_steps``). Required with ``phases``."""
        raise NotImplementedError(f"{type(self).__name__}.phase_loss(network, model, plain, "
                                  f"x, y, where, kept)")

    # ------------------------------------------------------------- a validation

    @staticmethod
    def predict(model, x, tta=False):
        return model(x)

    def evaluation(self, device, model=None):
        """An ``Evaluation`` of ``model`` (the run's network or its moving average) on
        ``device``: updated per batch, its figures computed over every process. Required."""
        raise NotImplementedError(f"{type(self).__name__}.evaluation(device, model)")

    @staticmethod
    def extra_figures(result, names, suffix=""):
        return {}

    @contextlib.contextmanager
    def evaluating_on(self, count):
        """An evaluation made on ``count`` validation images per process (--preflight's
        one batch): as ever by default; a task whose figures need more images than that
        (an FID) takes fewer for the while. Yields a line saying so, or None."""
        yield None

    @staticmethod
    def images(result, names, title):
        return []

    # ------------------------------------------------- the networks, as the run sees them

    @staticmethod
    def example(dataset):
        return (dataset.in_channels, dataset.image_size, dataset.image_size)

    def summarised(self, net, dataset):
        """What summary.txt shows: ``[(name, module, one input's shape)]``."""
        return [(None, net, self.example(dataset))]

    @staticmethod
    def averaged(net):
        """The network --ema-decay averages: all of it."""
        return net

    @staticmethod
    def counted(net):
        """What a step's FLOPs are counted on: the network's forward and backward."""
        return net

    @staticmethod
    def class_heads(net):
        """The modules of ``net`` shaped by the number of classes (their names; a tensor
        at or under one is theirs): --pretrained weights of another number of classes
        leave the modules whose shapes differ at their fresh initialisation
        (``presets.load_pretrained``). The default: the module of the last parameter (a
        classifier's ``fc``)."""
        from pipeline import presets

        return presets.last_module(net)


# The parts a task must write: name -> (when, the call as the loop makes it).
REQUIRED = {"build": (None, "build(cls, config, train_set, val_set=None)"),
            "loss": ("one network", "loss(self, model, x, y, where)"),
            "phase_loss": ("phases", "phase_loss(self, network, model, plain, x, y, where, "
                                     "kept)"),
            "evaluation": (None, "evaluation(self, device, model=None)")}
# Each hook's arguments as its callers pass them (besides self or cls): an override must
# take them. ``prepare`` and ``loss`` also take their form from before the ``Where``.
ARGUMENTS = {"build": 3, "loss": (3, 4), "phase_loss": 7, "evaluation": 2, "prepare": (3, 4),
             "predict": 3, "to_device": 3, "datasets": 3, "loaders": 6, "set_identity": 1,
             "build_networks": 2, "recorded": 2, "extra_figures": 3, "images": 3,
             "example": 1, "summarised": 2, "averaged": 1, "counted": 1, "flags": 1,
             "defaults": 2, "check_config": 1, "report": 3, "format_report": 2,
             "evaluating_on": 1, "class_heads": 1, "test_sets": 2, "tested": 3,
             "outputs": 4, "exported": 3}


def _takes(cls, name, counts):
    """Whether ``cls``'s ``name`` can be called with one of ``counts`` positional
    arguments (after self or cls), and how it is written (for the error)."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, (staticmethod, classmethod)):
        fn, bound = raw.__func__, isinstance(raw, classmethod)
    elif inspect.isfunction(raw):
        fn, bound = raw, True
    else:
        return True, None  # a callable object, or a wrapped one: not read
    while isinstance(fn, functools.partial) or hasattr(fn, "__wrapped__"):
        fn = getattr(fn, "__wrapped__", None) or fn.func
    signature = inspect.signature(fn)
    counts = counts if isinstance(counts, tuple) else (counts,)
    for n in counts:
        try:
            signature.bind(*([None] * (n + bound)))
            return True, None
        except TypeError:
            pass
    return False, f"{name}{signature}"


def _default(cls, name):
    """Whether ``cls`` takes ``name`` from the base (``Task``, ``CommandLine``, ``Report``):
    read where it is defined, a class method being a new object at every look-up."""
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    return owner in (Task, CommandLine, Report)


def check_parts(cls, label):
    """Checks a task class when it is loaded: every required part there, every part it
    writes callable as the loop calls it. ``label``: how the error names the task.

    Raises:
        UserError: one line naming the missing or ill-written part and its form.
    """
    several = cls.phases is not None or cls.phase_loss is not Task.phase_loss  # networks
    need = {"build", "evaluation", "phase_loss" if several else "loss"}
    for name in sorted(need, key=list(REQUIRED).index):
        if getattr(cls, name, None) is None or _default(cls, name):
            raise UserError(f"--task {label}: {cls.__name__} has no {name}: a task writes "
                            f"{REQUIRED[name][1]} (README: Add a task)")
    for name, counts in ARGUMENTS.items():
        if name not in need and _default(cls, name):
            continue  # the default
        if not hasattr(cls, name):
            continue
        fits, written = _takes(cls, name, counts)
        if not fits:
            form = REQUIRED[name][1] if name in REQUIRED else f"{name} as tasks.Task has it"
            raise UserError(f"--task {label}: {cls.__name__}.{written} cannot be called as "
                            f"the loop calls it: write {form}")


# ----------------------------------------------------------------------- the registry

_loaded = {}  # a user's "FILE.py:Class" -> the class (loaded once)
_named = set()  # the user's task files the command line named: the only ones imported
_checked = set()  # the built-in task classes checked (``check_parts``)


def _is_user_task(name):
    return isinstance(name, str) and ":" in name and name.split(":")[0].endswith(".py")


def allow(name):
    """Lets ``task_class`` import the user's task file ``name`` (``FILE.py:Class``): for a
    --task the user gave (the command line, or a --config recipe), never for one a
    checkpoint, an exported file or a --replay record names: its file is code."""
    if _is_user_task(name):
        _named.add(name)


def task_class(name):
    """The ``Task`` subclass ``name`` (--task) names: a built-in one (``tasks/<name>.py``)
    or a user's ``FILE.py:Class`` (the file's path from the working directory).

    Raises:
        UserError: an unknown name, a missing file or class, or a class that is no Task.
    """
    if tuple.__contains__(TASKS, name):
        found = importlib.import_module(f"tasks.{name}").TASK
        if found not in _checked:
            check_parts(found, name)
            _checked.add(found)
        return found
    if not _is_user_task(name):
        raise UserError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}, or "
                        f"FILE.py:Class (a tasks.Task of your own)")
    if name not in _named:  # named by a file (a checkpoint): importing it would run it
        raise UserError(f"the run's task is {name}, a file of Python code that a checkpoint "
                        f"or a record names: it is not imported from there; if you trust "
                        f"the file, add --task {name}")
    if name not in _loaded:
        _loaded[name] = _load_user_task(name)
    return _loaded[name]


def _load_user_task(name):
    path, _, class_name = name.rpartition(":")
    if not os.path.isfile(path):
        raise UserError(f"--task {name}: no file {path!r} (from {os.getcwd()})")
    module_name = "user_task_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling and dataclasses find it by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: its error, in one line
        del sys.modules[module_name]
        raise UserError(f"--task {name}: {path} does not load: "
                        f"{type(e).__name__}: {e}") from None
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, Task)) or found is Task:
        have = sorted(k for k, v in vars(module).items()
                      if isinstance(v, type) and issubclass(v, Task) and v is not Task)
        what = "no class" if found is None else "no tasks.Task subclass"
        raise UserError(f"--task {name}: {path} has {what} {class_name!r} (its tasks: "
                        f"{', '.join(have) or 'none'})")
    if found.name != name:
        found.name = name  # recorded in its checkpoints: a resume and test.py find it again
    check_parts(found, name)
    if found.lower_is_better is None and found.best is not None:  # from its name: said
        lowest = metrics.lower_is_better(found)
        main_print(f"note: --task {name}: best.pt follows the {'lowest' if lowest else 'highest'}"
                   f" {found.best!r} (from its name); set lower_is_better in {found.__name__} "
                   f"to say which is better")
    return found


def user_code_failed(error):
    """Where ``error`` came from a user's task file (``--task FILE.py:Class``, loaded):
    prints its traceback (the user's to read) and returns the start of the ``error:`` line
    that ends it (``FILE:LINE in FUNCTION``: the innermost frame in such a file). None, printing
    nothing, where no frame is one: the project's or a library's own failure."""
    import traceback

    files = {os.path.abspath(name.rpartition(":")[0]) for name in _loaded}
    found = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        if os.path.abspath(frame.f_code.co_filename) in files:
            found = f"{frame.f_code.co_filename}:{line} in {frame.f_code.co_name}"
    if found is None:
        return None
    traceback.print_exception(error)
    return (f"the task's own code raised {type(error).__name__} at {found} (the traceback "
            f"above): {first_sentence(error)}")


def built_in():
    """The built-in task classes."""
    return [task_class(name) for name in TASKS]


def of(config):
    """The task class of a run's config (``config["task"]``)."""
    return task_class(config.get("task", "classification"))


# ------------------------------------------------------- what config.py asks of every task

def default_network(task):
    """--network's default that the task ``task`` sets (None: it sets none)."""
    return task_class(task).default_network


def foreign_flags(config, explicit):
    """The flags the user gave (``explicit``: command line or recipe) that only other
    tasks read: ``[(flag, the first such task's name)]``, each flag once, for one warning
    (round 5's F11). A key several tasks own (a GAN's and a diffusion model's
    --fid-samples) is foreign only to the tasks that do not own it."""
    task, found = of(config), {}
    for other in built_in():
        for key in other.own_flags:
            if other is not task and key in explicit and key not in task.own_flags:
                found.setdefault("--" + key.replace("_", "-"), other.name)
    return list(found.items())


def owner_of(network, task=None):
    """The task whose own network ``network`` is (dcgan): a built-in one, or ``task`` (a
    user's, whose file registers it: ``@networks.register``); None: no task's own."""
    every = built_in() + ([task] if task is not None and task not in built_in() else [])
    return next((t for t in every if network in t.own_networks), None)


def check_config(config):
    """Refuses, in one line each, a network of another task and the flags that make no
    sense for the task."""
    task = of(config)
    owner = owner_of(config["network"], task)
    if owner is not None and owner is not task:
        raise UserError(f"--network {config['network']} is {owner.own_networks_are}: train "
                        f"it with --task {owner.name}")
    task.check_config(config)


def use_tta(config):
    """--tta flip, except where a mirror image is another class (digits)."""
    return config["tta"] == "flip" and data.mirror_keeps_class(config["dataset"])
