"""Saving and loading run state: checksummed, rotated, written in the background, safe to load.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, saved with
``torch.save`` through ``files.atomic_write`` (a crash at any instant leaves every
final-named file either the old complete one or the new complete one) and loaded with
``torch.load(weights_only=True)``: loading never runs code from the file.

Each saved dict carries one extra entry, ``"checksum"``: a CRC-32 over every tensor's
bytes and every plain value, in a fixed order (``state_checksum``). ``load_checkpoint``
verifies it, so a file damaged on disk or in a copy is an error naming the file instead
of a model that silently trains on from corrupted weights; ``find_latest`` skips such
files as it skips truncated ones. Files written before the checksum existed load without
verification.

What a training run's checkpoint holds, the ``Saver`` that writes last.pt, best.pt and the
rotating files, and what a resume restores are machinery/saving.py's.
"""

import glob
import os
import re
import stat
import threading
from collections.abc import Mapping

import torch

from machinery.checksum import CHECKSUM_ALGORITHM, CHECKSUM_KEY, state_checksum
from machinery.files import atomic_write, remove_quietly
from ops import UserError

ROTATING = re.compile(r"^(epoch-\d{4,}|step-\d{8,})\.pt$")

FORMAT_VERSION = 3  # the newest training checkpoint format this code reads; 1: files
#                    without "format"; 2: one network ("model", "optimizer"); 3: several,
#                    by name ("networks", "optimizers": a GAN's). A single network's
#                    checkpoint is still written in format 2, its keys unchanged.
SINGLE_FORMAT = 2
PROJECT_VERSION = "0.2.0"  # pyproject.toml's (a test keeps them equal)


class CheckpointError(UserError):
    """A checkpoint file that is missing, truncated, corrupted, unreadable or of the
    wrong kind."""


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer version of this project, in a format (or with a
    checksum) this version cannot read: never skipped, never written over."""


class MissingKeyError(CheckpointError):
    """A training checkpoint without an entry this version reads: an edited file, not one
    damaged by a crash, so ``find_latest`` stops at it instead of skipping it."""


# What resuming a training run reads from its checkpoint; a tuple is a choice of keys.
RESUME_KEYS = (("model", "networks"), ("optimizer", "optimizers"), "epoch", "step",
               "progress", "config", ("rng_per_rank", "rng"))
KEY_MEANINGS = {"model": "the weights", "optimizer": "the optimizer's state",
                "networks": "the weights", "optimizers": "the optimizers' state",
                "epoch": "the finished epochs", "step": "the optimizer steps",
                "progress": "the position in the run", "config": "the run's settings",
                "rng_per_rank": "the random number generators' states",
                "rng": "the random number generators' states"}


# ---------------------------------------------------------------------------- checksum

def _check_checksum_kind(stored, path):
    """Raises NewerFormatError for a checksum entry of another algorithm than this
    version's (a newer version's)."""
    if stored["algorithm"] != CHECKSUM_ALGORITHM:
        raise NewerFormatError(f"checkpoint {path!r} has a checksum of unknown kind "
                               f"{stored['algorithm']!r} (written by a newer version of this "
                               f"project?); expected {CHECKSUM_ALGORITHM!r}")


def _verify_checksum(state, path):
    """Checks and removes the checksum entry of a loaded checkpoint dict."""
    if CHECKSUM_KEY not in state:
        return  # written before checksums: nothing to verify
    stored = state[CHECKSUM_KEY]
    if not isinstance(stored, dict) or "algorithm" not in stored or "value" not in stored:
        raise CheckpointError(f"checkpoint {path!r} has a malformed checksum entry "
                              f"(damaged?): {str(stored)[:100]}")
    _check_checksum_kind(stored, path)
    actual = state_checksum(state)["value"]
    if actual != stored["value"]:
        raise CheckpointError(f"checkpoint {path!r} is corrupted: its contents do not match "
                              f"the checksum saved with it (damaged on disk or in a copy)")
    del state[CHECKSUM_KEY]


# ------------------------------------------------------------------------- save / load

class _WriteErrors:
    """A file wrapper that keeps the OSError of a failed write: ``torch.save`` turns it
    into a RuntimeError ('unexpected pos ...') that no longer says the disk is full."""

    def __init__(self, f):
        self._f = f
        self.error = None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self._f.flush()


def save_checkpoint(state, path, also=()):
    """Writes ``state`` to ``path`` atomically, and to each path in ``also``.

    Adds the ``"checksum"`` entry (``state_checksum``, replacing any there) to what is
    written; ``state`` itself is not changed. The file is written once; the other names
    are hard links to it (a copy where the file system has none), each put in place by
    an atomic rename (``atomic_write``). On failure every final name keeps its old file,
    no temporary file is left, and the error is raised; a full disk is an
    ``OSError(ENOSPC)``.

    Args:
        state: the dict to save (plain types and tensors only).
        path: the final file name, e.g. ``run/checkpoints/last.pt``.
        also: more final names in the same directory, e.g. ``best.pt``.

    Returns:
        ``path``.
    """
    path = os.fspath(path)
    if not isinstance(state, dict):
        raise TypeError(f"save_checkpoint: a checkpoint is a dict, not a "
                        f"{type(state).__name__}")
    payload = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    payload[CHECKSUM_KEY] = state_checksum(payload)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(f):
        out = _WriteErrors(f)
        try:
            torch.save(payload, out)
        except Exception:
            if out.error is not None:
                raise out.error from None
            raise

    return atomic_write(path, write, mode="wb", also=also)


def to_cpu(obj):
    """A copy of a nested state whose tensors are detached CPU copies.

    Args:
        obj: dicts, lists and tuples of tensors and plain values.

    Returns:
        The same structure; training may change the originals while the copy is written.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class BackgroundWriter:
    """Writes checkpoints in a thread, one at a time, so that training goes on meanwhile.

    Serialising and fsyncing a ResNet-18 checkpoint takes about 0.1 s, and its checksum
    another 0.05 s; on a fast GPU that is several percent of a CIFAR-10 epoch, while the
    copy to host memory that the training thread still makes takes milliseconds. The
    checksum is computed in the thread too (``save_checkpoint`` does it). The thread is
    not a daemon: the interpreter waits for a write in progress before it exits.
    """

    def __init__(self):
        self._thread = None
        self._error = None

    def submit(self, state, path, also=(), keep_last=0):
        """Writes ``state`` (tensors the caller no longer changes) as ``save_checkpoint``
        does, then keeps the newest ``keep_last`` rotating files; waits for the previous
        write first."""
        self.wait()

        def write():
            try:
                save_checkpoint(state, path, also)
                if keep_last > 0:
                    rotate(os.path.dirname(os.path.abspath(path)), keep_last)
            except BaseException as e:  # re-raised by wait() in the training thread
                self._error = e

        self._thread = threading.Thread(target=write, name="checkpoint-writer")
        self._thread.start()

    def done(self):
        """Whether a write was submitted and has finished (``wait`` then returns at once,
        raising its error if it failed)."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self):
        """Blocks until the write in progress is done; raises its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _not_a_file(path):
    """Why ``path`` is not a regular file (or a symlink to one), or None if it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            return f"it is a dangling symbolic link (to {target!r}, which does not exist)"
        return "it does not exist"
    except OSError as e:
        return f"it cannot be examined: {e.strerror or e}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "it is a directory, not a checkpoint file"
    return "it is not a regular file"


def load_checkpoint(path, map_location="cpu"):
    """Loads a checkpoint safely and verifies its checksum.

    ``torch.load`` gets ``weights_only=True`` explicitly (torch 2.4, which
    requirements.txt allows, defaults to False): no code in the file runs. The returned
    dict is what was saved, without the ``"checksum"`` entry; files without one (older
    versions, plain ``torch.save``) load unverified.

    Args:
        path: the file.
        map_location: where tensors go.

    Returns:
        The checkpoint dict.

    Raises:
        CheckpointError: the file is missing, a directory or a dangling link, unreadable,
            truncated, corrupted (checksum mismatch), not a checkpoint dict, or holds
            objects other than tensors and plain Python types.
    """
    path = os.fspath(path)
    reason = _not_a_file(path)
    if reason == "it does not exist":
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if reason:
        raise CheckpointError(f"checkpoint {path!r} cannot be loaded: {reason}")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read: "
                              f"{e.strerror or e}") from None
    with f:
        try:
            state = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path!r} cannot be loaded safely "
                                  f"(truncated, damaged or holding pickled objects): "
                                  f"{first[:300]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path!r} holds a {type(state).__name__}, not a checkpoint dict")
    _verify_checksum(state, path)
    return upgrade(state, path)


def upgrade(state, path):
    """A loaded checkpoint in today's format: the one place older formats are upgraded.

    A training checkpoint records ``format`` (``FORMAT_VERSION``) and ``version`` (the
    project's). Format 1 (before versions were recorded: no ``format``) has every key of
    format 2 but those two. A newer format is refused: this code cannot know its keys.
    Plain state_dicts (``--pretrained`` files) are returned as they are.

    Raises:
        CheckpointError: a format newer than ``FORMAT_VERSION``, in one line naming both.
    """
    if "progress" not in state and "format" not in state:
        return state  # not a training checkpoint
    found = state.get("format", 1)
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise CheckpointError(f"checkpoint {path!r} has a malformed format entry "
                              f"{str(found)[:40]!r}")
    if found > FORMAT_VERSION:
        raise NewerFormatError(
            f"checkpoint {path!r} is of format {found} (written by version "
            f"{state.get('version', '?')} of this project); this is version "
            f"{PROJECT_VERSION}, which reads formats up to {FORMAT_VERSION}: update the "
            f"project to continue or evaluate it")
    if found == 1:  # format 1 -> 2: only the two version entries were added
        state = {**state, "format": 2, "version": state.get("version", "before 0.2.0")}
    if found == 3 and isinstance(state.get("networks"), Mapping) and \
            list(state["networks"]) == ["denoiser"]:  # a diffusion model's U-Net, before it
        name = "denoiser"  # was a task's one network: format 2, the same tensors
        moved = {to: state[k][name] for k, to in (("networks", "model"), ("optimizers",
                 "optimizer"), ("ema", "ema")) if name in (state.get(k) or {})}
        state = {**{k: v for k, v in state.items() if k not in ("networks", "optimizers")},
                 **moved, "format": SINGLE_FORMAT}
    require(state, path, (("model", "networks"),),
            "every use of a training checkpoint needs its weights")
    return state


def missing_keys(state, needed):
    """The entries of ``needed`` that ``state`` lacks: each a key, or a tuple of keys of
    which any one will do."""
    return [key for key in needed
            if not any(k in state for k in (key if isinstance(key, tuple) else (key,)))]


def require(state, path, needed=RESUME_KEYS, purpose="a resume needs it"):
    """Raises a one-line CheckpointError naming ``path`` and each key of ``needed``
    (``missing_keys``) that ``state`` lacks, instead of a KeyError later.

    Args:
        state: a loaded checkpoint.
        path: its file, for the message.
        needed: the keys the caller reads (``RESUME_KEYS``: what a resume reads).
        purpose: why they are needed, for the message.
    """
    missing = missing_keys(state, needed)
    if missing:
        def named(key):
            keys = key if isinstance(key, tuple) else (key,)
            return f"{' or '.join(repr(k) for k in keys)} ({KEY_MEANINGS.get(keys[0], '?')})"

        raise MissingKeyError(f"checkpoint {path!r} lacks {', '.join(map(named, missing))}: "
                              f"{purpose} (a file edited, or written by something other "
                              f"than this project's train.py)")


def _checkpoint_files(run_dir):
    """The ``*.pt`` names in ``run_dir/checkpoints``, sorted."""
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(run_dir)), "checkpoints",
                                         "*.pt")))


def _newer(path):
    """The NewerFormatError of a file a newer version of this project wrote, or None
    (for a readable file, and for one that does not load at all: ``find_latest`` says
    so). Reads the file's entries without its tensor data (``mmap``)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # truncated, damaged, not a zip file: not this function's business
        return None
    if not isinstance(state, dict):
        return None
    try:
        stored = state.get(CHECKSUM_KEY)
        if isinstance(stored, dict) and "algorithm" in stored:
            _check_checksum_kind(stored, path)
        upgrade(state, path)
    except NewerFormatError as e:
        return e
    except CheckpointError:  # lacking a key or malformed: said where it is loaded
        return None
    return None


def refuse_newer(run_dir):
    """Raises one NewerFormatError (naming the run directory, how many files, the first
    one's format and version) when ``run_dir/checkpoints`` holds a checkpoint that a newer
    version of this project wrote: this version must neither skip it (and start afresh or
    resume from an older file, rewinding the run) nor write over it."""
    newer = []
    for path in _checkpoint_files(run_dir):
        if _not_a_file(path) is None:
            error = _newer(path)
            if error is not None:
                newer.append(error)
    if newer:
        others = f" (and {len(newer) - 1} more file(s) like it)" if len(newer) > 1 else ""
        raise NewerFormatError(f"{newer[0]}{others}. Nothing in {os.fspath(run_dir)!r} was "
                               f"changed: this version neither resumes from an older file "
                               f"there nor writes over it; start another run with --run-dir "
                               f"NEW_DIR")


def find_latest(run_dir, map_location="cpu", warn=print):
    """The newest checkpoint in ``run_dir/checkpoints`` that loads, by optimizer step.

    Damaged files (truncated, corrupted: checksum mismatch, unreadable) and names that
    are not regular files (dangling symlinks, directories) are skipped with a
    ``warning:``. A file of a newer format is not skipped: it is an error
    (``refuse_newer``), since resuming from an older file or starting afresh would write
    over it; nor is a training checkpoint without a key this version reads (an edited
    file: ``require``).

    Raises:
        NewerFormatError: a checkpoint there was written by a newer version.
        MissingKeyError: the newest training checkpoint lacks its weights or its step.

    Args:
        run_dir: the run directory.
        map_location: where tensors go.
        warn: called with a message for each file skipped.

    Returns:
        ``(path, state)``, or ``(None, None)`` when there is no valid checkpoint.
    """
    refuse_newer(run_dir)
    candidates = []
    for path in _checkpoint_files(run_dir):
        reason = _not_a_file(path)
        if reason is None:
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError as e:
                reason = f"it cannot be examined: {e.strerror or e}"
        if reason is not None:
            warn(f"warning: skipping {path!r}: {reason}")
            continue
        candidates.append((mtime, os.path.basename(path) == "last.pt", path))
    # Newest first; hard links share a modification time, and then last.pt comes first.
    candidates.sort(reverse=True)
    best = (None, None)
    for _, _, path in candidates:
        try:
            state = load_checkpoint(path, map_location)
        except (NewerFormatError, MissingKeyError):  # newer: written since refuse_newer
            raise
        except CheckpointError as e:
            warn(f"warning: skipping {e}")
            continue
        if "model" not in state and "networks" not in state:  # a plain state_dict put there
            warn(f"warning: skipping {path!r}: not a training checkpoint")
            continue
        require(state, path, ("step",), "the resume point needs it")
        # The newest file is normally the furthest along; when mtimes tie, take the step.
        if best[1] is None or state["step"] > best[1]["step"]:
            best = (path, state)
        if os.path.basename(path) == "last.pt":
            break  # last.pt is written at every save: nothing older is further along
    return best


def rotate(directory, keep_last):
    """Deletes the oldest rotating checkpoints (epoch-*.pt, step-*.pt) beyond ``keep_last``.

    Files are ordered by modification time; equal times (saves faster than the file
    system's clock, hard links) are ordered by the file that ``last.pt`` links to (the
    newest save), then by the number in the name. The newest rotating file is never
    deleted: ``keep_last`` below 1 counts as 1.

    Args:
        directory: the checkpoints directory.
        keep_last: how many rotating files to keep.

    Returns:
        The deleted paths.
    """
    try:
        last = os.stat(os.path.join(directory, "last.pt"))
        last_id = (last.st_dev, last.st_ino)
    except OSError:
        last_id = None
    files = []
    for name in os.listdir(directory):
        if not ROTATING.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        number = int(re.search(r"\d+", name).group())
        files.append(((st.st_mtime_ns, (st.st_dev, st.st_ino) == last_id, number), path))
    files.sort()
    doomed = [path for _, path in files[:max(len(files) - max(keep_last, 1), 0)]]
    for path in doomed:
        remove_quietly(path)
    return doomed


def unwrap_state_dict(state_dict):
    """A state_dict without ``module.`` (DataParallel/DDP) or ``_orig_mod.`` (compile)
    prefixes, so it loads into a plain network."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith(("module.", "_orig_mod.")):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def check_compatible(model, state_dict, source):
    """Raises a CheckpointError listing the keys that do not fit ``model``.

    Args:
        model: the network to load into.
        state_dict: the weights, already unwrapped.
        source: a name for the message (the file).
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = sorted(k for k in set(own) & set(state_dict)
                    if tuple(own[k].shape) != tuple(state_dict[k].shape))
    if missing or unexpected or shapes:
        def few(keys):
            return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        parts = [f"{name}: {few(keys)}" for name, keys in
                 (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                 if keys]
        raise CheckpointError(f"{source!r} does not fit this network ({'; '.join(parts)})")
