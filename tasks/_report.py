"""test.py's part of the task seam: what test.py asks of a task (``Report``, a base of
``tasks.Task``), the typed ``Request`` a task reads instead of test.py's flags, and the
tasks' own test.py flags (``TestFlags``, gathered from the built-in tasks). test.py has one
route for every task (its ``evaluate_and_export``): load, choose the weights, build the sets,
evaluate with the task's ``evaluation``, say the title, report; a task adds only its
``outputs`` and what it ``exported``. Not a task (the underscore keeps it out of --task).
"""

import dataclasses
import functools

import torch

import tasks
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
        task = tasks.built(cls, config, val_set, val_set)
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

def test_groups():
    """The built-in tasks' own test.py flags: ``[(TestFlags, the tasks that name it)]``,
    each group once."""
    groups = {}
    for task in tasks.built_in():
        if task.test_flags is not None:
            groups.setdefault(id(task.test_flags), (task.test_flags, []))[1].append(task)
    return list(groups.values())


def add_test_flags(parser):
    """Each group of the built-in tasks' own test.py flags on ``parser``; returns
    ``{dest: (flag, its TestFlags, the tasks that read it)}``."""
    owners = {}
    for flags, named in test_groups():
        title = (flags.title or "").format(tasks=", ".join(t.name for t in named))
        group = parser.add_argument_group(title)
        flags.add(group)
        for action in group._group_actions:
            readers = [t for t in tasks.built_in() if action.dest in t.test_reads]
            owners[action.dest] = (action.option_strings[0], flags, readers)
    return owners


@functools.cache
def test_flags():
    """``{dest: (flag, its TestFlags, the tasks that read it)}`` of the built-in tasks' own
    test.py flags."""
    import argparse

    return add_test_flags(argparse.ArgumentParser(add_help=False))


def given_test_flags(args):
    """``{dest: value}`` of the tasks' own test.py flags in ``args`` (None: not given)."""
    return {dest: getattr(args, dest) for dest in test_flags()}


def check_test_flags(args):
    """Each group's own checks (``TestFlags.check``), before anything is loaded."""
    for flags, _ in test_groups():
        flags.check(args)


def test_outputs(args):
    """``[(flag, path, is a directory)]``: what the tasks' own test.py flags given name to
    write (``TestFlags.files``, ``directories``), which test.py checks before anything is
    loaded."""
    return [(flag, getattr(args, dest), dest in flags.directories)
            for dest, (flag, flags, _) in test_flags().items()
            if dest in (*flags.files, *flags.directories) and getattr(args, dest) is not None]


def seeded_test_flags(args):
    """Whether a flag given asks for what --seed chooses (``TestFlags.seeded``)."""
    return any(getattr(args, dest) for dest, (_, flags, _) in test_flags().items()
               if dest in flags.seeded)


def refuse_test_flags(args, kind, path):
    """One ``UserError`` line for a task's own test.py flag given for a checkpoint whose
    task (``kind``) does not read it, or for a --model file (``kind`` None)."""
    for dest, (flag, flags, readers) in test_flags().items():
        if getattr(args, dest) is None or (kind is not None and dest in kind.test_reads):
            continue
        owner = f"a {readers[0].name} checkpoint" if readers else "another checkpoint"
        for_checkpoint, for_model = flags.words.get(dest, (None, None))
        if kind is None:
            raise UserError(f"{flag} {for_model or f'is for {owner} (--checkpoint); {path!r}'}"
                            f"{'' if for_model else ' is an exported file (--model)'}")
        raise UserError(f"{flag} {for_checkpoint or f'is for {owner} (--checkpoint)'}; "
                        f"{path!r} is a {kind.name} checkpoint")
