"""Hostile data, round 4 (issue 29): what an unlucky user's files and an unlucky machine do
to a run. Each case ends in one line (a warning or an ``error:``), the process ends, and
nothing that existed before is damaged."""

import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    ROOT,
    SLOW_DECODING,
    children,
    final_state,
    fork_popen,
    load_test_py,
    tiny_args,
    write_image_folder,
)
from PIL import Image

import train
from pipeline import data, decoded_cache, presets


def folder_args(run, images, *extra, image=16, batch=4, workers=0):
    """train.py flags: an image folder, a tiny network, one epoch."""
    return tiny_args(run, "--dataset", "imagefolder", "--data-dir", str(images),
                     "--num-workers", str(workers), *extra, network="simple_cnn",
                     image=image, batch=batch)


def run_train(args, timeout=120, env=None):
    """train.py in its own process: ``(returncode, stdout, stderr)``; a process that does
    not end within ``timeout`` fails the test (and is killed with its workers)."""
    process = fork_popen([sys.executable, os.path.join(ROOT, "train.py"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"train.py did not end within {timeout} s:\n{err[-3000:]}")
    return process.returncode, out, err


def lines_starting(text, prefix):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def loader_workers():
    """The worker processes (daemonic children: DataLoader workers) this process has now."""
    return [p for p in multiprocessing.active_children() if p.daemon]


# ------------------------------------------------------------ every exit path ends

def test_a_photo_folder_whose_val_files_are_all_empty_is_one_line_and_the_run_ends(
        tmp_path):
    images = write_image_folder(tmp_path / "images", per_class=2, size=(64, 64))
    for path in (images / "val").rglob("*.png"):
        path.write_bytes(b"")  # what a failed copy leaves
    rc, out, err = run_train(folder_args(tmp_path / "run", images, "--data-on-device", "off",
                                         image=64, workers=2))
    assert rc == 2, err
    assert lines_starting(err, "error:") == [
        f"error: no image in {str(images / 'val')!r} can be read (see the warnings above)"]
    assert "Traceback" not in err and "DataLoader worker" not in err


def test_a_failed_cache_build_leaves_no_decoding_worker(tmp_path, capfd):
    images = write_image_folder(tmp_path / "images", splits=("val",), per_class=2,
                                size=(64, 64))
    for path in images.rglob("*.png"):
        path.write_bytes(b"")
    folder = data.SafeImageFolder(str(images / "val"), check=False)
    with pytest.raises(data.UserError, match="^no image in .* can be read"):
        decoded_cache.decoded_folder(folder, presets.ShortSide(73, presets.v2.InterpolationMode
                                                               .BILINEAR),
                                     str(tmp_path / "cache"), num_workers=2)
    assert loader_workers() == []  # shut down by the build, not left to the exit


LEFT_RUNNING = """
import sys
sys.path.insert(0, {root!r})
import torch
from pipeline import data
dataset = data.SeededDataset(data.SyntheticImages(32, 2, 3, 8, 0, "train"), lambda x: x,
                             0, False, ["a", "b"], 3, 8)
loader = data.build_loader(dataset, batch_size=4, num_workers=2)
next(iter(loader))  # persistent workers, never shut down
raise SystemExit(3)
"""


def test_loader_workers_left_running_do_not_keep_the_process_from_ending():
    # The workers ignore SIGTERM, all that multiprocessing's exit handler sends them
    # before it waits for them.
    process = fork_popen([sys.executable, "-c", LEFT_RUNNING.format(root=ROOT)],
                         start_new_session=True)
    try:
        assert process.wait(timeout=60) == 3
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# ------------------------------------------------------------------ non-UTF-8 names

def latin1_folder(root, size):
    """An image folder with a class folder named in Latin-1 (b"caf\\xe9") and a file
    named b"\\xff.png": names that are not UTF-8."""
    images = write_image_folder(root, per_class=2, size=size)
    for split in ("train", "val"):
        base = os.fsencode(images / split)
        os.rename(os.path.join(base, b"cat"), os.path.join(base, b"caf\xe9"))
        os.rename(os.path.join(base, b"dog", b"0.png"), os.path.join(base, b"dog", b"\xff.png"))
    return images


@pytest.mark.parametrize("image", [16, 64])  # small images; photos
def test_non_utf8_names_train_log_and_evaluate(tmp_path, monkeypatch, capsys, image):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    images = latin1_folder(tmp_path / os.fsdecode(b"d\xf6ta"), (image, image))
    run, store = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    assert train.main(folder_args(run, images, "--mlflow", store, image=image)) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "warning: MLflow" not in captured.err
    said = captured.out + captured.err  # names escaped as everywhere, never raw bytes
    assert not [c for c in said if 0xDC80 <= ord(c) <= 0xDCFF] and "d\\xf6ta" in said
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(record["val_class_acc"]) == ["caf\\xe9", "dog", "emu"]
    assert (run / "command.txt").read_bytes().count(os.fsencode(images)) == 1  # its bytes
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.data.params["data_dir"] == str(images).replace("\udcf6", "\\xf6")
    report = tmp_path / "report.json"
    assert load_test_py().main(["--checkpoint", str(run / "checkpoints" / "last.pt"),
                                "--json", str(report)]) == 0
    assert sorted(json.loads(report.read_text())["per_class"]) == ["caf\\xe9", "dog", "emu"]


@pytest.mark.parametrize("image", [16, 64])  # small images; photos
def test_the_fingerprint_hashes_a_names_own_bytes(tmp_path, image):
    images = latin1_folder(tmp_path / "images", (image, image))
    config = train.with_defaults({"dataset": "imagefolder", "data_dir": str(images),
                                  "image_size": image, "num_workers": 0})
    before = data.set_identity(data.build_datasets(config)[0])
    base = os.fsencode(images / "train" / "dog")
    os.rename(os.path.join(base, b"\xff.png"), os.path.join(base, b"\xfe.png"))
    after = data.set_identity(data.build_datasets(config)[0])
    assert before["size"] == after["size"] and before["fingerprint"] != after["fingerprint"]
    assert data.build_datasets(config)[0].classes == ["caf\\xe9", "dog", "emu"]


def test_the_confusion_image_takes_names_that_are_not_utf8():
    from reporting import plots

    names = [os.fsdecode(b"caf\xe9"), os.fsdecode(b"\xff"), "emu"]  # as os.listdir reads
    image = plots.confusion_image(torch.eye(3), names, os.fsdecode(b"run d\xf6ta"))
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype.name == "uint8"


def test_a_strict_terminal_prints_a_non_utf8_path_escaped(tmp_path):
    images = latin1_folder(tmp_path / os.fsdecode(b"d\xf6ta"), (20, 24))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}  # as under en_US.UTF-8
    rc, out, err = run_train(folder_args(tmp_path / "run", images, "--data-on-device", "on"),
                             env=env)
    assert rc == 0, err
    assert "d\\xf6ta" in out and "done: " in out  # the rest of the output not lost


# ------------------------------------------------------- damaged pretrained weights

def test_a_damaged_copy_of_the_weights_is_refused_with_one_line(
        tmp_path, fake_hub, capsys):  # noqa: F811 (the fixture)
    from helpers import photo_folder, tv_args

    weights, state, cached = fake_hub
    cached.parent.mkdir(parents=True)
    served = weights.value.url[len("file://"):]
    blob = bytearray(open(served, "rb").read())
    middle = len(blob) // 2
    blob[middle:middle + 58] = bytes(b ^ 0xFF for b in blob[middle:middle + 58])
    cached.write_bytes(bytes(blob))  # in TORCH_HOME: found there, not downloaded
    run, images = tmp_path / "run", photo_folder(tmp_path / "images")
    assert train.main(tv_args(run, images)) == 2
    err = capsys.readouterr().err
    assert lines_starting(err, "error:") == [
        f"error: --pretrained torchvision: the copy of {weights} at {cached} is damaged (its "
        f"SHA-256 starts {hashlib.sha256(blob).hexdigest()[:8]}, its name says "
        f"{cached.name.split('-')[1][:8]}); delete it and it is downloaded again, or pass "
        f"--pretrained PATH"]
    assert "Traceback" not in err and not run.exists()
    cached.unlink()  # as the line says: downloaded again, and trained on
    assert train.main(tv_args(run, images)) == 0
    assert cached.read_bytes() == open(served, "rb").read()


class _Planted:
    """A pickle that runs ``os.system`` when it is unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_copy_whose_hash_matches_its_name_runs_no_code(tmp_path, monkeypatch):
    """Reliability review 7's F8: the copy in TORCH_HOME is checked against the 8 hex
    digits of SHA-256 in its name (which a planted file can be made to match) and then
    loaded with weights_only=True: a pickle that runs code is one line, the code not run."""
    import torchvision
    from helpers import put_in_torch_hub

    from ops import UserError

    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    marker = tmp_path / "MARKER"
    put_in_torch_hub(weights, {"w": _Planted(str(marker))}, tmp_path, monkeypatch)
    with pytest.raises(UserError, match=r"^--pretrained torchvision: the copy at .* does not "
                                        r"load \(Weights only load failed"):
        presets.fetch_weights(weights)
    assert not marker.exists()


# ------------------------------------------------- a stop signal in a photo cache build



def signal_during_the_build(images, args, signum):
    """Starts train.py with a slow decoded-cache build (0.1 s an image), sends ``signum``
    1 s into the training split's build; ``(returncode, stdout, stderr)``."""
    process = fork_popen([sys.executable, "-c", SLOW_DECODING.format(root=ROOT, args=args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cache = images / ".cache"
    deadline = time.monotonic() + 120
    while not (cache.is_dir() and any(f.startswith(".tmp-") for f in os.listdir(cache))):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stop_signal_ends_a_photo_cache_build_within_a_batch(tmp_path, signum):
    # (a real process and a real signal mid-build: about 5 s)
    images = write_image_folder(tmp_path / "images", per_class=20, size=(64, 64))  # 60 + 60
    run = tmp_path / "run"
    rc, out, err = signal_during_the_build(images, folder_args(run, images, image=64), signum)
    assert rc == 128 + signum, err
    assert f"{signal.Signals(signum).name}: stopped while decoding {images / 'train'} into " \
           f"its cache" in err
    assert "Traceback" not in err and "training " not in out
    assert os.listdir(images / ".cache") == []  # the val split never started; nothing left
    assert not run.exists()


@pytest.mark.parametrize("image, path", [(16, "on"), (64, "off")])  # device path; photos
def test_sigusr1_in_a_cache_build_under_slurm_requeues(
        tmp_path, monkeypatch, scontrol, image, path):  # noqa: F811 (the fixture)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    images = write_image_folder(tmp_path / "images", per_class=20, size=(image, image))
    args = folder_args(tmp_path / "run", images, "--data-on-device", path, image=image)
    rc, out, err = signal_during_the_build(images, args, signal.SIGUSR1)
    assert rc == 128 + signal.SIGUSR1, err
    assert "SIGUSR1: stopped while decoding" in err and "Traceback" not in err
    assert "SLURM job 123: requeued (scontrol requeue 123)" in out
    assert scontrol.read_text().splitlines() == ["requeue 123"]


# ------------------------------------------------ the decoded size, not the file's

def photo_config(images, **extra):
    return train.with_defaults({"dataset": "imagefolder", "data_dir": str(images),
                                "image_size": 64, "num_workers": 0, **extra})


def test_a_tiny_file_that_would_decode_to_megabytes_is_skipped_with_one_line(tmp_path,
                                                                            capfd):
    images = write_image_folder(tmp_path / "images", per_class=3, size=(64, 64))
    strip = images / "train" / "cat" / "strip.png"
    Image.new("RGB", (1, 8000), (200, 30, 30)).save(strip)  # ~120 bytes
    Image.new("RGB", (512, 64), (30, 200, 30)).save(images / "train" / "dog" / "pano.png")
    train_set, _ = data.build_datasets(photo_config(images))
    err = capfd.readouterr().err
    named = [line for line in err.splitlines() if "strip.png" in line]
    assert named == [f"warning: skipping unreadable image {strip} (1x8000 px, stored at "
                     f"73x584000 (122.0 MiB decoded): more than 32 times a square 73 px "
                     f"image, too long and thin to train on); the next readable image of "
                     f"the set stands in for it"]
    assert train_set.unreadable_count() == 1  # counted, as any unreadable file
    names = [os.path.basename(p) for p, _ in train_set.base.folder.samples]
    assert tuple(train_set.base.decoded.image(names.index("pano.png")).shape) == (3, 73, 584)
    cache = images / ".cache"
    assert sum(f.stat().st_size for f in cache.iterdir()) < 2**20  # not 122 MiB
    assert "Traceback" not in err


# ----------------------------------------------------------- one line, not a flood

def test_upscaled_photos_are_one_summary_line(tmp_path, capfd):
    images = write_image_folder(tmp_path / "images", per_class=4, size=(64, 64))  # 12 + 12
    small = images / "val" / "dog" / "small.png"
    Image.new("RGB", (40, 30), (5, 5, 5)).save(small)
    for i in range(3):  # larger than the 73 px short side photos are stored at
        Image.new("RGB", (120, 100), (9, 9, 9)).save(images / "train" / "emu" / f"big{i}.png")
    data.build_datasets(photo_config(images, num_workers=2))  # decoded by workers
    err = capfd.readouterr().err
    assert err.splitlines() == [
        f"warning: 25 of 28 photos decoded were smaller than the 73 px their short side is "
        f"stored at, so they were upscaled (1 of them smaller than the 64 px crop itself); "
        f"the smallest: {small} (40x30)"]
    data.build_datasets(photo_config(images))  # the cache reused: nothing decoded, no line
    assert capfd.readouterr().err == ""


def test_photos_none_of_them_upscaled_get_no_line(tmp_path, capfd):
    images = write_image_folder(tmp_path / "images", per_class=2, size=(80, 90))
    data.build_datasets(photo_config(images))
    assert capfd.readouterr().err == ""


# ------------------------------------------------------- a worker killed for memory

@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_a_worker_killed_by_sigkill_is_one_line_and_the_run_resumes(tmp_path):
    # What the kernel's out-of-memory killer does: SIGKILL to one DataLoader worker.
    # (a real process whose real worker is killed mid-run, then a resume: about 10 s)
    images = write_image_folder(tmp_path / "images", per_class=40)
    run = tmp_path / "run"
    args = folder_args(run, images, "--data-on-device", "off", "--epochs", "50",
                       "--ckpt-every-steps", "5", workers=2)
    process = fork_popen([sys.executable, os.path.join(ROOT, "train.py"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "checkpoints" / "last.pt").exists() and children(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline  # (a worker up:
            time.sleep(0.05)                                  # not between two epochs)
        worker = children(process.pid)[0]
        os.kill(worker, signal.SIGKILL)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, err
    assert lines_starting(err, "error:") == [
        f"error: a DataLoader worker (pid {worker}) was killed by SIGKILL: most likely the "
        f"kernel's out-of-memory killer: the machine ran out of memory; use fewer "
        f"--num-workers or a smaller --batch-size. The checkpoints are intact: continue with "
        f"--resume auto"]
    assert "Traceback" not in err
    step = final_state(run)["step"]  # every checkpoint loads
    for path in (run / "checkpoints").glob("*.pt"):
        torch.load(path, weights_only=True)
    more = folder_args(run, images, "--data-on-device", "off", "--resume", "auto",
                       "--max-steps", str(step + 2))
    assert train.main(more) == 0 and final_state(run)["step"] == step + 2


def slow_identity(image):
    time.sleep(0.2)
    return image


def test_a_worker_found_dead_while_the_loader_waits_is_named_with_its_signal():
    # The other way the DataLoader learns of it (when its SIGCHLD handler is not first):
    # "DataLoader worker (pid(s) N) exited unexpectedly", which names no signal.
    dataset = data.SeededDataset(data.SyntheticImages(64, 2, 3, 8, 0, "train"),
                                 slow_identity, 0, False, ["a", "b"], 3, 8)
    before = loader_workers()
    loader = data.build_loader(dataset, batch_size=2, num_workers=1)
    batches = iter(loader)
    next(batches)
    (worker,) = [p for p in loader_workers() if p not in before]
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly") as info:
            for _ in batches:
                pass
    finally:
        signal.signal(signal.SIGCHLD, handler)
        data.shutdown_loader(loader)
    assert data.worker_death(info.value) == (
        f"a DataLoader worker (pid {worker.pid}) was killed by SIGKILL: most likely the "
        f"kernel's out-of-memory killer: the machine ran out of memory; use fewer "
        f"--num-workers or a smaller --batch-size. The checkpoints are intact: continue with "
        f"--resume auto")


class _Iterator:
    """What the DataLoader's iterator holds of its workers."""

    def __init__(self, workers):
        self._workers = workers

    def next_batch(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_killed_as_its_batch_is_read_is_named_not_the_reset_socket():
    """The third way (a CI run saw it): the batch's shared-memory socket is reset by the
    dying worker before the DataLoader finds it dead, and the read raises
    ConnectionResetError: the line still names the worker and its signal, from the
    loader's workers in the error's frames; a reset with no dead worker is not one."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()
    os.kill(worker.pid, signal.SIGKILL)  # (reaped by worker_death's wait)
    with pytest.raises(ConnectionResetError) as info:
        _Iterator([worker]).next_batch()
    assert data.worker_death(info.value) == (
        f"a DataLoader worker (pid {worker.pid}) was killed by SIGKILL: most likely the "
        f"kernel's out-of-memory killer: the machine ran out of memory; use fewer "
        f"--num-workers or a smaller --batch-size. The checkpoints are intact: continue with "
        f"--resume auto")
    alive = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    alive.start()
    try:
        with pytest.raises(ConnectionResetError) as info:
            _Iterator([alive]).next_batch()
        assert data.worker_death(info.value) is None  # (waited 2 s for it: still alive)
        assert data.worker_death(ConnectionResetError(104, "reset")) is None
    finally:
        alive.kill()
        alive.join()
