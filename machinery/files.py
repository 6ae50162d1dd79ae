"""Files written whole or not at all: the file-system plumbing every writer shares.

``atomic_write`` is the one way this project replaces a file: a temporary file in the
same directory, written, flushed and fsynced, renamed over the final name, and the
directory fsynced, so a crash at any instant leaves either the old complete file or the
new complete one. checkpoint.py (checkpoints), runlog.py (config.yaml, metrics.jsonl,
summary.txt, the lock), device_data.py (the decoded cache) and export.py / test.py (exports,
--json) all write through it. ``probe_writable`` tells whether a directory takes a new
file before any slow work starts.
"""

import errno
import os
import shutil
import tempfile

from ops import UserError


class OutputError(Exception):
    """Writing an output failed mid-run (a full disk, say); exit code 1, old file intact."""


def output_failed(flag, path, error, written=()):
    """The ``OutputError`` of a failed write of ``flag``'s ``path`` (an ``OSError``);
    ``written``: the files of the same output written whole before it (--out's PNGs)."""
    kept = ("the previous file there is unchanged" if os.path.isfile(path)
            else "nothing was written")
    if written:
        names = [os.path.basename(str(w)) for w in written]
        kept = (f"{'it is unchanged' if os.path.isfile(path) else 'it was not written'}; "
                f"the {len(names)} file(s) before it were written whole ({names[0]}"
                f"{' to ' + names[-1] if len(names) > 1 else ''})")
    return OutputError(f"{flag} {path!r}: writing failed ({error.strerror or error}); {kept}")


def printable(text):
    """``text`` as every writer takes it (matplotlib, protobuf, MLflow, JSON, a strict
    terminal): where it holds a file name that is not UTF-8 (whose bytes Python keeps as
    surrogates, as ``os.fsdecode`` reads them), each such byte becomes an escape,
    ``b"caf\\xe9"`` -> ``"caf\\xe9"``; other text is returned as it is.

    Args:
        text: a string (anything else is returned unchanged).

    Returns:
        The string, encodable as UTF-8.
    """
    if not isinstance(text, str):
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def umask():
    """The process umask, read without changing it (``os.umask`` sets it, and another
    thread creating a file meanwhile would get the temporary value)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK_AT_IMPORT


def _read_umask_at_import():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _read_umask_at_import()


def fsync_dir(directory):
    """Makes the names in ``directory`` (a rename done there) durable.

    Platforms and file systems that cannot fsync a directory are skipped; a real I/O
    error (EIO, ENOSPC) is raised.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_path(path):
    """Makes the contents of the file ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path):
    """Removes a file if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def probe_writable(directory):
    """Makes and removes a temporary file in ``directory``; raises OSError where that
    fails. Mode bits alone mislead root, and a read-only mount or a full disk show only
    when a write is tried."""
    fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def atomic_write(path, write_fn, mode="w", also=(), prefix=".tmp-"):
    """Replaces ``path`` with what ``write_fn`` writes, all at once or not at all.

    The steps: a temporary file ``.tmp-*`` in the same directory; ``write_fn``; flush;
    ``fsync(file)``; ``os.replace`` onto each name; ``fsync(directory)``. A reader sees
    either the old complete file or the new complete one, also after a crash or power
    loss. On any failure (a full disk: ``OSError(ENOSPC)`` from a write or the fsync, an
    exception in ``write_fn``) the temporary files are removed, every final name keeps
    its old file, and the error is re-raised.

    Args:
        path: the final file name. Its directory must exist.
        write_fn: called with the open temporary file (``mode="w"``: text, UTF-8;
            ``"wb"``: binary); or, with ``mode=None``, with the temporary file's path,
            for writers that need a file name (exporters). Its return value is ignored.
        mode: ``"w"``, ``"wb"`` or ``None`` (see ``write_fn``).
        also: more final names that get the same file: hard links to it (copies where
            the file system has none), each put in place by an atomic rename before
            ``path`` itself.
        prefix: of the temporary file's name (it starts with ``.tmp-``; a writer that
            can be killed adds ``runtime.owner_tag()``, so that its leftover is known).

    Returns:
        ``path``.
    """
    if mode not in ("w", "wb", None):
        raise ValueError(f"atomic_write: mode must be 'w', 'wb' or None, not {mode!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    temporaries = [tmp]
    try:
        try:
            os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it private; ours are not
        except BaseException:
            os.close(fd)
            raise
        if mode is None:
            os.close(fd)
            write_fn(tmp)
            fsync_path(tmp)
        else:
            encoding = "utf-8" if mode == "w" else None
            with os.fdopen(fd, mode, encoding=encoding) as f:
                write_fn(f)
                f.flush()
                os.fsync(f.fileno())
        directories = {directory}
        for other in also:
            other = os.fspath(other)
            other_dir = os.path.dirname(os.path.abspath(other))
            other_tmp = os.path.join(other_dir, os.path.basename(tmp) + ".link")
            temporaries.append(other_tmp)
            try:
                os.link(tmp, other_tmp)
            except OSError:
                shutil.copyfile(tmp, other_tmp)
                fsync_path(other_tmp)
            os.replace(other_tmp, other)
            directories.add(other_dir)
        os.replace(tmp, path)
    except BaseException:
        for name in temporaries:
            remove_quietly(name)
        raise
    for name in sorted(directories):
        fsync_dir(name)
    return path


def check_output(flag, path, checkpoint_path):
    """Rejects an output that could not be written, before any slow work.

    The nearest existing directory above ``path`` must take a new file
    (``probe_writable``). (test.py's outputs: --json, --export, the tasks' own.)

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
        probe_writable(existing)
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {existing!r} "
                        f"({e.strerror or e})") from None


def check_output_dir(flag, path):
    """Rejects an output directory (--out) that is a file or could not be written in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path!r} exists and is not a directory; name a directory")
    _check_writable(flag, path, os.path.abspath(path))
