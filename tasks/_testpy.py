"""What test.py asks of every task: the built-in tasks' own test.py flags (each task's
``TestFlags``, a group several tasks name added once), the files and directories they name
(checked before anything is loaded), and the refusal, in one line, of a flag given for a
checkpoint whose task does not read it or for an exported file. Not a task (the underscore
keeps it out of --task).
"""

import functools

import tasks
from ops import UserError


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
