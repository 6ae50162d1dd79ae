"""test.py's part of the task seam: what test.py asks of a task (``Report``, a base of
``tasks.Task``), the typed ``Request`` a task reads instead of test.py's flags, and the
form of the tasks' own test.py flags (``TestFlags``; tasks/_testpy.py gathers them from the
built-in tasks). test.py has one
route for every task (its ``evaluate_and_export``): load, choose the weights, build the sets,
evaluate with the task's ``evaluation``, say the title, report; a task adds only its
``outputs`` and what it ``exported``. Not a task (the underscore keeps it out of --task).
"""

import dataclasses

import torch

from machinery.runtime import say
from ops import UserError


@dataclasses.dataclass(frozen=True)
class Request:
    """What test.py asks of a checkpoint besides its figures: a task reads this (in
    ``tested``, ``outputs``, ``exported``), never test.py's argparse namespace. The tasks'
    own test.py flags (``TestFlags``) are attributes too: ``request.samples``, ``request.out``
    (None when not given)."""

    checkpoint: str           # the file evaluated
    weights: str              # "raw" or "ema": the weights evaluated and exported
    seed: int                 # --seed, or the training run's
    device: torch.device      # where it is evaluated
    batch_size: int
    num_workers: int
    export: str = None        # --export's file (None: no export)
    flags: dict = dataclasses.field(default_factory=dict)  # {dest: value} of TestFlags

    def __getattr__(self, name):  # (only for names that are not fields)
        flags = self.__dict__.get("flags", {})
        if name in flags:
            return flags[name]
        raise AttributeError(name)


class TestFlags:
    """A group of test.py flags that built-in tasks read (a task names it in
    ``Report.test_flags`` and the dests it reads in ``test_reads``; a group several tasks
    name is added once). test.py checks ``files`` and ``directories`` as it checks --json,
    before anything is loaded, and refuses a flag given for a checkpoint whose task does not
    read it, or for a --model file, in one line (``words``)."""

    title = None              # test.py --help: the group's title ("{tasks}": who reads it)
    files = ()                # dests that name a file it writes
    directories = ()          # dests that name a directory it writes in
    seeded = ()               # dests whose output --seed chooses
    words = {}                # dest -> (refusal for another task's checkpoint, for --model)

    def add(self, group):
        """Adds the flags to ``group`` (an argparse group titled ``title``)."""

    def check(self, args):
        """Refuses, in one ``UserError`` line, values that make no sense together, before
        anything is loaded (``args``: test.py's parsed flags, read for these dests only)."""


class Report:
    """A task's part for test.py: test.py's one checkpoint route (load, choose the weights,
    build the sets, evaluate with the task's ``evaluation``, say the one title line, report)
    asks it only what the task adds. Every member is optional."""

    stored_needs = ()         # (key, check, expected, optional) in a stored config
    measured_export = False   # an ONNX export evaluated (--quantize) beside eager
    exported_is = None        # what its export is when test.py --model cannot evaluate
    #                           it ("generator (it makes images)"); None: its predictions
    test_flags = None         # its own test.py flags (a ``TestFlags``; a built-in task's)
    test_reads = ("tta",)     # the test.py flags it reads beyond the generic ones

    @classmethod
    def test_sets(cls, config, request):
        """``(train, val)`` for test.py (unaugmented), or None: nothing to evaluate (a
        generator asked only for images), no data read."""
        return cls.datasets(dict(config, augment=False), say)

    @classmethod
    def tested(cls, config, val_set, request):
        """The task that test.py evaluates the checkpoint with (``val_set``: None when
        ``test_sets`` gave none): the request checked against the data before anything
        is evaluated or written, in one ``UserError`` line."""
        task = built(cls, config, val_set, val_set)
        task.request = request
        return task

    def report(self, result, key, path):
        """An evaluation's result as plain JSON types; ``key`` names what was evaluated
        (``checkpoint``, or ``model`` for an exported file) and ``path`` is it."""
        return {key: path, **{k: v for k, v in result.items()
                              if isinstance(v, (int, float, str)) or v is None}}

    @staticmethod
    def format_report(report, title):
        """The report as text, under ``title`` (the checkpoint, epoch, step, network)."""
        return "\n".join([title, "  ".join(f"{k} {v:.4f}" if isinstance(v, float)
                                           else f"{k} {v}" for k, v in report.items()
                                           if k not in ("checkpoint", "model"))])

    def outputs(self, net, result, val_set, report):
        """Writes what the task gives besides its figures (sample images, COCO results)
        for ``self.request``, adds them to ``report`` and says so; ``net``: the CPU network
        evaluated. The default: nothing."""

    def exported(self, net, config, val_set):
        """What --export writes: ``(module, input shape(s), described, names)``; called
        before the evaluation, so that a network that cannot be exported is one
        ``UserError`` line first. ``described`` None: a network of predictions
        (``export.export_metadata``), else ``(config keys that rebuild it, its input,
        its output)`` (``export.generator_metadata``); ``names``: ONNX's input and output
        names (None: ``images``, ``logits``)."""
        return net, (val_set.in_channels, val_set.image_size, val_set.image_size), None, None


# ------------------------------------------------------- what test.py asks of every task


def built(task_class, config, train_set, val_set=None):
    """``task_class.build(config, train_set, val_set)``, checked to be the task.

    Raises:
        UserError: ``build`` returned something else (None: a missing ``return``).
    """
    task = task_class.build(config, train_set, val_set)
    if not isinstance(task, task_class):
        raise UserError(f"--task {task_class.name}: {task_class.__name__}.build returned "
                        f"{type(task).__name__}, not the task: return cls(...)")
    return task
