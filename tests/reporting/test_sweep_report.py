"""reporting/sweep_report.py: what a finished sweep leaves (best.yaml, the table, the hparams
view, the plots), from a study built in memory."""

import glob
import os

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from config import parse_config
from reporting import sweep_report

RECIPE = {"dataset": "synthetic", "network": "mlp", "epochs": 2, "lr": 0.1}  # lr: searched
DISTRIBUTIONS = {"lr": FloatDistribution(1e-4, 1.0, log=True),
                 "optimizer": CategoricalDistribution(["sgd", "adamw"])}


def make_study(direction, rows):
    """rows: (state, value, params, intermediate values)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=direction)
    for state, value, params, steps in rows:
        study.add_trial(create_trial(state=state, value=value, params=params,
                                     distributions=DISTRIBUTIONS, intermediate_values=steps))
    return study


ROWS = [(TrialState.COMPLETE, 0.5, {"lr": 0.01, "optimizer": "sgd"}, {2: 0.7, 4: 0.5}),
        (TrialState.PRUNED, 0.9, {"lr": 0.5, "optimizer": "adamw"}, {2: 0.9}),
        (TrialState.COMPLETE, 0.2, {"lr": 0.001, "optimizer": "adamw"}, {2: 0.4, 4: 0.2}),
        (TrialState.COMPLETE, 0.2, {"lr": 0.002, "optimizer": "sgd"}, {2: 0.3, 4: 0.2})]


@pytest.fixture
def finished(tmp_path, capsys):
    study = make_study("minimize", ROWS)
    best = sweep_report.finish(study, str(tmp_path), RECIPE, "val_loss", "minimize", 1.0,
                               [10.0, 10.0])
    return study, best, capsys.readouterr().out


def test_best_yaml_is_the_best_trials_recipe_for_train_py(finished, tmp_path):
    _, best, out = finished
    assert best.number == 2  # the lowest val_loss; of two equal, the earlier trial
    path = os.path.join(tmp_path, "best.yaml")
    with open(path) as f:
        assert yaml.safe_load(f) == {**RECIPE, "lr": 0.001, "optimizer": "adamw"}
    config, _ = parse_config(["--config", path])  # train.py takes it as it is
    assert (config["lr"], config["optimizer"], config["epochs"]) == (0.001, "adamw", 2)
    assert "best: trial 2, val_loss 0.2" in out


def test_a_higher_is_better_objective_picks_the_highest(tmp_path, capsys):
    study = make_study("maximize", ROWS)
    best = sweep_report.finish(study, str(tmp_path), RECIPE, "val_acc", "maximize", 0, [])
    assert best.number == 0
    with open(tmp_path / "best.yaml") as f:
        assert yaml.safe_load(f)["lr"] == 0.01


def test_the_table_has_a_row_per_trial(finished):
    _, _, out = finished
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("trial"))
    assert lines[header].split() == ["trial", "state", "val_loss", "step", "lr", "optimizer"]
    rows = [line.split() for line in lines[header + 1:header + 5]]
    assert rows[1] == ["1", "pruned", "0.9", "2", "0.5", "adamw"]
    assert rows[2] == ["2", "complete", "0.2", "4", "0.001", "adamw"]
    assert "the driver's own time 0.50 s per trial (5.0% of a trial's 10.0 s)" in out


def test_the_hparams_view_has_a_run_per_finished_trial(finished, tmp_path):
    runs = sorted(os.listdir(tmp_path / "hparams"))
    assert runs == ["trial-0", "trial-1", "trial-2", "trial-3"]
    events = EventAccumulator(str(tmp_path / "hparams" / "trial-1"))
    events.Reload()
    assert events.Tags()["scalars"] == ["hparams/val_loss", "hparams/step"]
    assert events.Scalars("hparams/val_loss")[0].value == pytest.approx(0.9)
    assert events.Scalars("hparams/step")[0].value == 2
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_the_plots_are_written_as_pngs(finished, tmp_path):
    _, _, out = finished
    for name in sweep_report.PLOTS:
        with open(tmp_path / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"plots: {tmp_path / name}.png" in out


def test_importances_are_skipped_below_two_completed_trials(tmp_path, capsys):
    study = make_study("minimize", ROWS[:2])
    (tmp_path / "param_importances.png").write_bytes(b"an old one")
    sweep_report.finish(study, str(tmp_path), RECIPE, "val_loss", "minimize", 0, [])
    out = capsys.readouterr().out
    assert "param_importances skipped: it needs 2 completed trials, the study has 1" in out
    assert sorted(glob.glob(str(tmp_path / "*.png"))) == [
        str(tmp_path / "intermediate_values.png"), str(tmp_path / "optimization_history.png")]


def test_no_completed_trial_no_best_yaml(tmp_path, capsys):
    study = make_study("minimize", ROWS[1:2])
    assert sweep_report.finish(study, str(tmp_path), RECIPE, "val_loss", "minimize", 0,
                               []) is None
    assert not os.path.exists(tmp_path / "best.yaml")
    assert "no trial completed, so no best.yaml" in capsys.readouterr().out
