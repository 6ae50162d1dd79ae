"""The decoded image-folder cache is as trustworthy as a checkpoint (issue 18): a full disk,
a killed build, damaged contents, files replaced behind its back and a stop signal during
a build each end in one line, with nothing wrong trained on and nothing left behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import KILLED_BUILD as SLOW_BUILD
from helpers import (
    ROOT,
    SLOW_DECODING,
    check_against_per_sample,
    fork_popen,
    make_config,
    tiny_args,
    write_image_folder,
)
from PIL import Image

import train
from pipeline import decoded_cache


def cache_files(cfg):
    cache = os.path.join(cfg["data_dir"], ".cache")
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def train_cache(cfg, suffix):
    """The path of the training split's cache file with this suffix (.npy, .json)."""
    name = next(f for f in cache_files(cfg) if f.startswith("decoded-train")
                and f.endswith(suffix))
    return os.path.join(cfg["data_dir"], ".cache", name)


def warnings_in(err):
    return [line for line in err.splitlines() if line.startswith("warning:")]


# --------------------------------------------------------------------- a full disk

def test_a_full_disk_during_the_build_decodes_into_memory_and_leaves_nothing(
        tmp_path, mount_tmpfs, capfd):
    # 15 + 6 images of 3x64x64 (12 KiB each) into a 64 KiB tmpfs: the disk fills up
    # while the training split is written (a memory map of a sparse file got SIGBUS).
    cfg = make_config(tmp_path, "imagefolder", image_size=64)
    cache = mount_tmpfs("size=64k", tmp_path / ".cache")
    check_against_per_sample(cfg, lambda line: None)  # the batches are still right
    err = capfd.readouterr().err
    full = [w for w in warnings_in(err) if "cannot write the decoded cache" in w]
    assert full and all("No space left on device" in w and "into memory for this run only"
                        in w for w in full), err
    assert os.listdir(cache) == [f for f in os.listdir(cache) if not f.startswith(".tmp")]
    assert not any(name.endswith(".npy") and name.startswith("decoded-train")
                   for name in os.listdir(cache))


def test_a_run_on_a_full_disk_trains_from_memory_with_one_warning(tmp_path, mount_tmpfs,
                                                                  capfd):
    images = write_image_folder(tmp_path / "images", per_class=6, size=(64, 64))
    mount_tmpfs("size=64k", images / ".cache")
    args = tiny_args(tmp_path / "run", "--dataset", "imagefolder", "--data-dir", str(images),
                     "--data-on-device", "on", network="simple_cnn", image=64, batch=6)
    assert train.main(args) == 0
    err = capfd.readouterr().err
    assert len([w for w in warnings_in(err) if "cannot write the decoded cache" in w]) == 1
    assert "Traceback" not in err
    assert not [f for f in os.listdir(images / ".cache") if f.startswith(".tmp")]


# ------------------------------------------------------------------ a killed build



def start_slow_build(cfg):
    """A process building the training split's cache slowly, once its temporary file is
    there (its name holds the process's pid)."""
    cache = os.path.join(cfg["data_dir"], ".cache")
    process = fork_popen([sys.executable, "-c", SLOW_BUILD.format(
        root=ROOT, cfg=cfg, cache=cache)])
    deadline = time.monotonic() + 60
    while not any(f.startswith(f".tmp-{process.pid}.") for f in cache_files(cfg)):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return process


def test_the_leftover_of_a_build_killed_with_sigkill_is_removed(tmp_path):
    cfg = make_config(tmp_path, "imagefolder")
    killed = []
    for _ in range(2):  # the second build removes the first one's leftover
        process = start_slow_build(cfg)
        time.sleep(0.3)
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed.append(process.pid)
    leftovers = [f for f in cache_files(cfg) if f.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".tmp-{killed[1]}.")
    lines = []
    check_against_per_sample(cfg, lines.append)  # the next build removes them
    assert all("built in" in line for line in lines)
    assert not [f for f in cache_files(cfg) if f.startswith(".tmp-")]


def test_a_live_builds_temporary_file_is_left_alone(tmp_path):
    cfg = make_config(tmp_path, "imagefolder")
    process = start_slow_build(cfg)
    try:
        name = next(f for f in cache_files(cfg) if f.startswith(f".tmp-{process.pid}."))
        check_against_per_sample(cfg, lambda line: None)  # another run meanwhile
        assert process.poll() is None and name in cache_files(cfg)
    finally:
        process.kill()
        process.wait()


# ----------------------------------------------------------------- damaged contents

def damage_pixels(cfg):
    path = train_cache(cfg, ".npy")
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def edit_labels(cfg):
    path = train_cache(cfg, ".json")
    record = json.load(open(path))
    record["labels"][0] = (record["labels"][0] + 1) % 3
    json.dump(record, open(path, "w"))


def name_a_missing_file(cfg, consistent=False):
    path = train_cache(cfg, ".json")
    record = json.load(open(path))
    record["unreadable"]["a/not-there.png"] = "cannot identify image file"
    if consistent:  # its checksum made to match: what the folder holds must, too
        record["checksum"]["record"] = decoded_cache._record_checksum(record)
    json.dump(record, open(path, "w"))


def name_a_missing_file_consistently(cfg):
    name_a_missing_file(cfg, consistent=True)


def cut_short(cfg):
    path = train_cache(cfg, ".npy")
    os.truncate(path, os.path.getsize(path) - 768)


def not_json(cfg):
    with open(train_cache(cfg, ".json"), "w") as f:
        f.write("{\"fingerprint\": ")


@pytest.mark.parametrize("damage, problem", [
    (damage_pixels, "its images do not match their checksum"),
    (edit_labels, "its record does not match its checksum"),
    (name_a_missing_file, "its record does not match its checksum"),
    (name_a_missing_file_consistently, "its record does not describe this folder"),
    (cut_short, "its images cannot be read"),
    (not_json, "its record cannot be read"),
])
def test_a_damaged_cache_is_warned_about_and_rebuilt(tmp_path, capfd, damage, problem):
    cfg = make_config(tmp_path, "imagefolder")
    check_against_per_sample(cfg, lambda line: None)
    capfd.readouterr()
    damage(cfg)
    lines = []
    check_against_per_sample(cfg, lines.append)  # the batches equal the per-sample path's
    err = capfd.readouterr().err
    assert len(warnings_in(err)) == 1, err
    assert warnings_in(err)[0].startswith(f"warning: the decoded cache "
                                          f"{train_cache(cfg, '.npy')} is damaged ({problem}")
    assert warnings_in(err)[0].endswith("; rebuilding it") and "Traceback" not in err
    assert [line.endswith("reused") for line in lines] == [False, True]  # train rebuilt
    lines.clear()
    check_against_per_sample(cfg, lines.append)
    assert all(line.endswith("reused") for line in lines)
    assert capfd.readouterr().err == ""


# ------------------------------------------------- files replaced behind its back

@pytest.mark.parametrize("how", ["cp -p", "rsync -a"])
def test_an_image_replaced_with_its_old_size_and_time_rebuilds(tmp_path, how):
    # A file of the same size with the old modification time: what cp -p, tar x and
    # rsync -a leave. Only the status-change time (and, after rsync, the inode) differ.
    cfg = make_config(tmp_path, "imagefolder")
    image = tmp_path / "train" / "b" / "z.bmp"  # uncompressed: other pixels, same size
    Image.new("RGB", (20, 24), (10, 200, 90)).save(image)
    check_against_per_sample(cfg, lambda line: None)
    before = image.stat()
    other = tmp_path / "other.bmp"
    Image.new("RGB", (20, 24), (250, 5, 5)).save(other)
    assert other.stat().st_size == before.st_size
    time.sleep(0.02)  # a ctime the old file cannot have
    if how == "cp -p":  # written in place: the same inode
        image.write_bytes(other.read_bytes())
    else:  # a temporary file renamed over the old one: a new inode
        os.replace(other, image)
    os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (image.stat().st_size, image.stat().st_mtime_ns) == (before.st_size,
                                                                before.st_mtime_ns)
    lines = []
    check_against_per_sample(cfg, lines.append)  # both paths see the new pixels
    assert [line.endswith("reused") for line in lines] == [False, True]


# ------------------------------------------------------- a stop signal in a build



@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_a_build_stops_at_once_and_cleanly(tmp_path, signum):
    images = write_image_folder(tmp_path / "images", per_class=30)  # 90 + 90: ~18 s
    run = tmp_path / "run"
    args = tiny_args(run, "--dataset", "imagefolder", "--data-dir", str(images),
                     "--data-on-device", "on", network="simple_cnn", image=16, batch=6)
    process = fork_popen([sys.executable, "-c", SLOW_DECODING.format(root=ROOT, args=args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cache = images / ".cache"
    deadline = time.monotonic() + 60
    while not (cache.is_dir() and any(f.startswith(".tmp-") for f in os.listdir(cache))):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)  # not after the whole build
    assert process.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert f"{name}: stopped while decoding {images / 'train'} into its cache" in err
    assert "Traceback" not in err and "training " not in out
    assert os.listdir(cache) == []  # no temporary file, no cache
    assert not run.exists()  # the run directory it made is gone
