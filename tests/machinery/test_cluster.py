"""Runs that live on clusters (issue 21): SLURM's warning signal saves, requeues the job
and the requeued job continues exactly."""

import os
import signal

import pytest
from helpers import assert_states_equal, final_state, stop_at_step, tiny_args

import train

ARGS = dict(network="simple_cnn", size=96, image=16, batch=16, epochs=2)


@pytest.mark.parametrize("env, job", [({"SLURM_JOB_ID": "123"}, "123"),
                                      ({"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "77",
                                        "SLURM_ARRAY_TASK_ID": "3"}, "77_3")])
def test_sigusr1_under_slurm_saves_requeues_and_the_requeued_job_continues(
        tmp_path, monkeypatch, capsys, scontrol, env, job):
    assert train.main(tiny_args(tmp_path / "whole", **ARGS)) == 0
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    with stop_at_step(3, signal.SIGUSR1):  # SLURM's --signal=USR1@90
        assert train.main(tiny_args(run, **ARGS)) == 128 + signal.SIGUSR1
    out = capsys.readouterr().out
    assert "SIGUSR1: saved" in out
    assert f"SLURM job {job}: requeued (scontrol requeue {job})" in out
    assert scontrol.read_text().splitlines() == [f"requeue {job}"]  # once
    assert train.main(tiny_args(run, "--resume", "auto", **ARGS)) == 0  # the requeued job
    assert_states_equal(final_state(run)["model"], final_state(tmp_path / "whole")["model"])


def test_sigusr1_without_slurm_saves_and_exits_like_sigterm(tmp_path, monkeypatch, capsys,
                                                            scontrol):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with stop_at_step(2, signal.SIGUSR1):
        assert train.main(tiny_args(tmp_path, **ARGS)) == 138
    assert "SIGUSR1: saved" in capsys.readouterr().out and not scontrol.exists()
    assert final_state(tmp_path)["step"] == 2


def test_without_scontrol_the_line_says_to_requeue_from_outside(tmp_path, monkeypatch,
                                                               capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol (a container)
    with stop_at_step(2, signal.SIGUSR1):
        assert train.main(tiny_args(tmp_path / "run", **ARGS)) == 138
    assert "scontrol is not on this machine's PATH (in a container?): requeue it from " \
           "outside with: scontrol requeue 55" in capsys.readouterr().out


def test_requeue_signal_picks_another_signal(tmp_path, monkeypatch, capsys, scontrol):
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    with stop_at_step(2, signal.SIGTERM):
        assert train.main(tiny_args(tmp_path / "a", "--requeue-signal", "TERM", **ARGS)) == 143
    assert scontrol.read_text().splitlines() == ["requeue 9"]
    with stop_at_step(2, signal.SIGTERM):  # by default SIGTERM does not requeue
        assert train.main(tiny_args(tmp_path / "b", **ARGS)) == 143
    assert scontrol.read_text().splitlines() == ["requeue 9"]


def test_under_torchrun_sigusr1_to_one_process_stops_all_and_requeues_once(tmp_path,
                                                                          scontrol):
    from helpers import FLAGS, assert_exit_codes, signal_a_worker_once_an_epoch_is_saved

    run = tmp_path / "run"
    os.environ["SLURM_JOB_ID"] = "4242"  # the workers inherit it (and the stand-in's PATH)
    try:
        rc, out, _ = signal_a_worker_once_an_epoch_is_saved(
            run, tiny_args(run, *FLAGS, size=256, batch=16, epochs=1000), signal.SIGUSR1)
    finally:
        del os.environ["SLURM_JOB_ID"]
    assert_exit_codes(out, 128 + signal.SIGUSR1)
    assert out.count("SIGUSR1: saved") == 1 and "SLURM job 4242: requeued" in out
    assert scontrol.read_text().splitlines() == ["requeue 4242"]


def doc_scripts():
    """The bash blocks of docs/cluster.md, in order."""
    from helpers import ROOT

    text = open(os.path.join(ROOT, "docs", "cluster.md")).read()
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2]
            if block.startswith("bash\n")]


TINY_RECIPE = ("dataset: synthetic\nnetwork: mlp\nsynthetic_size: 64\nimage_size: 8\n"
               "batch_size: 16\nepochs: 1\ndevice: cpu\nlog_every: 1\n")


def run_doc_script(script, tmp_path, env):
    import subprocess
    import sys

    from helpers import ROOT

    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "srun").write_text('#!/bin/sh\nexec "$@"\n')  # one task, here
    (shim / "scontrol").write_text('#!/bin/sh\necho localhost\n')  # show hostnames
    for tool in ("srun", "scontrol"):
        (shim / tool).chmod(0o755)
    (tmp_path / "recipe.yaml").write_text(TINY_RECIPE)
    path = f"{shim}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}" \
           f"{os.environ['PATH']}"
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, "PATH": path,
           "RECIPE": str(tmp_path / "recipe.yaml"), "RUN": str(tmp_path / "run"),
           "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_one_node_sbatch_script_trains_and_resumes(tmp_path):
    script = doc_scripts()[0]
    env = {"SLURM_JOB_ID": "31", "SLURM_CPUS_PER_TASK": "0", "SLURM_JOB_NODELIST": "n1"}
    out = run_doc_script(script, tmp_path, env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "no valid checkpoint" in out.stdout and final_state(tmp_path / "run")["epoch"] == 1
    out = run_doc_script(script, tmp_path, {**env, "EXTRA": "--epochs 2"})  # requeued
    assert out.returncode == 0 and "resuming from" in out.stdout
    assert final_state(tmp_path / "run")["epoch"] == 2


def test_the_several_nodes_sbatch_script_runs_torchrun_with_c10d(tmp_path):
    script = doc_scripts()[1]
    env = {"SLURM_JOB_ID": "32", "SLURM_NNODES": "1", "GPUS": "2",
           "SLURM_JOB_NODELIST": "n1", "EXTRA": "--data-on-device off"}
    out = run_doc_script(script, tmp_path, env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 process(es), cpu" in out.stdout and final_state(tmp_path / "run")["epoch"] == 1
