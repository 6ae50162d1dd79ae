"""sweep.py: the recipe's checks (one error line before any trial), the per-trial sampler
(a restarted driver proposes the same values), and real sweeps of two-process trials on the
synthetic set with gloo: pruned at one step in both processes, and killed at random moments
then resumed into the same study and the same checkpoints as an uninterrupted sweep."""

import contextlib
import glob
import os
import random
import signal
import subprocess
import sys
import time

import optuna
import pytest
import torch
import yaml
from helpers import ROOT, _child_env, fork_popen, python_client

import sweep
from machinery import sweep_trial
from machinery.verify_resume import first_difference

BASE = {"dataset": "synthetic", "network": "mlp", "synthetic_size": 64, "image_size": 8,
        "batch_size": 16, "epochs": 3, "augment": False, "scheduler": "none",
        "data_on_device": "off", "num_workers": 0, "sample_ledger": True}
SWEEP = {"trials": 6, "sampler": "tpe", "pruner": {"median": {"n_startup_trials": 2}},
         "seed": 1, "objective": "loss",
         "space": {"lr": {"log_uniform": [1.0e-3, 1.0]}, "optimizer": {"choice": ["sgd",
                                                                                "adamw"]}}}


def write_recipe(path, recipe=None, section=None):
    with open(path, "w") as f:
        yaml.safe_dump({**(BASE if recipe is None else recipe),
                        **({"sweep": SWEEP if section is None else section}
                           if section is not False else {})}, f)
    return str(path)


def refused(tmp_path, capsys, section=None, fixed=(), recipe=None, sweep_dir=None):
    """Runs sweep.py on a recipe expected to be refused; returns its one error line."""
    path = write_recipe(tmp_path / "r.yaml", recipe, section)
    sweep_dir = sweep_dir or str(tmp_path / "sweep")
    argv = [path, "--sweep-dir", sweep_dir, *(["--", *fixed] if fixed else [])]
    capsys.readouterr()
    assert sweep.main(argv) == sweep.EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def with_space(**space):
    return {**SWEEP, "space": space}


@pytest.mark.parametrize("section, fixed, expected", [
    (with_space(lrr={"uniform": [0.1, 0.2]}),
     (), "sweep.space.lrr: train.py has no flag --lrr to search (did you mean lr?)"),
    (with_space(lr={"uniform": [-0.1, 0.1]}), (), "sweep.space.lr = -0.1: "),
    (with_space(batch_size={"int": [0, 32], "step": 8}), (), "sweep.space.batch_size = 0: "),
    (with_space(batch_size={"int": [8, 40], "step": 16}),
     ("--virtual-batch-size", "32"), "sweep.space.batch_size = 40: "),
    (with_space(optimizer={"choice": ["sgd", "adamm", "adamw"]}), (),
     "sweep.space.optimizer = 'adamm'"),
    (with_space(lr={"log_uniform": [0.0, 0.1]}), (), "low must be above 0"),
    (with_space(lr={"uniform": [0.1, 0.01]}), (), "low < high"),
    (with_space(lr={"normal": [0.1, 0.01]}), (), "sweep.space.lr: {'normal'"),
    (with_space(lr={"uniform": [0.1, 0.2], "step": 2}), (), "sweep.space.lr: "),
    (with_space(run_dir={"choice": ["a", "b"]}), (), "the sweep sets --run-dir itself"),
    (with_space(lr={"uniform": [0.01, 0.1]}), ("--lr", "0.1"),
     "--lr is both searched (sweep.space) and fixed (after --)"),
    ({**SWEEP, "trails": 5}, (), "sweep.trails in"),
    ({**SWEEP, "trials": 0}, (), "sweep.trials 0: a positive integer"),
    ({**SWEEP, "sampler": "cmaes"}, (), "sweep.sampler 'cmaes': one of tpe, random, grid"),
    ({**SWEEP, "pruner": "mean"}, (), "sweep.pruner 'mean': one of median, hyperband, none"),
    ({**SWEEP, "objective": "f1"}, (), "sweep.objective 'f1': --task classification "
     "validates loss, acc, acc5"),
    ({**SWEEP, "sampler": "grid"}, (), "sweep.sampler grid: sweep.space.lr is a range of "
     "floats"),
    (SWEEP, ("--epochs", "-1"), "the recipe"),
    (SWEEP, ("--resume", "auto"), "--resume after --: the sweep sets it itself"),
    (False, (), "has no sweep: section"),
])
def test_a_wrong_sweep_is_one_error_line_before_any_trial(tmp_path, capsys, section, fixed,
                                                          expected):
    line = refused(tmp_path, capsys, section, fixed)
    assert expected in line, line
    assert not os.path.exists(tmp_path / "sweep")  # no study, no trial


def test_a_recipe_key_train_py_lacks_is_refused_with_the_recipe_named(tmp_path, capsys):
    line = refused(tmp_path, capsys, recipe={**BASE, "epochz": 2})
    assert f"the recipe '{tmp_path / 'r.yaml'}': unknown key 'epochz'" in line
    assert line.count(".yaml") == 1  # (not the copy the checks read)


def test_a_recipe_with_an_alias_is_refused_as_train_py_refuses_it(tmp_path, capsys):
    """The recipe is read as train.py reads one: anchors and aliases (a "billion laughs")
    and a key given twice are one error line before anything is written."""
    path = tmp_path / "r.yaml"
    path.write_text("lr: &a 0.1\nmomentum: *a\nsweep: {trials: 1}\n")
    capsys.readouterr()
    assert sweep.main([str(path), "--sweep-dir", str(tmp_path / "sweep")]) == \
        sweep.EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "anchors and aliases (&name, *name) are not allowed" in err[0]
    assert not os.path.exists(tmp_path / "sweep")


def test_another_sweep_in_the_same_directory_is_refused(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    os.makedirs(sweep_dir)
    study = optuna.create_study(storage=f"sqlite:///{sweep_dir / 'study.db'}",
                                study_name="sweep", direction="minimize")
    study.set_user_attr("sweep", {"recipe": {}, "space": {}})
    line = refused(tmp_path, capsys, sweep_dir=str(sweep_dir))
    assert "holds a study of another sweep" in line and "give another --sweep-dir" in line


def make_sweep(tmp_path, section=None, fixed=(), recipe=None):
    path = write_recipe(tmp_path / "r.yaml", recipe, section)
    return sweep.Sweep(sweep.parse_args([path, "--sweep-dir", str(tmp_path / "s")]),
                       list(fixed))


def test_the_flags_after_the_double_dash_go_into_every_trials_recipe(tmp_path):
    assert sweep.fixed_keys(["--epochs", "5", "--amp", "bf16"]) == {"amp": "bf16", "epochs": 5}
    made = make_sweep(tmp_path, fixed=["--epochs", "5"])
    assert made.recipe == {**BASE, "epochs": 5}


def test_an_int_range_is_checked_at_its_highest_point_on_the_step(tmp_path):
    # 8, 16, 24: each divides --virtual-batch-size 48 (30, the range's end, would not)
    made = make_sweep(tmp_path, with_space(batch_size={"int": [8, 30], "step": 8}),
                      ["--virtual-batch-size", "48"])
    assert made.space == {"batch_size": ("int", [8, 30], 8)}


@pytest.mark.parametrize("rc, codes, pruned_at, signum, expected", [
    (0, [0], None, None, "complete"),
    (0, [0], 6, None, "pruned"),  # pruned at the last epoch's validation
    (sweep_trial.EXIT_PRUNED, [sweep_trial.EXIT_PRUNED], 4, None, "pruned"),
    (1, [sweep_trial.EXIT_PRUNED, sweep_trial.EXIT_PRUNED], 4, None, "pruned"),  # torchrun
    (1, [1], None, None, "failed"),  # train.py's error line (a loss not finite)
    (2, [2], None, None, "failed"),  # a value train.py refused
    (1, [1, -15], None, None, "failed"),  # torchrun ended the other process
    (1, [1, 143], None, None, "failed"),
    (-9, [-9], None, None, "stopped"),  # killed
    (143, [143], None, None, "stopped"),  # stopped by a signal, saved
    (1, [-9, -15], None, None, "stopped"),  # torchrun: a process killed
    (1, [-9, 1], None, None, "stopped"),  # the other lost its peer
    (1, [], None, None, "stopped"),  # torchrun itself failed
    (1, [1], None, signal.SIGTERM, "stopped"),  # the driver passed a signal on
])
def test_how_a_trials_process_ended(rc, codes, pruned_at, signum, expected):
    assert sweep.outcome(rc, codes, pruned_at, signum) == expected


def test_a_completed_trials_value_is_its_last_validations(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"epoch": 1, "val_loss": 0.9}\n{"epoch": 2}\n{"epoch": 3, "val_loss": 0.4}\n'
                '{"epoch": 4, "train_loss": 0.3}\n')
    assert sweep.final_value(str(tmp_path), "val_loss") == 0.4
    assert sweep.final_value(str(tmp_path / "none"), "val_loss") is None


def test_a_running_trial_no_process_holds_is_taken_up(tmp_path, capsys):
    made = make_sweep(tmp_path, {**SWEEP, "trials": 2})
    study = made.open_study()
    orphan = study.ask()  # its driver died: its lock file is free
    with contextlib.ExitStack() as stack:
        trial, fd = made.next_trial(study, stack)
        assert trial.number == orphan.number and fd is not None
        assert "taking up trial 0" in capsys.readouterr().out
        with contextlib.ExitStack() as other:  # another driver meanwhile: trial 0 is held
            trial, _ = made.next_trial(study, other)
            assert trial.number == 1
    with contextlib.ExitStack() as stack:  # both running, both free: 0 first, no third
        assert made.next_trial(study, stack)[0].number == 0
        assert made.next_trial(study, stack)[0].number == 1
        assert made.next_trial(study, stack) == (None, None)


def test_the_objective_and_its_direction_come_from_the_task():
    config = {"task": "classification"}
    assert sweep.objective_of({}, config) == ("val_acc", "maximize")  # the task's best
    assert sweep.objective_of({"objective": "loss"}, config) == ("val_loss", "minimize")
    assert sweep.objective_of({"objective": "val_acc5", "direction": "minimize"}, config) \
        == ("val_acc5", "minimize")


def test_under_torchrun_process_0_drives_with_trials_of_its_machines_processes(
        tmp_path, monkeypatch):
    driven = []
    monkeypatch.setattr(sweep.Sweep, "__init__", lambda self, args, fixed: driven.append(
        (args.nproc_per_node, fixed)))
    monkeypatch.setattr(sweep.Sweep, "run", lambda self: 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    assert sweep.main(["r.yaml", "--", "--epochs", "2"]) == 0 and driven == []  # waits
    monkeypatch.setenv("RANK", "0")
    assert sweep.main(["r.yaml", "--", "--epochs", "2"]) == 0
    assert driven == [(4, ["--epochs", "2"])]


# ------------------------------------------------------------------ the sampler

def space():
    return {"lr": ("log_uniform", [1e-4, 1.0], 1), "momentum": ("uniform", [0.0, 0.99], 1),
            "optimizer": ("choice", ["sgd", "adamw", "rmsprop"], 1),
            "batch_size": ("int", [8, 64], 8)}


def objective(params):
    return abs(params["lr"] - 0.01) + params["momentum"] + params["batch_size"] / 100


def open_study(url, name="tpe", options=None):
    return optuna.create_study(storage=url, study_name="s", load_if_exists=True,
                               sampler=sweep.per_trial_sampler(name, options or {}, 7))


def run_trial(study, trial):
    params = {name: sweep.suggest(trial, name, *spec) for name, spec in space().items()}
    study.tell(trial.number, objective(params))
    return params


@pytest.mark.parametrize("name", ["tpe", "random"])
def test_a_restarted_driver_proposes_what_the_uninterrupted_one_did(tmp_path, name):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    options = {"n_startup_trials": 3} if name == "tpe" else {}  # TPE's model from trial 3
    study = open_study(f"sqlite:///{tmp_path / 'a.db'}", name, options)
    uninterrupted = [run_trial(study, study.ask()) for _ in range(7)]
    url = f"sqlite:///{tmp_path / 'b.db'}"
    resumed = []
    for number in range(7):
        study = open_study(url, name, options)  # a new driver for every trial
        trial = study.ask()
        if number % 2:  # the driver dies after its first parameter: the next one takes
            sweep.suggest(trial, "lr", *space()["lr"])  # the trial up where it stood
            study = open_study(url, name, options)
            study.get_trials(deepcopy=False)  # (sweep.py reads them before taking one up)
            trial = optuna.trial.Trial(study, trial._trial_id)
        resumed.append(run_trial(study, trial))
    assert resumed == uninterrupted
    assert len({p["lr"] for p in uninterrupted}) == 7  # (seven draws, not one repeated)


def test_each_trials_seed_depends_on_the_sweeps_seed_and_its_number_only():
    seeds = {sweep.trial_seed(seed, number) for seed in range(3) for number in range(50)}
    assert len(seeds) == 150
    assert sweep.trial_seed(2, 7) == sweep.trial_seed(2, 7)


# ------------------------------------------------------------------ real sweeps

def sweep_command(recipe, sweep_dir, client):
    return [sys.executable, os.path.join(ROOT, "sweep.py"), recipe, "--sweep-dir", sweep_dir,
            "--nproc-per-node", "2", "--python", client]


def trial_processes(sweep_dir):
    """The pids of the processes (python clients: torchrun, train.py) of a sweep's trials."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if sweep_dir.encode() in f.read():
                    pids.append(int(entry))
    return pids


def wait_for_no_trial_process(sweep_dir, timeout=120):
    deadline = time.monotonic() + timeout
    while trial_processes(sweep_dir):
        assert time.monotonic() < deadline, "a trial's process outlived its sweep"
        time.sleep(0.1)


def run_sweep(recipe, sweep_dir, client, timeout=900):
    proc = fork_popen(sweep_command(recipe, sweep_dir, client), env=_child_env(),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def the_study(sweep_dir):
    """What a sweep's study holds, trial by trial: number, state, params, each step's value,
    the final value and the step the pruner stopped it at."""
    storage = f"sqlite:///{os.path.join(sweep_dir, 'study.db')}"
    study = optuna.load_study(study_name=os.path.basename(sweep_dir), storage=storage)
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value,
             t.system_attrs.get(sweep_trial.PRUNED_ATTR)) for t in study.get_trials()]


def last_checkpoint(sweep_dir, number):
    saved = torch.load(os.path.join(sweep_dir, f"trial-{number}", "checkpoints", "last.pt"),
                       weights_only=True)
    return {k: v for k, v in saved.items() if k not in ("config", "checksum")}  # (run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 6-trial sweep of 2-process trials, median pruning, shared by the
    tests that read it."""
    root = tmp_path_factory.mktemp("sweep")
    recipe = write_recipe(root / "recipe.yaml")
    client = python_client(root / "python")
    sweep_dir = str(root / "uninterrupted")
    rc, out = run_sweep(recipe, sweep_dir, client)
    assert rc == 0, out[-5000:]
    return {"dir": sweep_dir, "recipe": recipe, "client": client, "out": out,
            "root": root}


def ledger_steps(run_dir, rank):
    import json

    with open(os.path.join(run_dir, "samples", f"rank{rank}.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if '"step"' in line]


@pytest.mark.slow
def test_a_pruned_trial_stops_at_one_step_in_both_processes(uninterrupted):
    study = the_study(uninterrupted["dir"])
    assert [t[0] for t in study] == list(range(6))
    assert {t[1] for t in study} <= {"COMPLETE", "PRUNED"}
    pruned = [t for t in study if t[1] == "PRUNED"]
    assert pruned, uninterrupted["out"][-3000:]
    for number, _, _, values, value, step in pruned:
        run_dir = os.path.join(uninterrupted["dir"], f"trial-{number}")
        assert step == max(values) and value == values[step]  # stopped where reported
        assert last_checkpoint(uninterrupted["dir"], number)["step"] == step  # its one save
        for rank in (0, 1):  # each process's last step, from its own sample ledger
            assert max(ledger_steps(run_dir, rank)) == step
    complete = [t for t in study if t[1] == "COMPLETE"]
    for number, *_ in complete:  # the others trained their 3 epochs (2 steps each)
        assert last_checkpoint(uninterrupted["dir"], number)["step"] == 6
    # a pruned process exits 0 under torchrun, so torchrun ends no other one with SIGTERM
    assert "ChildFailedError" not in uninterrupted["out"]
    assert trial_processes(uninterrupted["dir"]) == []  # no stray process


@pytest.mark.slow
def test_a_sweep_leaves_best_yaml_plots_hparams_and_ordinary_run_directories(uninterrupted):
    sweep_dir = uninterrupted["dir"]
    study = the_study(sweep_dir)
    best = min((t for t in study if t[1] == "COMPLETE"), key=lambda t: (t[4], t[0]))
    with open(os.path.join(sweep_dir, "best.yaml")) as f:
        assert yaml.safe_load(f) == {**BASE, **best[2]}
    assert f"best: trial {best[0]}, val_loss" in uninterrupted["out"]
    for name in ("optimization_history", "param_importances", "intermediate_values"):
        assert os.path.getsize(os.path.join(sweep_dir, f"{name}.png")) > 1000
    assert sorted(os.listdir(os.path.join(sweep_dir, "hparams"))) == \
        [f"trial-{n}" for n in range(6)]
    with open(os.path.join(sweep_dir, f"trial-{best[0]}", "config.yaml")) as f:
        config = yaml.safe_load(f)  # train.py's own record of the trial
    assert (config["lr"], config["optimizer"]) == (best[2]["lr"], best[2]["optimizer"])


@pytest.mark.slow
def test_a_sweep_killed_at_random_moments_ends_as_the_uninterrupted_one(uninterrupted):
    sweep_dir = str(uninterrupted["root"] / "killed")
    rng, kills, logs = random.Random(5), [], []
    for attempt in range(5):
        logs.append(uninterrupted["root"] / f"killed-{attempt}.log")
        log = open(logs[-1], "w")  # (open until the driver ends: the fork opens it by path)
        proc = fork_popen(sweep_command(uninterrupted["recipe"], sweep_dir,
                                        uninterrupted["client"]), env=_child_env(),
                          stdout=log, stderr=subprocess.STDOUT)
        saved = checkpoints(sweep_dir)  # a moment after this driver's first new save
        while checkpoints(sweep_dir) == saved and proc.poll() is None:  # (a loaded machine
            time.sleep(0.1)                                             # takes its time)
        time.sleep(rng.uniform(0.0, 4.0))
        if proc.poll() is not None:
            log.close()
            break
        workers = [pid for pid in trial_processes(sweep_dir)
                   if not _is_torchrun(pid)]  # train.py's processes
        if workers and rng.random() < 0.5:
            kills.append("a trial's process")
            os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
        else:
            kills.append("the driver")
            proc.kill()
        proc.wait(timeout=300)
        log.close()
        wait_for_no_trial_process(sweep_dir)
    rc, out = run_sweep(uninterrupted["recipe"], sweep_dir, uninterrupted["client"])
    assert rc == 0, out[-5000:]
    said = out + "".join(path.read_text() for path in logs)
    assert "taking up trial" in said and "resuming from" in said, kills  # not from scratch
    assert the_study(sweep_dir) == the_study(uninterrupted["dir"]), kills
    for number in range(6):
        assert first_difference(last_checkpoint(uninterrupted["dir"], number),
                                last_checkpoint(sweep_dir, number)) is None, (number, kills)


@pytest.mark.slow
def test_a_failing_trial_is_failed_and_the_sweep_goes_on(tmp_path):
    """Plain train.py trials on a grid: the trial whose loss is not finite ends with
    train.py's error line, recorded as FAIL; the other completes; best.yaml is its."""
    section = {"trials": 5, "sampler": "grid", "pruner": "none", "seed": 0,
               "objective": "loss", "space": {"lr": {"choice": [0.01, 1.0e+30]}}}
    recipe = write_recipe(tmp_path / "grid.yaml", {**BASE, "epochs": 1, "max_nonfinite": 1},
                          section)
    sweep_dir = str(tmp_path / "grid")
    proc = fork_popen([sys.executable, os.path.join(ROOT, "sweep.py"), recipe, "--sweep-dir",
                       sweep_dir, "--python", python_client(tmp_path / "python")],
                      env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    study = the_study(sweep_dir)  # the grid's two points, once each
    assert sorted((t[2]["lr"], t[1]) for t in study) == [(0.01, "COMPLETE"), (1e30, "FAIL")]
    storage = f"sqlite:///{os.path.join(sweep_dir, 'study.db')}"
    failed = next(t for t in optuna.load_study(study_name="grid", storage=storage)
                  .get_trials() if t.state.name == "FAIL")
    assert failed.user_attrs["error"].startswith("error: the loss was not finite")
    with open(os.path.join(sweep_dir, "best.yaml")) as f:
        assert yaml.safe_load(f)["lr"] == 0.01
    assert "plots: param_importances skipped: it needs 2 completed trials, the study has 1" \
        in out


def checkpoints(sweep_dir):
    """Every checkpoint of a sweep's trials and when it was written."""
    found = set()
    for path in glob.glob(os.path.join(sweep_dir, "trial-*", "checkpoints", "*.pt")):
        with contextlib.suppress(OSError):
            found.add((path, os.stat(path).st_mtime_ns))
    return found


def _is_torchrun(pid):
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"torch.distributed.run" in f.read()
    return True
