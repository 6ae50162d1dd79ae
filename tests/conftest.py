"""Shared helpers: tiny, fast training runs on synthetic data, on the CPU."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys

# Idle OpenMP threads spin briefly, then sleep (set before torch loads libgomp, inherited by
# every train.py, torchrun and bench process the tests start). On 2 cores shared with other
# processes (torchrun's and the DataLoader's workers, other jobs), libgomp's default spin
# (300,000 rounds) holds the core the computing thread needs: a tiny run took 10-30x longer,
# at random. 1000 rounds cost nothing on an idle machine (OMP_WAIT_POLICY=passive, no spin,
# made a small unet's runs 1.7x slower). The numbers computed do not change.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small runs need no more threads than the CI machine's 2 cores; fixed for reproducibility.
torch.set_num_threads(2)


# The quick half of the suite (`python -m pytest -m "not slow"`): modules of unit tests on
# small tensors and files. Every other module trains through train.py, starts processes
# (torchrun, subprocesses) or waits for signals, and is marked slow.
QUICK_MODULES = {"test_config", "test_layers", "test_losses", "test_ops_blocks", "test_files",
                 "test_runtime", "test_runlog", "test_data", "test_seg_parts",
                 "test_segmentation_data", "test_docs_blocks", "test_optional_imports",
                 "test_gan_parts", "test_checkpoint", "test_cuda", "test_layout"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ not in QUICK_MODULES:
            item.add_marker(pytest.mark.slow)


def tiny_args(run_dir, *extra, network="mlp", size=64, image=8, batch=16, epochs=1):
    """train.py flags for a run that takes a second or two on a CPU."""
    return ["--dataset", "synthetic", "--network", network, "--synthetic-size", str(size),
            "--image-size", str(image), "--batch-size", str(batch), "--epochs", str(epochs),
            "--num-workers", "0", "--run-dir", str(run_dir), "--log-every", "1",
            "--optimizer", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "--device", "cpu",
            *extra]


def seg_args(run_dir, *extra, network="unet", size=32, image=16, batch=8, epochs=1,
             classes=3):
    """train.py flags for a tiny --task segmentation run on the synthetic shapes."""
    return ["--task", "segmentation", "--dataset", "synthetic", "--network", network,
            "--synthetic-size", str(size), "--image-size", str(image), "--num-classes",
            str(classes), "--batch-size", str(batch), "--epochs", str(epochs),
            "--num-workers", "0", "--run-dir", str(run_dir), "--log-every", "1",
            "--optimizer", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "--device", "cpu",
            *extra]


def read_metrics(run_dir):
    """The records of a run's metrics.jsonl."""
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def events(run_dir):
    """TensorBoard's own reader over a run directory's event files, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def put_in_torch_hub(weights, state, tmp_path, monkeypatch):
    """``state`` saved where torch.hub looks for ``weights`` (TORCH_HOME/hub/checkpoints),
    under a name carrying its own hash as torchvision's do; no network."""
    blob = tmp_path / "blob.pth"
    torch.save(state, blob)
    stem = weights.url.rsplit("/", 1)[1].rsplit("-", 1)[0]
    name = f"{stem}-{hashlib.sha256(blob.read_bytes()).hexdigest()[:8]}.pth"
    monkeypatch.setattr(weights.value, "url", f"https://download.pytorch.org/models/{name}")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    hub = tmp_path / "torch_home" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    blob.rename(hub / name)


def snapshot(directory):
    """Every file under ``directory``: relative name -> bytes (to check nothing changed)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def load_test_py():
    """Imports the project's test.py by path (``import test`` would find the stdlib's)."""
    spec = importlib.util.spec_from_file_location("project_test", os.path.join(ROOT, "test.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train_main():
    import train
    return train.main


_CLASS_COLOURS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "emu": (30, 30, 200),
                  "fox": (200, 200, 30)}


def write_image_folder(root, splits=("train", "val"), classes=("cat", "dog", "emu"),
                       per_class=6, val_per_class=None, size=(20, 24), formats=("png",),
                       seed=0, size_range=(6, 30)):
    """A small ImageFolder tree: ``root/<split>/<class>/<i>.<format>``, a colour per class
    plus noise (learnable).

    Args:
        root: where the tree goes (a pathlib.Path; created).
        splits, classes: the split and class folders.
        per_class: images per class; ``val_per_class`` for splits other than train.
        size: ``(height, width)`` of every image, or None for assorted sizes (each side
            drawn from ``size_range``: 6-29 px by default), which makes resizing matter.
        formats: file suffixes taken in turn (``("jpg", "png")``: 0.jpg, 1.png, ...).
        seed: the noise and sizes.

    Returns:
        ``root``.
    """
    g = np.random.default_rng(seed)
    for split in splits:
        count = per_class if split == "train" or val_per_class is None else val_per_class
        for k, name in enumerate(classes):
            colour = _CLASS_COLOURS.get(name, ((70 * k + 40) % 256, (130 * k) % 256, 90))
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                h, w = size if size is not None else (int(v) for v in
                                                      g.integers(*size_range, 2))
                noise = g.integers(0, 40, (h, w, 3), dtype=np.uint8)
                pixels = np.array(colour, dtype=np.uint8) + noise
                Image.fromarray(pixels).save(folder / f"{i}.{formats[i % len(formats)]}")
    return root


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(options, where=None)``: mounts a real tmpfs (``size=256k``, ``ro``...)
    at ``where`` (default: a new directory in tmp_path) and returns it; unmounted after
    the test. Skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    mounted = []

    def mount(options, where=None):
        if os.name != "posix" or not shutil.which("mount"):
            pytest.skip("needs mount(8)")
        where = where or tmp_path / f"mnt{len(mounted)}"
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """``trained_run(*flags, **tiny_args_kwargs)``: the run directory of a finished tiny
    training (``tiny_args``), trained once per session for each set of arguments and
    shared by the test files that evaluate or export it (do not change its files)."""
    import train

    runs = {}

    def run(*extra, **kwargs):
        key = (extra, tuple(sorted(kwargs.items())))
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("trained")
            assert train.main(tiny_args(run_dir, *extra, **kwargs)) == 0
            runs[key] = run_dir
        return runs[key]

    return run


def final_state(run_dir):
    """The last checkpoint of a run, loaded safely."""
    return torch.load(os.path.join(run_dir, "checkpoints", "last.pt"), weights_only=True)


def assert_states_equal(a, b):
    """Every tensor of two nested structures is torch.equal (bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b), set(a) ^ set(b)
        for k in a:
            assert_states_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_states_equal(x, y)
    else:
        assert a == b, (a, b)


sys.path.insert(0, ROOT)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """torchvision's mobilenet_v3_small weights served from a local file (a real download
    through torch.hub, hash-checked): random weights, a name with their hash."""
    import torchvision

    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    state = torchvision.models.mobilenet_v3_small().state_dict()
    served = tmp_path / "served"
    served.mkdir()
    blob = served / "blob.pth"
    torch.save(state, blob)
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()[:8]
    named = served / f"mobilenet_v3_small-{digest}.pth"
    os.replace(blob, named)
    monkeypatch.setattr(weights.value, "url", named.as_uri())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return weights, state, tmp_path / "torch_home" / "hub" / "checkpoints" / named.name


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in scontrol on PATH that writes down its arguments."""
    shim, log = tmp_path / "bin", tmp_path / "scontrol.log"
    shim.mkdir()
    (shim / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (shim / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    return log
