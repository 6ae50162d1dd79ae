"""MLflow tracking (--mlflow [URI]): the run read back with MLflow's own client."""

import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    closed_port,
    final_state,
    fork_popen,
    fork_run,
    only_run,
    read_metrics,
    stop_at_step,
    tiny_args,
)

import train
from reporting import tracking

mlflow = pytest.importorskip("mlflow")



@pytest.fixture(autouse=True)
def file_store(monkeypatch):
    """MLflow 3.7+ opens a file store only when allowed; the experiment is the default."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)




def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_curve(got, expected):
    """Two ``[(step, value)]`` curves: the same steps, the same values (float32 text)."""
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def epoch_history(run_dir, key):
    return [(r["step"], r[key]) for r in read_metrics(run_dir)]


def train_losses(run_dir):
    """TensorBoard's train/loss curve of the run: ``[(step, value)]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_run_recorded_and_read_back(tmp_path, capsys):
    run_dir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    long_dir = "d" * 600  # a param value over MLflow's limit (synthetic data ignores it)
    assert train.main(tiny_args(run_dir, "--mlflow", uri, "--data-dir", long_dir,
                                epochs=2)) == 0
    out = capsys.readouterr()
    client, run = only_run(uri)
    run_id = run.info.run_id
    assert f"mlflow: recording run {run_id} (experiment 'synthetic') in {uri}" in out.out
    assert "warning" not in out.err and "Traceback" not in out.err
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"

    # params: config.yaml's values as text, the long one cut and saying so
    with open(run_dir / "config.yaml") as f:
        config = yaml.safe_load(f)
    params = run.data.params
    assert set(params) == set(config)
    for key, value in config.items():
        if key != "data_dir":
            assert params[key] == str(value), key
    assert (params["batch_size"], params["network"], params["mlflow"]) == ("16", "mlp", uri)
    assert len(params["data_dir"]) == tracking.PARAM_LIMIT
    assert params["data_dir"].startswith("ddd") and params["data_dir"].endswith("(truncated)")

    # metrics: each epoch's record at its step, each log step's loss as TensorBoard has it
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2]
    for key in ("val_acc", "train_loss", "val_loss", "lr", "samples_per_sec"):
        assert_curve(history(client, run_id, key), epoch_history(run_dir, key))
    losses = train_losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, 9))  # --log-every 1, 4 steps an epoch
    assert_curve(history(client, run_id, "train/loss"), losses)
    assert [s for s, _ in history(client, run_id, "train/lr")] == list(range(1, 9))
    assert not [k for k in run.data.metrics if k.startswith(("val/", "perf/"))]

    # artifacts: the run directory's config.yaml and summary.txt, as written
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "summary.txt"}
    local = client.download_artifacts(run_id, "summary.txt", str(tmp_path))
    assert open(local).read() == (run_dir / "summary.txt").read_text()

    # the best checkpoint, and the run id in every checkpoint
    best = run_dir / "checkpoints" / "best.pt"
    assert run.data.tags["best_checkpoint"] == str(best.resolve())
    assert final_state(run_dir)["mlflow_run_id"] == run_id
    assert torch.load(best, weights_only=True)["mlflow_run_id"] == run_id


def assert_continued(client, run, run_dir, first_id, steps, epochs=(1, 2)):
    """One run, the first one, finished, its curves covering the whole training
    (``epochs``: metrics.jsonl's, a --max-steps stop's final record among them)."""
    assert run.info.run_id == first_id
    assert run.info.status == "FINISHED"
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == list(epochs)
    for key in ("val_acc", "train_loss"):
        assert_curve(history(client, first_id, key), epoch_history(run_dir, key))
    logged = history(client, first_id, "train/loss")
    assert {s for s, _ in logged} == set(range(1, steps + 1))  # none lost
    by_step = dict(train_losses(run_dir))
    for step, value in logged:  # a step logged twice (before and after the stop) agrees
        assert value == pytest.approx(by_step[step]), step
    assert final_state(run_dir)["mlflow_run_id"] == first_id


def test_max_steps_then_resume_continues_the_mlflow_run(tmp_path, capsys):
    run_dir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    assert train.main(tiny_args(run_dir, "--mlflow", uri, "--max-steps", "3",
                                epochs=2)) == 0
    client, run = only_run(uri)
    first_id = run.info.run_id
    assert final_state(run_dir)["mlflow_run_id"] == first_id
    assert [s for s, _ in history(client, first_id, "train/loss")] == [1, 2, 3]
    capsys.readouterr()
    # the config (with --mlflow) comes from the checkpoint; --max-steps 0 lifts the limit
    assert train.main(tiny_args(run_dir, "--resume", "auto", "--max-steps", "0",
                                epochs=2)) == 0
    assert f"mlflow: continuing run {first_id}" in capsys.readouterr().out
    client, run = only_run(uri)
    assert_continued(client, run, run_dir, first_id, steps=8, epochs=(0.75, 1, 2))


def test_sigterm_leaves_the_run_to_continue(tmp_path, capsys):
    run_dir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    args = tiny_args(run_dir, "--mlflow", uri, epochs=2)
    with stop_at_step(6):  # mid-epoch 2: a real SIGTERM to this process
        assert train.main(args) == 128 + signal.SIGTERM
    client, run = only_run(uri)
    first_id = run.info.run_id
    assert run.info.status == "KILLED"
    stopped = final_state(run_dir)
    assert (stopped["step"], stopped["mlflow_run_id"]) == (6, first_id)
    assert [s for s, _ in history(client, first_id, "val_acc")] == [4]
    capsys.readouterr()
    assert train.main([*args, "--resume", "auto"]) == 0
    out = capsys.readouterr()
    assert f"mlflow: continuing run {first_id}" in out.out
    assert "warning" not in out.err
    client, run = only_run(uri)
    assert_continued(client, run, run_dir, first_id, steps=8)


def test_old_checkpoint_without_a_run_id_starts_one(tmp_path):
    run_dir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    assert train.main(tiny_args(run_dir, "--max-steps", "2", epochs=2)) == 0
    assert "mlflow_run_id" not in final_state(run_dir)  # MLflow was off
    assert train.main(tiny_args(run_dir, "--resume", "auto", "--max-steps", "0",
                                "--mlflow", uri, epochs=2)) == 0
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    assert final_state(run_dir)["mlflow_run_id"] == run.info.run_id
    assert [s for s, _ in history(client, run.info.run_id, "val_acc")] == [4, 8]


def test_resume_into_another_store_starts_a_new_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first, second = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    assert train.main(tiny_args(run_dir, "--mlflow", first, "--max-steps", "2",
                                epochs=2)) == 0
    old_id = final_state(run_dir)["mlflow_run_id"]
    capsys.readouterr()
    assert train.main(tiny_args(run_dir, "--resume", "auto", "--max-steps", "0",
                                "--mlflow", second, epochs=2)) == 0
    out = capsys.readouterr().out
    assert f"mlflow: the checkpoint's run {old_id} is not in {second}" in out
    client, run = only_run(second)
    assert run.info.run_id != old_id and run.info.status == "FINISHED"
    assert final_state(run_dir)["mlflow_run_id"] == run.info.run_id
    assert only_run(first)[1].info.run_id == old_id


def test_only_process_0_records(tmp_path):
    """Two torchrun processes (gloo): one MLflow run, each step logged once."""
    run_dir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    from helpers import torchrun
    out = torchrun(tiny_args(run_dir, "--mlflow", uri, "--data-on-device", "off"))  # exit 0
    assert out.count("mlflow: recording run") == 1, out[-3000:]
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    steps = [s for s, _ in history(client, run.info.run_id, "train/loss")]
    assert steps == [1, 2]  # 64 samples, 2 processes of 16 a step
    assert_curve(history(client, run.info.run_id, "val_acc"), epoch_history(run_dir, "val_acc"))
    assert final_state(run_dir)["mlflow_run_id"] == run.info.run_id


def test_unreachable_server_is_one_warning(tmp_path):
    run_dir = tmp_path / "run"
    with closed_port() as sock:
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        proc = fork_run([sys.executable, "train.py", *tiny_args(
            run_dir, "--mlflow", uri, "--ckpt-every-steps", "2", epochs=2)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith(f"warning: MLflow ({uri}): Connection refused; training "
                                  f"goes on"), warnings
    assert "Traceback" not in proc.stderr
    assert f"done: {run_dir}" in proc.stdout
    names = os.listdir(run_dir / "checkpoints")
    assert {"last.pt", "best.pt"} <= set(names), names
    state = final_state(run_dir)
    assert (state["epoch"], state["step"]) == (2, 8)
    assert "mlflow_run_id" not in state
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]


def test_without_the_flag_mlflow_is_not_imported(tmp_path):
    code = ("import sys, train; code = train.main(sys.argv[1:]); "
            "print('mlflow imported:', 'mlflow' in sys.modules); sys.exit(code)")
    proc = fork_run([sys.executable, "-c", code, *tiny_args(tmp_path / "run")],
                    cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "mlflow imported: False" in proc.stdout
    assert final_state(tmp_path / "run")["config"]["mlflow"] is None
    assert "mlflow_run_id" not in final_state(tmp_path / "run")


def test_preflight_alone_leaves_no_run_running(tmp_path, capsys):
    """Review 6's F10: --preflight --mlflow left a run RUNNING for ever, with the run's
    params and artifacts; --preflight alone trains nothing, so it records no run."""
    store = tmp_path / "mlruns"
    assert train.main(tiny_args(tmp_path / "run", "--mlflow", store.as_uri(),
                                "--preflight")) == 0
    if store.exists():  # (a store opened: none of its runs is left RUNNING)
        client = mlflow.MlflowClient(tracking_uri=store.as_uri())
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []
    assert "mlflow: --preflight alone records no MLflow run" in capsys.readouterr().out


def test_tracking_uri_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri("local") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.tracking_uri("store") == (tmp_path / "store").as_uri()
    assert tracking.tracking_uri("db/m.db") == f"sqlite:///{tmp_path / 'db' / 'm.db'}"
    assert tracking.tracking_uri("sqlite:///m.db") == f"sqlite:///{tmp_path / 'm.db'}"
    for uri in ("http://host:5000", "file:///x/mlruns", "databricks", "sqlite:////x/m.db"):
        assert tracking.tracking_uri(uri) == uri


def test_a_failed_run_is_failed_and_an_lr_range_test_finished(tmp_path, train_main):
    failed, swept = tmp_path / "failed", tmp_path / "swept"
    uri = (tmp_path / "mlruns").as_uri()
    assert train_main(tiny_args(failed, "--mlflow", uri, "--lr", "1e30",
                                "--max-nonfinite", "1")) == 1  # the loss is not finite
    client, run = only_run(uri)
    assert run.info.status == "FAILED"
    client.delete_experiment(run.info.experiment_id)

    uri = (tmp_path / "mlruns2").as_uri()
    assert train_main(tiny_args(swept, "--mlflow", uri, "--find-lr", "--find-lr-steps",
                                "8")) == 0
    assert only_run(uri)[1].info.status == "FINISHED"


OPEN_AND_RECORD = """
import sys
sys.path.insert(0, {root!r})
from reporting import tracking
tracker = tracking.Tracker({uri!r}, sys.argv[1])
tracker.start({{"dataset": "synthetic", "seed": int(sys.argv[2])}})
print("run", tracker.run_id)
"""


def test_two_runs_started_at_once_on_a_new_store_are_both_recorded(tmp_path):
    """Round 5's F5: two processes opening a new mlflow.db at the same moment both
    create a run (one of them used to record nothing, 3 times in 3)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "open.py"
    script.write_text(OPEN_AND_RECORD.format(root=ROOT, uri=uri))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    procs = [fork_popen([sys.executable, str(script), str(tmp_path / f"run{i}"),
                         str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0 and "warning" not in err.lower(), err
        assert out.splitlines()[-1].startswith("run "), (out, err)
    runs = mlflow.tracking.MlflowClient(tracking_uri=uri).search_runs(
        [e.experiment_id for e in mlflow.tracking.MlflowClient(
            tracking_uri=uri).search_experiments()])
    assert sorted(r.info.run_name for r in runs) == ["run0", "run1"]
    assert sorted(os.listdir(tmp_path)) == ["mlflow.db", "open.py"]  # no lock file left


def test_a_store_that_cannot_be_written_gives_up_at_once_in_one_line(mount_tmpfs, tmp_path):
    """Round 5's F6: --mlflow in a read-only working directory: one warning, in seconds
    (MLflow's engine retried for about 50 s, with 9 repeats of a 4-line warning)."""
    read_only = mount_tmpfs("ro,size=64k")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    code = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from reporting import "
            f"tracking; t0 = time.monotonic(); t = tracking.Tracker(sys.argv[1], "
            f"sys.argv[2]); t.start({{'dataset': 'synthetic'}}); "
            f"print('took', time.monotonic() - t0, t.client)")
    proc = fork_run([sys.executable, "-c", code, f"sqlite:///{read_only}/mlflow.db",
                     str(tmp_path / "run")], cwd=read_only, capture_output=True,
                    text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: MLflow (sqlite:///{read_only}/mlflow.db): cannot create"), proc.stderr
    took = float(proc.stdout.split()[1])
    assert took < 5 and proc.stdout.split()[2] == "None", proc.stdout
