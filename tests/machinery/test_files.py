"""files.atomic_write: the one way a file is replaced, whole or not at all."""

import os
import shutil
import stat

import pytest

from machinery import files


def temporaries(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp")]


def test_atomic_write_text_binary_and_path_modes(tmp_path):
    target = tmp_path / "metrics.jsonl"
    files.atomic_write(target, lambda f: f.write("héllo\n"))
    assert target.read_text(encoding="utf-8") == "héllo\n"
    files.atomic_write(target, lambda f: f.write(b"\x00\x01"), mode="wb")
    assert target.read_bytes() == b"\x00\x01"
    files.atomic_write(target, lambda tmp: shutil.copyfile(__file__, tmp), mode=None)
    assert target.read_bytes() == open(__file__, "rb").read()
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask
    assert not temporaries(tmp_path)


def fail(exception):
    def raiser(*args, **kwargs):
        raise exception
    return raiser


@pytest.mark.parametrize("mode", ["w", "wb", None])
def test_atomic_write_failure_keeps_the_old_file_and_no_temporary(tmp_path, mode):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(ValueError, match="boom"):
        files.atomic_write(target, fail(ValueError("boom")), mode=mode)
    assert target.read_text() == "old" and not temporaries(tmp_path)
