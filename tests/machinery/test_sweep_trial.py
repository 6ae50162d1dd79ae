"""machinery/sweep_trial.py: a trial's reports to its study and the pruning decision, on a
real Optuna study in SQLite (one process; the two-process path runs in tests/test_sweep.py)."""

import json
import math

import optuna
import pytest
import torch

from machinery import sweep_trial
from machinery.runtime import Processes

ONE = Processes(0, 1, torch.device("cpu"))


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A study of two completed trials (val_loss 1.0 and 2.0 at step 4, a tenth at 8) and a
    running trial 2, with this process as trial 2's train.py."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s", direction="minimize")
    for value in (1.0, 2.0):
        trial = study.ask()
        trial.report(value, 4)
        trial.report(value / 10, 8)
        study.tell(trial, value)
    study.ask()
    monkeypatch.setenv(sweep_trial.ENV, json.dumps({
        "storage": url, "study": "s", "trial": 2, "pruner": {"median": {"n_startup_trials": 2}},
        "objective": "val_loss"}))
    monkeypatch.setattr(sweep_trial, "_decided", {})
    monkeypatch.setattr(sweep_trial, "_opened", {})
    monkeypatch.setattr(sweep_trial, "_world", {})
    return study


def trial_2(study):
    return study.get_trials()[2]


def fresh_process(monkeypatch):
    """What a resumed train.py knows: nothing but the study."""
    monkeypatch.setattr(sweep_trial, "_decided", {})
    monkeypatch.setattr(sweep_trial, "_opened", {})


def test_outside_a_sweep_nothing_is_reported_or_stopped(monkeypatch):
    monkeypatch.delenv(sweep_trial.ENV, raising=False)
    monkeypatch.setattr(sweep_trial, "_decided", {})
    figures = {"val_loss": 9.0}
    assert sweep_trial.reported(ONE, 4, figures) is figures
    assert sweep_trial.pruned(ONE, 4, 0) is False
    assert sweep_trial.exit_code() == 0


def test_a_good_value_goes_on_and_is_reported_at_its_step(study):
    figures = {"val_loss": 0.5, "val_acc": 0.9}
    assert sweep_trial.reported(ONE, 4, figures) is figures
    assert trial_2(study).intermediate_values == {4: 0.5}
    assert sweep_trial.pruned(ONE, 4, 0) is False
    assert sweep_trial.exit_code() == 0
    assert sweep_trial.PRUNED_ATTR not in trial_2(study).system_attrs


def test_a_bad_value_is_pruned_recorded_and_exits_pruned(study, capsys):
    sweep_trial.reported(ONE, 4, {"val_loss": 5.0})  # worse than the median (1.5)
    assert trial_2(study).system_attrs[sweep_trial.PRUNED_ATTR] == 4
    assert sweep_trial.pruned(ONE, 4, 0) is True
    assert "stopped trial 2 at step 4" in capsys.readouterr().out
    assert sweep_trial.exit_code() == sweep_trial.EXIT_PRUNED


def test_a_trial_pruned_after_going_on_exits_pruned(study):
    sweep_trial.reported(ONE, 4, {"val_loss": 1.2})  # below the median (1.5), then above
    sweep_trial.reported(ONE, 8, {"val_loss": 1.0})  # (0.15)
    assert [sweep_trial.pruned(ONE, 4, 0), sweep_trial.pruned(ONE, 8, 0)] == [False, True]
    assert sweep_trial.exit_code() == sweep_trial.EXIT_PRUNED


def test_a_value_is_reported_once(study, monkeypatch):
    sweep_trial.reported(ONE, 4, {"val_loss": 0.5})
    fresh_process(monkeypatch)  # resumed from the checkpoint before that validation
    sweep_trial.reported(ONE, 4, {"val_loss": 0.75})
    assert trial_2(study).intermediate_values == {4: 0.5}


def test_a_missing_objective_is_reported_as_nan_and_pruned(study):
    sweep_trial.reported(ONE, 4, {"val_acc": 0.5})
    assert math.isnan(trial_2(study).intermediate_values[4])
    assert sweep_trial.pruned(ONE, 4, 0) is True


def test_a_resumed_trial_stops_where_the_study_says(study, monkeypatch):
    sweep_trial.reported(ONE, 4, {"val_loss": 5.0})
    fresh_process(monkeypatch)
    # resumed from the checkpoint taken before the validation (the epoch's samples all
    # seen): it validates again first, and that validation's answer stops it
    assert sweep_trial.pruned(ONE, 4, 32) is False
    assert sweep_trial.reported(ONE, 4, {"val_loss": 5.0})
    assert sweep_trial.pruned(ONE, 4, 0) is True
    fresh_process(monkeypatch)
    # resumed from the epoch's last.pt, written after the decision: stops at once
    assert sweep_trial.pruned(ONE, 4, 0) is True
    assert sweep_trial.exit_code() == sweep_trial.EXIT_PRUNED
    fresh_process(monkeypatch)
    assert sweep_trial.pruned(ONE, 0, 0) is False  # a fresh start is never pruned


def test_a_decision_to_go_on_is_asked_again_not_recorded(study, monkeypatch):
    sweep_trial.reported(ONE, 4, {"val_loss": 0.5})
    fresh_process(monkeypatch)
    assert sweep_trial.pruned(ONE, 4, 0) is False  # read from the study: no prune there


def test_storages_and_pruners(tmp_path):
    assert isinstance(sweep_trial.open_storage(str(tmp_path / "journal.log")),
                      optuna.storages.JournalStorage)
    assert isinstance(sweep_trial.open_storage(f"sqlite:///{tmp_path / 'x.db'}"),
                      optuna.storages.RDBStorage)
    median = sweep_trial.build_pruner({"median": {"n_startup_trials": 2}})
    assert isinstance(median, optuna.pruners.MedianPruner)
    assert median._n_startup_trials == 2
    assert isinstance(sweep_trial.build_pruner("hyperband"), optuna.pruners.HyperbandPruner)
    assert isinstance(sweep_trial.build_pruner("none"), optuna.pruners.NopPruner)
