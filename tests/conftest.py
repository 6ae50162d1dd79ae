"""Shared helpers: tiny, fast training runs on synthetic data, on the CPU."""

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small runs need no more threads than the CI machine's 2 cores; fixed for reproducibility.
torch.set_num_threads(2)


def tiny_args(run_dir, *extra, network="mlp", size=64, image=8, batch=16, epochs=1):
    """train.py flags for a run that takes a second or two on a CPU."""
    return ["--dataset", "synthetic", "--network", network, "--synthetic-size", str(size),
            "--image-size", str(image), "--batch-size", str(batch), "--epochs", str(epochs),
            "--num-workers", "0", "--run-dir", str(run_dir), "--log-every", "1",
            "--optimizer", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "--device", "cpu",
            *extra]


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
