"""checkpoint.py on its own: atomic writes, checksums, safe loading, RNG, rotation, the
run-directory lock. Fast: no training runs."""

import errno
import json
import os
import random
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch
from conftest import ROOT

import checkpoint
from ops import UserError


def small_state(step=1, **extra):
    """A training-checkpoint-shaped dict with a few distinct tensors."""
    return {
        "model": {"fc.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8),
                  "fc.bias": torch.full((8,), 0.5), "bn.num_batches_tracked": torch.tensor(7)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.linspace(-1, 1, 32)}},
                      "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]},
        "step": step,
        "epoch": 1,
        "config": {"network": "resnet18", "lr": 0.1, "gpus": None},
        **extra,
    }


def ckpt_dir(tmp_path):
    path = tmp_path / "run" / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


def set_mtime(path, ns):
    os.utime(path, ns=(ns, ns))


def temporaries(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp")]


# ------------------------------------------------------- 1. links and directories

def test_find_latest_skips_dangling_links_and_directories_with_a_warning(tmp_path):
    d = ckpt_dir(tmp_path)
    checkpoint.save_checkpoint(small_state(step=3), d / "epoch-0001.pt")
    os.symlink(d / "gone.pt", d / "last.pt")  # dangling: its target never existed
    (d / "best.pt").mkdir()
    (d / "best.pt" / "x").write_text("not a checkpoint")
    warnings = []
    path, state = checkpoint.find_latest(tmp_path / "run", warn=warnings.append)
    assert path == str(d / "epoch-0001.pt") and state["step"] == 3
    assert len(warnings) == 2, warnings
    dangling = next(w for w in warnings if "last.pt" in w)
    assert dangling.startswith("warning: skipping") and "dangling symbolic link" in dangling
    directory = next(w for w in warnings if "best.pt" in w)
    assert directory.startswith("warning: skipping") and "is a directory" in directory


def test_find_latest_with_only_broken_names_starts_fresh(tmp_path):
    d = ckpt_dir(tmp_path)
    os.symlink(d / "gone.pt", d / "last.pt")
    (d / "epoch-0001.pt").mkdir()
    warnings = []
    assert checkpoint.find_latest(tmp_path / "run", warn=warnings.append) == (None, None)
    assert len(warnings) == 2


def test_find_latest_follows_a_symlink_to_a_file(tmp_path):
    d = ckpt_dir(tmp_path)
    checkpoint.save_checkpoint(small_state(step=5), d / "step-00000005.pt")
    os.symlink("step-00000005.pt", d / "last.pt")
    warnings = []
    path, state = checkpoint.find_latest(tmp_path / "run", warn=warnings.append)
    assert state["step"] == 5 and not warnings


def test_load_checkpoint_on_a_directory_or_dangling_link_is_a_clear_error(tmp_path):
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"dir\.pt.*is a directory"):
        checkpoint.load_checkpoint(tmp_path / "dir.pt")
    os.symlink(tmp_path / "nowhere.pt", tmp_path / "link.pt")
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"link\.pt.*dangling symbolic link.*nowhere\.pt"):
        checkpoint.load_checkpoint(tmp_path / "link.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"missing\.pt' does not exist"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt")


# ---------------------------------------------------------------------- 2. checksums

def stored_entry(path, tensor):
    """``(offset, size)`` in the file of the zip entry ``data/N`` holding ``tensor``'s
    storage (torch stores them uncompressed), found by content."""
    want = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    blob = open(path, "rb").read()
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if "/data/" not in info.filename:
                continue
            assert info.compress_type == zipfile.ZIP_STORED
            name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:
                                                            info.header_offset + 30])
            start = info.header_offset + 30 + name_len + extra_len
            if blob[start:start + info.file_size] == want:
                return start, info.file_size
    raise AssertionError("tensor data not found in the file")


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_checksum_is_stored_in_the_file_and_loads_with_weights_only(tmp_path):
    state = small_state()
    path = checkpoint.save_checkpoint(state, tmp_path / "last.pt")
    raw = torch.load(path, weights_only=True)
    assert list(raw) == [*state, "checksum"]  # the old keys, in order, plus one
    assert raw["checksum"] == checkpoint.state_checksum(state)
    assert raw["checksum"]["algorithm"] == checkpoint.CHECKSUM_ALGORITHM
    assert "checksum" not in state  # the caller's dict is not changed
    loaded = checkpoint.load_checkpoint(path)
    assert list(loaded) == list(state)  # verified and removed
    assert torch.equal(loaded["model"]["fc.weight"], state["model"]["fc.weight"])


@pytest.mark.parametrize("tensor_path, where", [
    (("model", "fc.weight"), 0.5), (("model", "fc.bias"), 0.0),
    (("model", "bn.num_batches_tracked"), 1.0), (("optimizer", "momentum_buffer"), 0.99)])
def test_a_flipped_byte_in_tensor_data_is_detected(tmp_path, tensor_path, where):
    d = ckpt_dir(tmp_path)
    checkpoint.save_checkpoint(small_state(step=1), d / "epoch-0001.pt")
    state = small_state(step=2)
    checkpoint.save_checkpoint(state, d / "last.pt")
    set_mtime(d / "epoch-0001.pt", 1_000_000_000_000_000_000)
    set_mtime(d / "last.pt", 2_000_000_000_000_000_000)
    outer, inner = tensor_path
    tensor = (state[outer]["state"][0][inner] if outer == "optimizer"
              else state[outer][inner])
    start, size = stored_entry(d / "last.pt", tensor)
    flip_byte(d / "last.pt", start + min(int(size * where), size - 1))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_checkpoint(d / "last.pt")
    assert "last.pt" in str(e.value) and "corrupted" in str(e.value)
    assert "checksum" in str(e.value)
    warnings = []
    path, found = checkpoint.find_latest(tmp_path / "run", warn=warnings.append)
    assert path == str(d / "epoch-0001.pt") and found["step"] == 1
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: skipping") and "last.pt" in warnings[0]
    assert "corrupted" in warnings[0]


def test_a_changed_plain_value_in_the_pickle_is_detected(tmp_path):
    path = checkpoint.save_checkpoint(small_state(), tmp_path / "last.pt")
    blob = open(path, "rb").read()
    assert blob.count(b"resnet18") == 1
    open(path, "wb").write(blob.replace(b"resnet18", b"resnet19"))
    assert torch.load(path, weights_only=True)["config"]["network"] == "resnet19"
    with pytest.raises(checkpoint.CheckpointError, match=r"last\.pt.*corrupted"):
        checkpoint.load_checkpoint(path)


def test_a_damaged_checksum_entry_is_detected(tmp_path):
    state = small_state()
    state["checksum"] = {"algorithm": checkpoint.CHECKSUM_ALGORITHM, "value": 12345}
    torch.save(state, tmp_path / "wrong.pt")
    with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
        checkpoint.load_checkpoint(tmp_path / "wrong.pt")
    state["checksum"] = {"algorithm": "sha3-v9", "value": "x"}
    torch.save(state, tmp_path / "newer.pt")
    with pytest.raises(checkpoint.CheckpointError, match="unknown kind 'sha3-v9'"):
        checkpoint.load_checkpoint(tmp_path / "newer.pt")


def test_files_without_a_checksum_still_load(tmp_path):
    torch.save(small_state(), tmp_path / "old.pt")  # as written before checksums
    assert checkpoint.load_checkpoint(tmp_path / "old.pt")["step"] == 1


def test_resaving_a_loaded_state_replaces_its_checksum(tmp_path):
    checkpoint.save_checkpoint(small_state(), tmp_path / "a.pt")
    raw = torch.load(tmp_path / "a.pt", weights_only=True)  # still holds the checksum
    raw["model"]["fc.bias"] += 1
    checkpoint.save_checkpoint(raw, tmp_path / "b.pt")
    assert torch.equal(checkpoint.load_checkpoint(tmp_path / "b.pt")["model"]["fc.bias"],
                       torch.full((8,), 1.5))


def test_checksum_covers_every_kind_of_value(tmp_path):
    state = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "view": torch.arange(20.0)[5:15:2], "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4), "bool": torch.tensor([True, False]),
        "complex": torch.tensor([1 + 2j]), "int": 3, "big": 2 ** 70, "float": -0.0,
        "nan": float("nan"), "none": None, "bytes": b"\x00\xff", "str": "héllo \U0001f600",
        "tuple": (1, (2.5, "x")), "set": {"b", "a", 3}, "size": torch.Size([2, 3]),
        "dtype": torch.float16, "device": torch.device("cpu"), 7: {8: [9, {"k": None}]},
    }
    path = checkpoint.save_checkpoint(state, tmp_path / "all.pt")
    loaded = checkpoint.load_checkpoint(path)
    assert set(loaded) == set(state)
    assert loaded["channels_last"].stride() == state["channels_last"].stride()
    assert torch.equal(loaded["view"], state["view"])


def test_checksum_changes_with_any_value():
    base = checkpoint.state_checksum(small_state())["value"]
    changed = [
        small_state(step=2), small_state(extra=None), small_state(epoch=1.0),
        {**small_state(), "config": {"network": "resnet18", "lr": 0.1000000001, "gpus": None}},
        {**small_state(), "model": {**small_state()["model"],
                                    "fc.bias": torch.full((8,), 0.5, dtype=torch.float64)}},
        {**small_state(), "model": {**small_state()["model"],
                                    "fc.weight": torch.arange(64.0).reshape(4, 16)}},
    ]
    for state in changed:
        assert checkpoint.state_checksum(state)["value"] != base


def test_checksum_is_computed_in_the_writer_thread(tmp_path, monkeypatch):
    threads = []
    real = checkpoint.state_checksum

    def state_checksum(state):
        threads.append(threading.current_thread().name)
        return real(state)

    monkeypatch.setattr(checkpoint, "state_checksum", state_checksum)
    writer = checkpoint.BackgroundWriter()
    writer.submit(checkpoint.to_cpu(small_state()), tmp_path / "last.pt")
    writer.wait()
    assert threads == ["checkpoint-writer"]
    assert checkpoint.load_checkpoint(tmp_path / "last.pt")["step"] == 1


# ------------------------------------------------------------------ 3. fsync order

@pytest.mark.parametrize("also", [(), ("best.pt", "epoch-0001.pt")])
def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path,
                                                                       monkeypatch, also):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(src), os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    checkpoint.save_checkpoint(small_state(), tmp_path / "last.pt",
                               also=[tmp_path / name for name in also])
    file_ino, dir_ino = os.stat(tmp_path / "last.pt").st_ino, os.stat(tmp_path).st_ino
    fsync_file = events.index(("fsync", "file", file_ino))
    renames = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert [events[i][2] for i in renames] == [*also, "last.pt"]
    assert all(events[i][1].startswith(".tmp-") for i in renames)
    fsync_dir = events.index(("fsync", "dir", dir_ino))
    assert fsync_file < min(renames) and max(renames) < fsync_dir, events


# --------------------------------------------------------------- 4. weights_only

def test_load_passes_weights_only_explicitly(tmp_path, monkeypatch):
    path = checkpoint.save_checkpoint(small_state(), tmp_path / "last.pt")
    calls = []
    real_load = torch.load

    def load(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", load)
    checkpoint.load_checkpoint(path)
    assert len(calls) == 1 and calls[0].get("weights_only") is True


class Payload:
    """Unpickling this would create a file: ``open(marker, "w")``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_payload_is_refused_and_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    d = ckpt_dir(tmp_path)
    checkpoint.save_checkpoint(small_state(step=1), d / "epoch-0001.pt")
    set_mtime(d / "epoch-0001.pt", 1_000_000_000_000_000_000)
    torch.save({**small_state(step=9), "evil": Payload(marker)}, d / "last.pt")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be loaded safely"):
        checkpoint.load_checkpoint(d / "last.pt")
    warnings = []
    path, state = checkpoint.find_latest(tmp_path / "run", warn=warnings.append)
    assert state["step"] == 1 and "last.pt" in warnings[0]
    assert not marker.exists()


# ------------------------------------------------------------------------ 5. RNG

def advance_and_draw():
    """Five values from each generator, including cached Gaussians."""
    return ([random.random() for _ in range(5)] + [random.gauss(0, 1) for _ in range(5)],
            np.random.rand(5).tolist() + np.random.randn(5).tolist(),
            torch.rand(5).tolist() + torch.randn(5).tolist())


def saved_rng():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    advance_and_draw()
    random.gauss(0, 1)  # an odd number of Gaussians: each library caches the next one
    np.random.randn(1)
    return checkpoint.rng_state()


def test_rng_state_round_trip_restores_every_generator(tmp_path):
    state = saved_rng()
    first = advance_and_draw()
    checkpoint.set_rng_state(state)
    assert advance_and_draw() == first
    path = checkpoint.save_checkpoint({"rng": state}, tmp_path / "rng.pt")
    loaded = checkpoint.load_checkpoint(path)["rng"]  # weights_only
    advance_and_draw()
    checkpoint.set_rng_state(loaded)
    assert advance_and_draw() == first


@pytest.mark.parametrize("generator, module, name", [
    (0, random, "setstate"), (1, np.random, "set_state"), (2, torch, "set_rng_state")])
def test_rng_round_trip_fails_without_each_restore(monkeypatch, generator, module, name):
    # The round-trip test above must catch a missing restore of any one generator.
    state = saved_rng()
    first = advance_and_draw()
    monkeypatch.setattr(module, name, lambda *args: None)
    checkpoint.set_rng_state(state)
    again = advance_and_draw()
    assert [a == b for a, b in zip(first, again)] == [i != generator for i in range(3)]


# ------------------------------------------------------------------------ 6. RunLock

HOLD_LOCK = ("import sys; sys.path.insert(0, {root!r}); import checkpoint; "
             "checkpoint.RunLock(sys.argv[1]).acquire(); print('locked', flush=True); "
             "sys.stdin.read()")


def test_run_lock_refuses_a_live_run_then_takes_over_when_it_is_gone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=ROOT),
                             str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as e:
            checkpoint.RunLock(tmp_path).acquire()
        message = str(e.value)
        assert f"is used by another run (pid {proc.pid} on host {socket.gethostname()}, " \
               f"started " in message
        assert "wait for it or choose another --run-dir" in message
    finally:
        proc.kill()
        proc.wait()
    warnings = []
    lock = checkpoint.RunLock(tmp_path, warn=warnings.append).acquire()
    assert len(warnings) == 1 and warnings[0].startswith("warning: taking over")
    assert f"pid {proc.pid}" in warnings[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".lock").exists()


def write_lock(run_dir, **record):
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": "2020-01-01T00:00:00", **record}
    (run_dir / ".lock").write_text(json.dumps(record))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_takes_over_a_dead_pid_with_a_warning(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    warnings = []
    with checkpoint.RunLock(tmp_path, warn=warnings.append) as lock:
        assert lock.held
        assert warnings == [f"warning: taking over {str(tmp_path / '.lock')!r} from a run "
                            f"that is gone (pid {pid} on host {socket.gethostname()}, "
                            f"started 2020-01-01T00:00:00)"]
        record = json.loads((tmp_path / ".lock").read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert "started" in record
    assert not (tmp_path / ".lock").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".lock.tmp")]


def test_run_lock_treats_a_reused_pid_as_gone(tmp_path):
    # Our own pid, but a process that started at another time: the pid was reused.
    start = checkpoint._process_start(os.getpid())
    if start is None:
        pytest.skip("no /proc here")
    write_lock(tmp_path, proc_start=start - 1)
    warnings = []
    checkpoint.RunLock(tmp_path, warn=warnings.append).acquire().release()
    assert len(warnings) == 1


def test_run_lock_refuses_a_live_lock_of_this_process(tmp_path):
    with checkpoint.RunLock(tmp_path):
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            checkpoint.RunLock(tmp_path).acquire()
        assert (tmp_path / ".lock").exists()


def test_run_lock_of_another_host_is_refused(tmp_path):
    write_lock(tmp_path, host="elsewhere.invalid", pid=dead_pid())
    with pytest.raises(UserError) as e:
        checkpoint.RunLock(tmp_path).acquire()
    assert "on host elsewhere.invalid" in str(e.value)
    assert f"delete {str(tmp_path / '.lock')!r}" in str(e.value)
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "elsewhere.invalid"


@pytest.mark.parametrize("content", ["", "{\"pid\": 12", "[1, 2]"])
def test_run_lock_takes_over_an_empty_or_unreadable_lock(tmp_path, content):
    (tmp_path / ".lock").write_text(content)
    warnings = []
    lock = checkpoint.RunLock(tmp_path, warn=warnings.append).acquire()
    assert len(warnings) == 1 and "empty or unreadable" in warnings[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_run_lock_release_is_idempotent_and_leaves_another_runs_lock(tmp_path):
    lock = checkpoint.RunLock(tmp_path / "new")  # the directory is created
    lock.acquire()
    assert lock.held and (tmp_path / "new" / ".lock").exists()
    lock.release()
    assert not lock.held and not (tmp_path / "new" / ".lock").exists()
    lock.release()  # harmless
    lock.acquire()
    write_lock(tmp_path / "new", pid=1, started="other")  # someone replaced it
    lock.release()
    assert json.loads((tmp_path / "new" / ".lock").read_text())["pid"] == 1


# ------------------------------------------------------------------ 7. atomic_write

def test_atomic_write_text_binary_and_path_modes(tmp_path):
    target = tmp_path / "metrics.jsonl"
    checkpoint.atomic_write(target, lambda f: f.write("héllo\n"))
    assert target.read_text(encoding="utf-8") == "héllo\n"
    checkpoint.atomic_write(target, lambda f: f.write(b"\x00\x01"), mode="wb")
    assert target.read_bytes() == b"\x00\x01"
    checkpoint.atomic_write(target, lambda tmp: shutil.copyfile(__file__, tmp), mode=None)
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
        checkpoint.atomic_write(target, fail(ValueError("boom")), mode=mode)
    assert target.read_text() == "old" and not temporaries(tmp_path)


def test_a_full_disk_at_fsync_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.save_checkpoint(small_state(step=1), tmp_path / "last.pt")
    before = open(path, "rb").read()
    real_fsync = os.fsync

    def fsync(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(small_state(step=2), path, also=[tmp_path / "best.pt"])
    assert e.value.errno == errno.ENOSPC
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["last.pt"]


def test_a_full_disk_during_torch_save_is_an_enospc_oserror(tmp_path, monkeypatch):
    # torch.save turns a failed write into "RuntimeError: unexpected pos"; the caller
    # (train.py's Saver) must still see the OSError that says the disk is full.
    path = checkpoint.save_checkpoint(small_state(step=1), tmp_path / "last.pt")
    before = open(path, "rb").read()
    real_fdopen = os.fdopen

    class FullFile:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 2000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint.os, "fdopen",
                        lambda *args, **kwargs: FullFile(real_fdopen(*args, **kwargs)))
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(small_state(step=2, big=torch.zeros(10_000)), path)
    assert e.value.errno == errno.ENOSPC
    assert open(path, "rb").read() == before and not temporaries(tmp_path)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (needs root and permission to mount), unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                             str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)])


def test_a_real_full_disk_fails_cleanly(small_tmpfs):
    path = small_tmpfs / "last.pt"
    checkpoint.save_checkpoint(small_state(step=1), path)
    with pytest.raises(OSError) as e:  # 400 KB into 256 KiB
        checkpoint.save_checkpoint(small_state(step=2, big=torch.ones(100_000)), path,
                                   also=[small_tmpfs / "best.pt"])
    assert e.value.errno == errno.ENOSPC
    assert checkpoint.load_checkpoint(path)["step"] == 1
    assert sorted(os.listdir(small_tmpfs)) == ["last.pt"]
    checkpoint.save_checkpoint(small_state(step=3), path)  # the space came back
    assert checkpoint.load_checkpoint(path)["step"] == 3


# ------------------------------------------------------------------------ 8. rotate

def make_rotating(directory, names, mtime_ns=1_500_000_000_000_000_000):
    for name in names:
        (directory / name).write_bytes(b"x")
        set_mtime(directory / name, mtime_ns)


def listed(monkeypatch, order):
    """Makes os.listdir return ``order``: an mtime-only sort would keep it."""
    monkeypatch.setattr(checkpoint.os, "listdir", lambda directory: list(order))


def test_rotate_orders_equal_mtimes_by_the_number_in_the_name(tmp_path, monkeypatch):
    names = ["step-100000000.pt", "step-99999999.pt", "step-00000010.pt",
             "step-00000009.pt", "step-00000002.pt"]
    make_rotating(tmp_path, names)
    listed(monkeypatch, [*names, "last.pt", "best.pt"])  # newest first
    deleted = checkpoint.rotate(str(tmp_path), 2)
    assert sorted(os.path.basename(p) for p in deleted) == [
        "step-00000002.pt", "step-00000009.pt", "step-00000010.pt"]
    assert (tmp_path / "step-100000000.pt").exists() and (tmp_path / "step-99999999.pt").exists()


def test_rotate_keeps_the_file_last_pt_links_to_when_mtimes_tie(tmp_path, monkeypatch):
    make_rotating(tmp_path, ["epoch-0003.pt", "step-00000020.pt"])
    os.link(tmp_path / "epoch-0003.pt", tmp_path / "last.pt")  # the newest save
    listed(monkeypatch, ["epoch-0003.pt", "step-00000020.pt", "last.pt"])
    assert checkpoint.rotate(str(tmp_path), 1) == [str(tmp_path / "step-00000020.pt")]


def test_rotate_goes_by_mtime_first_and_never_deletes_the_newest(tmp_path):
    make_rotating(tmp_path, ["step-00000050.pt"], 1_000_000_000_000_000_000)
    make_rotating(tmp_path, ["step-00000005.pt"], 2_000_000_000_000_000_000)
    (tmp_path / "epoch-0009.pt").mkdir()  # not a file: left alone
    assert checkpoint.rotate(str(tmp_path), 0) == [str(tmp_path / "step-00000050.pt")]
    assert checkpoint.rotate(str(tmp_path), 1) == []
    assert (tmp_path / "step-00000005.pt").exists() and (tmp_path / "epoch-0009.pt").is_dir()
