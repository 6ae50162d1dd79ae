"""checkpoint.py on its own: atomic writes, checksums, safe loading, RNG, rotation, the
run-directory lock. Fast: no training runs."""

import errno
import os
import random
import stat
import struct
import threading
import zipfile

import numpy as np
import pytest
import torch
from helpers import FORMAT_1, ROOT

from machinery import checkpoint, saving


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
    return saving.rng_state()


def test_rng_state_round_trip_restores_every_generator(tmp_path):
    state = saved_rng()
    first = advance_and_draw()
    saving.set_rng_state(state)
    assert advance_and_draw() == first
    path = checkpoint.save_checkpoint({"rng": state}, tmp_path / "rng.pt")
    loaded = checkpoint.load_checkpoint(path)["rng"]  # weights_only
    advance_and_draw()
    saving.set_rng_state(loaded)
    assert advance_and_draw() == first


@pytest.mark.parametrize("generator, module, name", [
    (0, random, "setstate"), (1, np.random, "set_state"), (2, torch, "set_rng_state")])
def test_rng_round_trip_fails_without_each_restore(monkeypatch, generator, module, name):
    # The round-trip test above must catch a missing restore of any one generator.
    state = saved_rng()
    first = advance_and_draw()
    monkeypatch.setattr(module, name, lambda *args: None)
    saving.set_rng_state(state)
    again = advance_and_draw()
    assert [a == b for a, b in zip(first, again)] == [i != generator for i in range(3)]


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
def small_tmpfs(mount_tmpfs):
    """A 256 KiB tmpfs (needs root and permission to mount), unmounted afterwards."""
    return mount_tmpfs("size=256k")


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


# ------------------------------------------------------------------------ 7. rotate

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


# ------------------------------------------------------------- 8. format versions


def test_the_project_version_is_pyprojects():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert f'version = "{checkpoint.PROJECT_VERSION}"' in f.read()


def test_a_checkpoint_records_its_format_and_version(tmp_path):
    from helpers import final_state, tiny_args

    import train

    assert train.main(tiny_args(tmp_path, size=32, image=4, batch=16)) == 0
    state = final_state(tmp_path)
    assert state["format"] == checkpoint.SINGLE_FORMAT == 2  # one network: format 2, as ever
    assert checkpoint.FORMAT_VERSION == 3  # several, by name (tests/tasks/test_gan.py)
    assert state["version"] == checkpoint.PROJECT_VERSION and state["threads"] >= 1


def test_a_checkpoint_of_format_1_still_loads_and_resumes(tmp_path, capsys):
    # Written by the code of 2026-12-01 before formats were recorded; kept from now on.
    from helpers import final_state, load_test_py, tiny_args

    import train

    state = checkpoint.load_checkpoint(FORMAT_1)
    assert "format" not in torch.load(FORMAT_1, weights_only=True)
    assert state["format"] == 2 and state["version"] == "before 0.2.0"
    assert load_test_py().main(["--checkpoint", FORMAT_1, "--device", "cpu",
                                "--num-workers", "0"]) == 0
    args = tiny_args(tmp_path, "--resume", FORMAT_1, "--no-augment", size=32, image=4,
                     batch=16, epochs=2)
    assert train.main(args) == 0
    assert final_state(tmp_path)["epoch"] == 2 and final_state(tmp_path)["format"] == 2


def test_an_old_checkpoints_best_val_acc_is_read_as_the_best():
    # Until issue 48 the progress key of best.pt's figure was best_val_acc.
    from machinery import engine

    state = engine.TrainState()
    assert state.best == -float("inf")  # any first validation's figure is the best
    state.load_state_dict(checkpoint.load_checkpoint(FORMAT_1)["progress"])
    assert state.best == 1.0 and "best_val_acc" not in state.state_dict()
    state.load_state_dict({"best_val_acc": -3.5, "best_epoch": 2})  # (a negated FID)
    assert (state.best, state.best_epoch) == (-3.5, 2)
    assert not state.record_best(-4.0) and state.record_best(-3.0)


def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line(tmp_path, capsys):
    from helpers import tiny_args

    import train

    state = torch.load(FORMAT_1, weights_only=True)
    state.pop("checksum")
    state.update(format=checkpoint.FORMAT_VERSION + 1, version="9.9.9")
    newer = tmp_path / "newer.pt"
    checkpoint.save_checkpoint(state, newer)
    with pytest.raises(checkpoint.CheckpointError, match=r"is of format 4 \(written by "
                       r"version 9\.9\.9 of this project\); this is version 0\.2\.0, which "
                       r"reads formats up to 3"):
        checkpoint.load_checkpoint(newer)
    assert train.main(tiny_args(tmp_path / "run", "--resume", str(newer))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "format 4" in err[0] and "version 0.2.0" in err[0]


def test_a_resume_with_another_thread_count_says_how_to_restore_it(tmp_path, capsys):
    from helpers import tiny_args

    import train

    assert train.main(tiny_args(tmp_path, size=32, image=4, batch=16)) == 0
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        torch.set_num_threads(threads + 1)
        assert train.main(tiny_args(tmp_path, "--resume", "auto", size=32, image=4,
                                    batch=16, epochs=2)) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert f"was trained with {threads} CPU thread(s) per process, this run has " \
           f"{threads + 1}" in err and f"OMP_NUM_THREADS={threads} restores it" in err


def test_a_cuda_resume_on_the_other_data_path_says_how_to_keep_it():
    """The CUDA review's L7: --data-on-device auto decides by the free memory, which a
    restart may find otherwise; on CUDA the two paths round a resize apart, so a resume
    on the other path says so, and which flag keeps the path. On the CPU (the same bits)
    nothing is recorded."""
    from pipeline import device_data

    loader = object.__new__(device_data.DeviceLoader)
    assert device_data.path_record(loader, "cpu") == {}
    assert device_data.path_record(loader, "cuda") == {"path": "device"}
    assert device_data.path_record(object(), "cuda:1") == {"path": "loader"}
    said = []
    saved = {"data": {"train": {"size": 4}, "path": "device"}}
    device_data.check_same_path(saved, "last.pt", {"train": {"size": 4}, "path": "loader"},
                                said.append)
    assert said == ["warning: 'last.pt' was trained on the device data path, this run takes "
                    "the per-sample DataLoader (--data-on-device auto decides by the free "
                    "memory): on CUDA their resizes round apart by up to one level, so it "
                    "will not end bit for bit as the run that never stopped; "
                    "--data-on-device on keeps its path"]
    for now in ({"train": {"size": 4}, "path": "device"}, {"train": {"size": 4}}):
        device_data.check_same_path(saved, "last.pt", now, said.append)
    device_data.check_same_path({"data": {"train": {"size": 4}}}, "last.pt",
                                {"train": {"size": 4}, "path": "loader"}, said.append)
    assert len(said) == 1  # the same path, a CPU run, a checkpoint from before: nothing
