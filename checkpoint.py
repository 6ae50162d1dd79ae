"""Saving and loading run state: atomic, rotated, safe to load.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, saved with
``torch.save`` and loaded with ``torch.load(weights_only=True)``: loading never runs
code from the file. Writes go to a temporary file in the target directory, are flushed
and fsynced, then renamed over the final name, so a crash at any instant leaves every
final-named file either the old complete one or the new complete one.
"""

import glob
import os
import random
import re
import tempfile
import threading

import numpy as np
import torch

from ops import UserError

ROTATING = re.compile(r"^(epoch-\d{4,}|step-\d{8,})\.pt$")


class CheckpointError(UserError):
    """A checkpoint file that is missing, truncated, unreadable or of the wrong kind."""


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state, path, also=()):
    """Writes ``state`` to ``path`` atomically, and to each path in ``also``.

    The file is written once; the other names are hard links to it (a copy where the
    file system has none), each put in place by an atomic rename.

    Args:
        state: the dict to save (plain types and tensors only).
        path: the final file name, e.g. ``run/checkpoints/last.pt``.
        also: more final names in the same directory, e.g. ``best.pt``.

    Returns:
        ``path``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is not
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        for other in also:
            other_tmp = tmp + ".link"
            try:
                os.link(tmp, other_tmp)
            except OSError:
                import shutil
                shutil.copyfile(tmp, other_tmp)
            try:
                os.replace(other_tmp, other)
            except BaseException:
                os.unlink(other_tmp)
                raise
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


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

    Serialising and fsyncing a ResNet-18 checkpoint takes about 0.1 s; on a fast GPU
    that is several percent of a CIFAR-10 epoch, while the copy to host memory that the
    training thread still makes takes milliseconds. The thread is not a daemon: the
    interpreter waits for a write in progress before it exits.
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

    def wait(self):
        """Blocks until the write in progress is done; raises its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def load_checkpoint(path, map_location="cpu"):
    """Loads a checkpoint safely (``weights_only=True``: no code in the file runs).

    Args:
        path: the file.
        map_location: where tensors go.

    Returns:
        The checkpoint dict.

    Raises:
        CheckpointError: the file is missing, truncated, not a checkpoint, or holds
            objects other than tensors and plain Python types.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path!r} cannot be loaded safely "
                              f"(truncated, damaged or holding pickled objects): "
                              f"{first[:300]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path!r} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def find_latest(run_dir, map_location="cpu", warn=print):
    """The newest checkpoint in ``run_dir/checkpoints`` that loads, by optimizer step.

    Damaged files are skipped with a warning.

    Args:
        run_dir: the run directory.
        map_location: where tensors go.
        warn: called with a message for each damaged file.

    Returns:
        ``(path, state)``, or ``(None, None)`` when there is no valid checkpoint.
    """
    paths = glob.glob(os.path.join(run_dir, "checkpoints", "*.pt"))
    # Newest first; hard links share a modification time, and then last.pt comes first.
    paths.sort(key=lambda p: (os.path.getmtime(p), os.path.basename(p) == "last.pt"),
               reverse=True)
    best = (None, None)
    for path in paths:
        try:
            state = load_checkpoint(path, map_location)
        except CheckpointError as e:
            warn(f"warning: skipping {e}")
            continue
        if "model" not in state or "step" not in state:
            warn(f"warning: skipping {path!r}: not a training checkpoint")
            continue
        # The newest file is normally the furthest along; when mtimes tie, take the step.
        if best[1] is None or state["step"] > best[1]["step"]:
            best = (path, state)
        if os.path.basename(path) == "last.pt":
            break  # last.pt is written at every save: nothing older is further along
    return best


def rotate(directory, keep_last):
    """Deletes the oldest rotating checkpoints (epoch-*.pt, step-*.pt) beyond ``keep_last``.

    Args:
        directory: the checkpoints directory.
        keep_last: how many rotating files to keep.

    Returns:
        The deleted paths.
    """
    files = [os.path.join(directory, f) for f in os.listdir(directory) if ROTATING.match(f)]
    files.sort(key=os.path.getmtime)
    doomed = files[:max(len(files) - keep_last, 0)]
    for path in doomed:
        os.unlink(path)
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


def rng_state():
    """The RNG states of python, numpy, torch CPU and every CUDA device, as plain types."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    """Restores what ``rng_state`` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:devices])
