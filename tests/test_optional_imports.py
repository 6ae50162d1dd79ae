"""prefetch_generator and torchinfo are optional: a GPU image without them still trains.

The H200 image this project borrows has neither; a run there must not die at import.
``sys.modules[name] = None`` makes ``import name`` raise ImportError, as on that image.

And what a run imports only when it uses it (issue 52): ``import train`` and --help import
no torchmetrics (with matplotlib: 0.6 s of every start), TensorBoard, MLflow or torchinfo.
"""

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, tiny_args

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


# Imported where they are used (tasks.Evaluation: at a validation; runlog: TensorBoard,
# torchinfo; tracking: --mlflow; engine: --prefetch), never by ``import train`` or --help.
LAZY = ("torchmetrics", "matplotlib", "tensorboard", "torch.utils.tensorboard", "mlflow",
        "torchinfo", "prefetch_generator")


def test_import_train_and_help_import_none_of_what_a_run_imports_when_it_uses_it():
    code = ("import contextlib, io, sys\n"
            "import train\n"
            f"print(*[m for m in {LAZY!r} if m in sys.modules], sep=',')\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    train.main(['--help'])\n"
            f"print(*[m for m in {LAZY!r} if m in sys.modules], sep=',')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    after_import, after_help = out.stdout.splitlines()
    assert after_import == "", f"import train imports {after_import}"
    assert after_help == "", f"train.py --help imports {after_help}"


def test_an_evaluation_is_a_torchmetrics_metric_of_its_class_copied_and_pickled():
    import torchmetrics

    from tasks.classification import ClassificationEvaluation

    evaluation = ClassificationEvaluation(3, "cpu")  # its Metric class made here
    evaluation.update(torch.tensor([[2.0, 0, 0], [0, 2.0, 0]]), torch.tensor([0, 2]))
    assert isinstance(evaluation, torchmetrics.Metric)
    assert isinstance(evaluation, ClassificationEvaluation)
    assert type(evaluation).__qualname__ == "ClassificationEvaluation"
    assert type(ClassificationEvaluation(3, "cpu")) is type(evaluation)  # made once
    for again in (copy.deepcopy(evaluation), pickle.loads(pickle.dumps(evaluation))):
        assert type(again) is type(evaluation)
        assert again.compute()["acc"] == evaluation.compute()["acc"] == 0.5
