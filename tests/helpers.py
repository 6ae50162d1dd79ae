"""Plain functions and constants shared by the test modules: train.py's flags for tiny runs
(tiny_args, seg_args), readers of a run's files (read_metrics, events, final_state),
comparisons (assert_states_equal), writers of data sets (write_image_folder, write_cifar,
write_mnist...), signals at a chosen step, real torchrun processes, the device path's
reference checks.

The rule: a plain function, class or constant that more than one test module uses lives
here, and test modules import it with ``from helpers import ...`` (never from conftest.py,
never from each other). tests/conftest.py holds only what pytest itself calls: fixtures and
hooks (and the session's settings: OpenMP's spin, the thread count). A fixture that needs a
helper imports it from here.
"""

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import fork_server
import numpy as np
import pytest
import torch
import torchrun_pool
from PIL import Image
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from config import with_defaults
from pipeline import data, device_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A format-1 checkpoint (before checkpoints carried "format"), kept to prove it still loads.
FORMAT_1 = os.path.join(ROOT, "tests", "fixtures", "checkpoint-format-1.pt")


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


def main_in_process(main, argv, capsys):
    """``main(argv)`` (train.py's or test.py's) in this process, ended as the process would
    end: (exit code, stdout, stderr); argparse's own errors (SystemExit) give their code."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def run_as_written(argv, cwd, monkeypatch, capsys):
    """A README command, split (``python train.py ...``, ``python test.py ...`` or
    ``python -m machinery.ledger ...``), run in this process from ``cwd``: (exit code,
    stdout, stderr). What those tests check is the commands' flags and what they leave, not
    an interpreter's start (3-4 s of imports a command as a process)."""
    import train
    from machinery import ledger

    mains = {("python", "train.py"): lambda: train.main, ("python", "test.py"):
             lambda: load_test_py().main, ("python", "-m"): lambda: {
                 "machinery.ledger": ledger.main}[argv[2]]}
    main = mains[tuple(argv[:2])]()
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    return main_in_process(main, argv[3:] if argv[1] == "-m" else argv[2:], capsys)


def read_metrics(run_dir):
    """The records of a run's metrics.jsonl, in order (blank lines skipped)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


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


@contextlib.contextmanager
def stop_at_step(step, signum=signal.SIGTERM):
    """Delivers a real signal to this process right after optimizer step ``step``.

    A global optimizer hook counts the steps of the run started inside the block, so it
    holds however the training loop is written.
    """
    taken = 0

    def after_optimizer_step(optimizer, args, kwargs):
        nonlocal taken
        taken += 1
        if taken == step:
            os.kill(os.getpid(), signum)

    handle = register_optimizer_step_post_hook(after_optimizer_step)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def watch_training():
    """What a run started inside the block computes in and how its weights move.

    Yields ``(dtypes, start)``, filled as the run goes: ``dtypes``, the output dtypes of
    the convolutions and linear layers called with gradients on (the training step's;
    validation runs without), and ``start``, ``[(parameter, its value before its first
    optimizer step)]`` in the order the optimizers first step them (the same in two runs
    of one network). ``update(start)`` is then the whole training's change, one vector.
    """
    dtypes, start, seen = set(), [], set()
    layers = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear)

    def after_forward(module, args, output):
        if torch.is_grad_enabled() and isinstance(module, layers):
            dtypes.add(output.dtype)

    def before_step(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    start.append((p, p.detach().clone()))

    hooks = [torch.nn.modules.module.register_module_forward_hook(after_forward),
             register_optimizer_step_pre_hook(before_step)]
    try:
        yield dtypes, start
    finally:
        for hook in hooks:
            hook.remove()


def update(start):
    """The change of every parameter ``watch_training`` saw, since its first step: one
    float32 vector."""
    return torch.cat([(p.detach().float() - p0.float()).flatten() for p, p0 in start])


# mlp without augmentation and with a constant LR, so runs of different lengths share a
# schedule; lr 0.003 keeps validation accuracy between 0 and 1 for the first epochs. The
# per-sample DataLoader (tests/pipeline/test_device_data.py runs DDP on the device path).
FLAGS = ("--no-augment", "--scheduler", "none", "--lr", "0.003", "--data-on-device", "off")
TIMEOUT = 300  # seconds for one torchrun; generous, the two cores are shared


def _child_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # two workers on two cores
    return env


def start_torchrun(args, script="train.py", nproc=2, torchrun_args=()):
    """Starts ``torchrun --standalone`` (it picks a free port) in the repository root;
    ``torchrun_args`` go before the script (``--max-restarts 3``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), *torchrun_args, script, *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def fork_popen(args, **kwargs):
    """subprocess.Popen for ``[sys.executable, SCRIPT or -c CODE or -m MODULE, ...]``, the
    child forked from a server that has imported train.py (tests/fork_server.py): a real
    process (signals, process groups, pipes, exit codes) without the 3.3 s of CPU a new
    interpreter takes to import torch. Where the interpreter's own start is the thing
    tested (a signal while it imports, an environment read at import), use subprocess."""
    return fork_server.popen(ROOT, args, **kwargs)


def fork_run(args, **kwargs):
    """subprocess.run's counterpart of ``fork_popen`` (capture_output, timeout...)."""
    return fork_server.run(ROOT, args, **kwargs)


def python_client(path):
    """Writes at ``path`` an executable that stands for ``python`` in a script (a $PYTHON):
    each call is a fork of the server ``fork_popen`` uses, with the caller's arguments,
    directory, environment and standard streams; signals are passed on, and it ends as its
    run ends. Returns the path."""
    return fork_server.client(ROOT, path)


children = torchrun_pool.children  # the pids of a process's children (read from /proc)


def worker_pids(torchrun_pid):
    """``{rank: pid}`` of torchrun's worker processes, read from their environment."""
    workers = {}
    for pid in children(torchrun_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            if b"RANK" in env:
                workers[int(env[b"RANK"])] = pid
    return workers


def _kill(proc):
    """Kills torchrun and its workers (they run in sessions of their own), by pid."""
    torchrun_pool.kill_tree(proc.pid)
    proc.communicate()


def finish(proc, timeout=TIMEOUT):
    """Waits for torchrun; returns ``(exit code, output)``; kills it all on timeout."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"torchrun did not finish within {timeout} s")
    return proc.returncode, out


def torchrun(args, script="train.py", nproc=2, torchrun_args=(), timeout=TIMEOUT):
    """A torchrun of ``script`` (train.py or a ``write_launcher`` script) expected to end
    with 0; returns its output. Two processes without torchrun flags run in this test
    process's pool (tests/torchrun_pool.py: torchrun workers that import train.py once and
    fork each run; not where CUDA is: a fork after CUDA's start fails), anything else in a
    torchrun of its own."""
    pooled = script == "train.py" or script in _PATCHES
    if pooled and nproc == 2 and not torchrun_args and not torch.cuda.is_available():
        rc, out = torchrun_pool.run(ROOT, _child_env(), args, _PATCHES.get(script), timeout)
    else:
        rc, out = finish(start_torchrun(args, script, nproc, torchrun_args), timeout)
    assert rc == 0, out[-3000:]
    return out


def assert_exit_codes(out, code):
    """Every worker that torchrun reports ended with ``code``, except those torchrun itself
    ended with SIGTERM (-15) after the first one had exited; at least one ended with it."""
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
    assert code in codes and set(codes) <= {code, -15}, out[-3000:]


def ckpt(run_dir, name):
    return os.path.join(run_dir, "checkpoints", name)


def signal_a_worker_once_an_epoch_is_saved(run_dir, args, signum, script="train.py",
                                           rank=1, torchrun_args=()):
    """Starts torchrun with ``args``, waits for its first epoch checkpoint, sends ``signum``
    to worker ``rank`` only and returns ``(exit code, output, {rank: pid})``; kills it all
    if it hangs."""
    proc = start_torchrun(args, script=script, torchrun_args=torchrun_args)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not glob.glob(ckpt(run_dir, "epoch-*.pt")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        workers = worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], proc.poll()
        os.kill(workers[rank], signum)
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            _kill(proc)
    return rc, out, workers


def write_launcher(path, patch):
    """A script that runs train.main() under torchrun after ``patch`` (Python source) ran:
    the child-process counterpart of monkeypatch."""
    path.write_text(f"import os, sys\nsys.path.insert(0, {ROOT!r})\nimport train\n"
                    f"from machinery import checkpoint\n{patch}\nsys.exit(train.main())\n")
    _PATCHES[str(path)] = patch  # (helpers.torchrun's pool runs the patch, then train.main)
    return str(path)


_PATCHES = {}  # write_launcher's scripts: their patches


def make_config(tmp_path, name, augment=True, seed=5, **extra):
    """A config for ``name`` with its files written under tmp_path."""
    if name in ("cifar10", "cifar100"):
        write_cifar(tmp_path, hundred=name == "cifar100")
    elif name in ("mnist", "fashion_mnist"):
        write_mnist(tmp_path, "MNIST" if name == "mnist" else "FashionMNIST")
    elif name == "imagefolder":
        write_image_folder(tmp_path, classes=("a", "b", "c"), per_class=5, val_per_class=2,
                           size=None, formats=("jpg", "png"))
    return with_defaults({"dataset": name, "data_dir": str(tmp_path), "seed": seed,
                          "augment": augment, "image_size": 16 if name == "imagefolder" else 12,
                          "synthetic_size": 40, "num_classes": 4, "batch_size": 8,
                          "num_workers": 0, **extra})


def assert_batches_equal(expected, got):
    assert len(expected) == len(got)
    for (x0, y0), (x1, y1) in zip(expected, got):
        assert x1.dtype == torch.float32 and y1.dtype == torch.long
        assert x0.shape == x1.shape
        assert torch.equal(x0, x1), (x0 - x1).abs().max()
        assert torch.equal(y0, y1)


def check_against_per_sample(cfg, log):
    train_set, val_set, sampler, (train, val) = folder_loaders(cfg, log)
    assert_batches_equal(per_sample(train_set, sampler), list(train))
    assert_batches_equal(whole_val(val_set), list(val))
    return train_set, val_set


KILLED_BUILD = """
import sys, time
sys.path.insert(0, {root!r})
from pipeline import data
from pipeline import decoded_cache
from pipeline import device_data
original = decoded_cache._Decoding.__getitem__
def slow(self, index):
    time.sleep(0.2)
    return original(self, index)
decoded_cache._Decoding.__getitem__ = slow
train_set, _ = data.build_datasets({cfg!r})
device_data.source_tensors(train_set, {cache!r})
"""


def write_cifar(root, hundred=False, train=40, test=12):
    """A tiny CIFAR-10/100 copy in torchvision's pickle layout (md5s are not checked:
    see ``cifar_integrity``)."""
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    g = np.random.default_rng(0)
    key = "fine_labels" if hundred else "labels"
    classes = 100 if hundred else 10

    def batch(n):
        return {"data": g.integers(0, 256, (n, 3072), dtype=np.uint8),
                key: [int(v) for v in g.integers(0, classes, n)]}

    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    for name in names:
        with open(folder / name, "wb") as f:
            pickle.dump(batch(train // len(names)), f)
    with open(folder / ("test" if hundred else "test_batch"), "wb") as f:
        pickle.dump(batch(test), f)
    meta = {"fine_label_names" if hundred else "label_names":
            [f"c{i}" for i in range(classes)]}
    with open(folder / ("meta" if hundred else "batches.meta"), "wb") as f:
        pickle.dump(meta, f)
    return root


def per_sample(dataset, sampler=None, indices=None, batch_size=None):
    """Every batch of the per-sample path (a DataLoader over the SeededDataset)."""
    if sampler is not None:
        loader = data.build_loader(dataset, batch_sampler=sampler)
    else:
        loader = data.build_loader(dataset, batch_size=batch_size, sampler=indices)
    return list(loader)


def whole_val(val_set):
    return per_sample(val_set, indices=list(range(len(val_set))), batch_size=8)


def folder_loaders(cfg, log):
    train_set, val_set = data.build_datasets(cfg)
    sampler = data.EpochBatchSampler(len(train_set), 4, cfg["seed"])
    sampler.set_epoch(1)
    loaders = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cpu", log=log)
    return train_set, val_set, sampler, loaders


def write_mnist(root, name="MNIST", train=40, test=12):
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", train), ("t10k", test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte",
                  torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte",
                  torch.arange(n, dtype=torch.uint8) % 10)
    return root


def write_idx(path, array):
    """An MNIST idx file (big-endian header, uint8 data), as torchvision reads it."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim())
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.numpy().tobytes())


def photo_folder(root, per_class=5, classes=("cat", "dog"), formats=("jpg", "png")):
    return write_image_folder(root, classes=classes, per_class=per_class, val_per_class=3,
                              size=None, size_range=(70, 200), formats=formats)


def tv_args(run_dir, images, *extra):
    return tiny_args(run_dir, "--dataset", "imagefolder", "--data-dir", str(images),
                     "--network", "torchvision/mobilenet_v3_small", "--pretrained",
                     "torchvision", "--image-size", "64", *extra, network=None, batch=4,
                     epochs=1)[2:]  # (tiny_args' own --network dropped)


EXPERIMENT = "synthetic"  # the MLflow experiment of a synthetic run: the dataset's name


def only_run(uri):
    """The one run of the experiment (asserting there is exactly one) and the client."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def closed_port():
    """A local port that refuses connections: bound, never listening (no one takes it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


SLOW_DECODING = """
import sys, time
sys.path.insert(0, {root!r})
import train
from pipeline import decoded_cache
original = decoded_cache._Decoding.__getitem__
def slow(self, index):
    time.sleep(0.1)
    return original(self, index)
decoded_cache._Decoding.__getitem__ = slow
sys.exit(train.main({args!r}))
"""  # train.main in a subprocess whose cache build decodes an image a tenth of a second


def gan_config(**overrides):
    """The resolved config of a small ``--task gan`` run (issue 27's keys): DCGAN at 28 px,
    one channel, width 8, latents of 8, on the synthetic set."""
    return with_defaults({"task": "gan", "network": "dcgan", "dataset": "synthetic",
                          "data_dir": "data", "seed": 3, "image_size": 28, "latent_dim": 8,
                          "gan_loss": "vanilla", "gan_spectral_norm": False,
                          "gan_attention": False, "gan_width": 8, "in_channels": 1,
                          "fid_samples": 16, "fid_features": None, "synthetic_size": 40,
                          "num_classes": 2, "batch_size": 8, **overrides})


def _trained_a_little(generator, seed):
    """``generator`` with weights from ``seed`` and BatchNorm running statistics moved off
    their start (as training leaves them), so that eval and train mode differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in generator.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        generator.train()
        for _ in range(3):
            generator(torch.randn(16, generator.latent_dim, generator=g))
    return generator.eval()


def write_gan_checkpoint(path, ema=False, **config_overrides):
    """A GAN checkpoint in train.py's format 3 (checkpoint.save_checkpoint: checksummed):
    ``networks`` and ``optimizers`` by name (generator, discriminator), ``ema`` with
    ``{"generator": ...}`` when ``ema``, every resume key, no ``model``/``optimizer``.

    Returns:
        The dict saved (its generators' weights are what test.py must load).
    """
    import dcgan
    from machinery import checkpoint, saving

    config = gan_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config["seed"])
        generator, discriminator = dcgan.build(config, config["in_channels"])
        average, _ = dcgan.build(config, config["in_channels"])
    _trained_a_little(generator, 1)
    networks = {"generator": generator, "discriminator": discriminator}
    progress = {"epoch": 1, "step": 5}
    rng = saving.rng_state()
    state = {"format": checkpoint.FORMAT_VERSION, "version": checkpoint.PROJECT_VERSION,
             "threads": torch.get_num_threads(), "epoch": 1, "step": 5,
             "progress": progress, "rng": rng, "rng_per_rank": [rng], "scaler": {},
             "scheduler": {"step": 5}, "data": {"train": {"size": 40}},
             "config": config,
             "networks": {name: net.state_dict() for name, net in networks.items()},
             "optimizers": {name: torch.optim.Adam(net.parameters()).state_dict()
                            for name, net in networks.items()}}
    if ema:  # another generator: which of the two test.py takes shows in its images
        state["ema"] = {"generator": _trained_a_little(average, 2).state_dict()}
    checkpoint.save_checkpoint(state, path)
    return state


def write_sources(root, per_class=5, val_per_class=2, shard_size=4):
    """The same small image set written four ways, in the same order: an ImageFolder
    (``root/folder``), a ``save_to_disk`` DatasetDict (``root/saved``), Parquet files in
    the hub's layout (``root/parquet``) and webdataset shards (``root/shards/train-*.tar``,
    ``val-*.tar``, ``shard_size`` samples each, labels as ``.cls``). Images of assorted
    sizes, JPEG and PNG. Returns ``{kind: path}``; the shards' brace patterns under
    ``"train_shards"``, ``"val_shards"``."""
    import datasets
    import webdataset

    folder = write_image_folder(root / "folder", classes=("a", "b", "c"), per_class=per_class,
                                val_per_class=val_per_class, size=None, formats=("jpg", "png"))
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b", "c"])})
    splits, shards = {}, root / "shards"
    shards.mkdir()
    for split, name in (("train", "train"), ("val", "validation")):
        samples = data.SafeImageFolder(str(folder / split)).samples
        rows = {"image": [{"bytes": open(p, "rb").read(), "path": None} for p, _ in samples],
                "label": [label for _, label in samples]}
        splits[name] = datasets.Dataset.from_dict(rows, features=features)
        count = -(-len(samples) // shard_size)
        for s in range(count):
            with webdataset.TarWriter(str(shards / f"{split}-{s:03d}.tar")) as tar:
                for i in range(s * shard_size, min((s + 1) * shard_size, len(samples))):
                    path, label = samples[i]
                    tar.write({"__key__": f"{i:05d}", os.path.splitext(path)[1][1:]:
                               open(path, "rb").read(), "cls": str(label).encode()})
        splits[split + "_count"] = count
    dataset = datasets.DatasetDict({n: splits[n] for n in ("train", "validation")})
    dataset.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for name in ("train", "validation"):
        dataset[name].to_parquet(str(root / "parquet" / f"{name}-00000-of-00001.parquet"))
    return {"folder": str(folder), "saved": str(root / "saved"),
            "parquet": str(root / "parquet"), "shards": str(shards),
            "train_shards": str(shards / f"train-{{000..{splits['train_count'] - 1:03d}}}.tar"),
            "val_shards": str(shards / f"val-{{000..{splits['val_count'] - 1:03d}}}.tar")}


@contextlib.contextmanager
def serve(directory, port=0):
    """A real HTTP server (``http.server``, in a thread) of ``directory`` on 127.0.0.1;
    yields the server (its URL: ``f"http://127.0.0.1:{server.server_port}"``)."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), functools.partial(Quiet, directory=str(directory)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def cached_hub_dataset(parquet, cache, name):
    """The hub dataset ``name`` (``user/set`` or ``set``) in the datasets cache ``cache`` as
    ``datasets.load_dataset(name)`` online leaves it (its builder's files under
    ``<cache>/<user>___<set>/default/0.0.0/<hash>``), made offline from the Parquet files
    of ``write_sources``."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {s: os.path.join(parquet, f"{s}-00000-of-00001.parquet")
             for s in ("train", "validation")}
    builder = Parquet(data_files=files, dataset_name=name.split("/")[-1], hash="0123abcd",
                      cache_dir=cache)
    builder.download_and_prepare()
    config_dir = os.path.dirname(os.path.dirname(builder.cache_dir))  # <set>/default-<hash>
    target = os.path.join(cache, name.replace("/", "___"), "default")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(config_dir, target)
