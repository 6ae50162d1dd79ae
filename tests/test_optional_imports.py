"""prefetch_generator and torchinfo are optional: a GPU image without them still trains.

The H200 image this project borrows has neither; a run there must not die at import.
``sys.modules[name] = None`` makes ``import name`` raise ImportError, as on that image.
"""

import os
import sys

import pytest
import torch
from helpers import tiny_args

import train
from machinery import engine


@pytest.fixture
def without(monkeypatch):
    """Makes the named modules unimportable for the test (and train.py's imports fresh)."""
    def block(*names):
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
    return block


def test_a_run_without_prefetch_generator_and_torchinfo_trains(tmp_path, capsys, without):
    without("prefetch_generator", "torchinfo")
    assert train.main(tiny_args(tmp_path / "run", "--prefetch", "0")) == 0
    out = capsys.readouterr().out
    assert "warning: torchinfo is not installed: no network summary" in out
    assert not os.path.exists(tmp_path / "run" / "summary.txt")
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")  # the run itself went on


def test_prefetch_without_prefetch_generator_is_one_error_line(tmp_path, capsys, without):
    without("prefetch_generator")
    code = train.main(tiny_args(tmp_path / "run", "--prefetch", "2", "--no-augment",
                                "--data-on-device", "off"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: --prefetch 2 needs prefetch_generator")


def test_the_prefetcher_imports_prefetch_generator_only_when_it_prefetches(without):
    without("prefetch_generator")
    batches = [torch.zeros(1), torch.ones(1)]
    assert [b.item() for b in engine._Prefetcher(batches, 0)] == [0.0, 1.0]
    with pytest.raises(engine.UserError, match="needs prefetch_generator"):
        engine._Prefetcher(batches, 2)
