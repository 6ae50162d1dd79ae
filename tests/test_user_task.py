"""A task from outside the project: README's "Add a task" (a regression, one number per
image) in a file of the user's, chosen with ``--task FILE.py:Class``. It trains through
train.py with every promise a built-in task keeps (SIGTERM then ``--resume auto`` bit-exact,
torchrun 2 x 8 == 1 x 16, best.pt on its best figure) and test.py reports it."""

import json
import os
import re
import shlex
import signal
import sys

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    final_state,
    fork_run,
    load_test_py,
    main_in_process,
    read_metrics,
    run_as_written,
    stop_at_step,
    tiny_args,
    torchrun,
)

import tasks
import train


def readme_section():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("## Add a task", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def task_file(tmp_path):
    """README's task, saved as the user would: ``my_tasks.py``; its --task value."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)
    assert len(code) == 1
    (tmp_path / "my_tasks.py").write_text(code[0])
    return f"{tmp_path / 'my_tasks.py'}:Regression"


def test_the_readme_section_runs_as_written(tmp_path, task_file, monkeypatch, capsys):
    commands = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)[0].splitlines()
    assert [shlex.split(c)[1] for c in commands] == ["train.py", "train.py", "test.py"]
    monkeypatch.setattr(tasks, "_loaded", {})  # "my_tasks.py:Regression": this test's file
    outputs = []
    for command in commands:
        code, out, err = run_as_written(shlex.split(command), tmp_path, monkeypatch, capsys)
        assert code == 0, out[-2000:] + err[-2000:]
        outputs.append(out)
    run = tmp_path / "runs" / "regression"
    records = [r for r in read_metrics(run) if "val_loss" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3] and all("val_r2" in r for r in records)
    config = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert config["task"] == "my_tasks.py:Regression"  # as given: found again from the cwd
    assert (config["optimizer"], config["lr"]) == ("adam", 1e-3)  # the task's defaults
    best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    lowest = min(records, key=lambda r: r["val_loss"])
    assert best["epoch"] == lowest["epoch"]
    report = outputs[2]
    assert f"loss {lowest['val_loss']:.4f}  r2 {lowest['val_r2']:.4f}" in report


def test_best_pt_is_the_lowest_loss_when_it_is_not_the_last(tmp_path, task_file,
                                                             monkeypatch):
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "warm")]) == 0
    import user_task_my_tasks  # as the run above loaded it; patched for the one below
    losses = iter([3.0, 1.0, 2.0])
    compute = user_task_my_tasks.RegressionEvaluation.compute
    monkeypatch.setattr(user_task_my_tasks.RegressionEvaluation, "compute",
                        lambda self: {**compute(self), "loss": next(losses)})
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "run", epochs=3),
                       "--optimizer", "adam", "--lr", "1e-3"]) == 0
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2


R2_BELOW_MINUS_1 = '''

class R2Regression(Regression):
    best = "r2"
    lower_is_better = False

    def evaluation(self, device, model=None):
        return ShiftedR2(device)


class ShiftedR2(RegressionEvaluation):
    def compute(self):
        figures = super().compute()
        return {**figures, "r2": min(figures["r2"], 0.0) - 10.0}  # below -1, whatever r2
'''


def test_best_pt_and_early_stop_follow_a_higher_is_better_figure_below_minus_1(tmp_path):
    # The first validation's figure is the best whatever its sign (not an accuracy's -1).
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "r2_tasks.py").write_text(code + R2_BELOW_MINUS_1)
    assert train.main(["--task", f"{tmp_path / 'r2_tasks.py'}:R2Regression",
                       *tiny_args(tmp_path / "run"), "--optimizer", "adam", "--lr", "1e-3",
                       "--early-stop-patience", "1"]) == 0
    [record] = [r for r in read_metrics(tmp_path / "run") if "val_r2" in r]
    assert record["val_r2"] < -1
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 1 and best["progress"]["best"] == record["val_r2"]
    assert (best["progress"]["early_stop_best"], best["progress"]["early_stop_waited"]) == \
        (record["val_r2"], 0)


PLAIN = '''

LOSSES = iter([3.0, 1.0, 2.0])  # the three validations' losses


class PlainEvaluation(RegressionEvaluation):
    def compute(self):
        return {**super().compute(), "loss": next(LOSSES)}


class Plain(Regression):
    lower_is_better = None  # the base's: not said

    def evaluation(self, device, model=None):
        return PlainEvaluation(device)
'''


def test_a_task_that_names_no_direction_follows_the_lowest_loss_and_says_so(tmp_path,
                                                                           capsys):
    """Design review 7: a task that leaves ``lower_is_better`` unset (the base's None) is
    not given best.pt at its highest validation loss: the direction comes from the figure's
    name (a loss: the lowest), said once at load."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "plain.py").write_text(code + PLAIN)
    assert train.main(["--task", f"{tmp_path / 'plain.py'}:Plain",
                       *tiny_args(tmp_path / "run", epochs=3), "--optimizer", "adam",
                       "--lr", "1e-3"]) == 0
    assert capsys.readouterr().out.count("best.pt follows the lowest 'loss' (from its name)") \
        == 1
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2  # the loss of 1.0, not the first's 3.0


NO_BEST_OR_A_WORD = '''

class NoBest(Regression):
    def evaluation(self, device, model=None):
        return NoBestEvaluation(device)


class NoBestEvaluation(RegressionEvaluation):
    def compute(self):
        return {k: v for k, v in super().compute().items() if k != "loss"}


class AWord(Regression):
    def evaluation(self, device, model=None):
        return AWordEvaluation(device)


class AWordEvaluation(RegressionEvaluation):
    def compute(self):
        return {**super().compute(), "loss": "low"}


class ABool(Regression):
    def evaluation(self, device, model=None):
        return ABoolEvaluation(device)


class ABoolEvaluation(RegressionEvaluation):
    def compute(self):
        return {**super().compute(), "loss": True}
'''


@pytest.mark.parametrize("name, expected", [
    ("NoBest", "the task's figures lack 'loss' (its best figure; it returned r2, count)"),
    ("AWord", "the task's figure 'loss' is 'low' (a str), not a number: "),
    ("ABool", "the task's figure 'loss' is True (a bool), not a number: "),  # (bool: an int)
])
def test_figures_lacking_the_best_or_not_numbers_are_one_line_in_preflight_and_run(
        tmp_path, capsys, name, expected):
    # Review 6's F3: --preflight's evaluation stage says so (exit 2), not "stages ok";
    # the run, at its first validation, in one line too, the epoch's training saved.
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "figures.py").write_text(code + NO_BEST_OR_A_WORD)
    run = tmp_path / "run"
    for extra, said in ((["--preflight"], "error: preflight: the evaluation: "),
                        ([], "error: ")):
        assert train.main(["--task", f"{tmp_path / 'figures.py'}:{name}",
                           *tiny_args(run), *extra]) == 2, extra
        out = capsys.readouterr()
        lines = [line for line in (out.out + out.err).splitlines() if "error" in line]
        assert len(lines) == 1 and lines[0].startswith(said + expected), lines
        assert "stages ok" not in out.out and "Traceback" not in out.err
    assert (run / "checkpoints" / "last.pt").exists()  # saved before its validation


MISTAKES = '''

class LossVector(Regression):
    def loss(self, model, x, y):
        return F.mse_loss(model(x).squeeze(1).float(), y.float(), reduction="none")


class LossInt(Regression):
    def loss(self, model, x, y):
        return 1


class LossNone(Regression):
    def loss(self, model, x, y):
        return None


class LossDict(Regression):
    def loss(self, model, x, y):
        return {"loss": super().loss(model, x, y)}


class LossNoGrad(Regression):
    def loss(self, model, x, y):
        with torch.no_grad():
            return super().loss(model, x, y)


class PrepareNone(Regression):
    def prepare(self, x, y, where):
        return None


class PrepareOne(Regression):
    def prepare(self, x, y, where):
        return x


class EvalDict(Regression):
    def evaluation(self, device, model=None):
        return {"loss": 0.0}


class LossDetached(Regression):
    def loss(self, model, x, y):
        return torch.tensor(1.0, requires_grad=True)


class PrepareHalf(Regression):
    def prepare(self, x, y, where):
        return x[:len(x) // 2], y[:len(y) // 2]


class EvalRaises(Regression):
    def evaluation(self, device, model=None):
        return self.broken()

    def broken(self):
        raise RuntimeError("my evaluation is broken. Details follow")
'''


@pytest.mark.parametrize("name, said", [
    ("LossVector", "error: the task's loss returned a torch.float32 tensor of shape (16,), "
                   "not the micro-batch's mean loss"),
    ("LossInt", "error: the task's loss returned an int, not the micro-batch's mean loss"),
    ("LossNone", "error: the task's loss returned None, not"),
    ("LossDict", "error: the task's loss returned a dict, not"),
    ("LossNoGrad", "error: the task's loss returned a tensor without a gradient"),
    ("PrepareNone", "error: the task's prepare returned None, not (inputs, targets)"),
    ("PrepareOne", "error: the task's prepare returned a torch.float32 tensor of shape "
                   "(16, 3, 8, 8), not (inputs, targets)"),
    ("EvalDict", "error: the task's evaluation returned a dict, not a tasks.Evaluation"),
    ("LossDetached", "warning: the task's loss is a tensor of its own"),
    ("PrepareHalf", "warning: the task's prepare returned 8 samples of the batch's 16"),
])
def test_a_user_tasks_loss_prepare_or_evaluation_of_the_wrong_kind_is_one_line(
        tmp_path, capsys, name, said):
    """Round 7's F4 and F11: a loss that is no 0-d tensor with a gradient, a prepare that
    returns no pair, an evaluation that is a dict: one error line, exit 2 (in --preflight
    too), not a traceback; a loss no parameter computed, or a prepare that drops samples,
    trains: one warning, once."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "mistakes.py").write_text(code + MISTAKES)
    error = said.startswith("error: ")
    for extra in (["--preflight"], []) if error else ([],):
        run = tmp_path / f"run{len(extra)}"
        code = train.main(["--task", f"{tmp_path / 'mistakes.py'}:{name}",
                           *tiny_args(run), "--synthetic-size", "32", *extra])
        out = capsys.readouterr()
        assert code == (2 if error else 0), (extra, out.err[-2000:])
        assert "Traceback" not in out.err + out.out
        kind, words = said.split(": ", 1)  # (--preflight: "error: preflight: the ...: ")
        lines = [line for line in out.err.splitlines() if line.startswith(kind + ": ")]
        assert len(lines) == 1 and words in lines[0], (extra, lines)


def test_an_exception_in_the_users_task_code_is_its_traceback_then_one_line(tmp_path,
                                                                            capsys):
    """Round 7's F11: an evaluation that raises (a bug in the user's own code) shows the
    user its traceback, then ends in one line naming the file and line (the innermost of
    the user's frames), exit 1, the epoch's training saved in last.pt (test.py's
    evaluation alike); an exception of the project's own code is not taken for the
    user's (its traceback alone: a bug report)."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "mistakes.py").write_text(code + MISTAKES)
    run = tmp_path / "run"
    assert train.main(["--task", f"{tmp_path / 'mistakes.py'}:EvalRaises", *tiny_args(run),
                       "--synthetic-size", "32"]) == 1
    err = capsys.readouterr().err.rstrip().splitlines()
    line = next(n for n, text in enumerate(MISTAKES.splitlines()) if "evaluation is broken"
                in text) + 1 + len(code.splitlines())
    assert err[-2] == "RuntimeError: my evaluation is broken. Details follow"
    assert err[-1] == (f"error: the task's own code raised RuntimeError at "
                       f"{tmp_path / 'mistakes.py'}:{line} in broken (the traceback "
                       f"above): my evaluation is broken; the checkpoints written are "
                       f"intact: fix it, then --resume auto continues")
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    code, _, err = main_in_process(load_test_py().main, [  # test.py too: the same line
        "--checkpoint", str(run / "checkpoints" / "last.pt"), "--task",
        f"{tmp_path / 'mistakes.py'}:EvalRaises"], capsys)
    assert code == 1 and "Traceback" in err
    assert err.rstrip().splitlines()[-1] == (
        f"error: the task's own code raised RuntimeError at {tmp_path / 'mistakes.py'}:"
        f"{line} in broken (the traceback above): my evaluation is broken")
    with pytest.raises(tasks.UserError) as raised:  # raised in the project's own code,
        tasks.task_class("no_such_task")            # the user's file loaded
    assert tasks.user_code_failed(raised.value) is None
    assert capsys.readouterr().err == ""  # (no traceback printed for it)


OLDER_PREPARE = '''

import os


class OlderPrepare(Regression):
    """A task written before the Where: prepare(x, y, epoch, batch) records its batches."""

    def prepare(self, x, y, epoch, batch):
        with open(os.environ["BATCHES_SEEN"], "a") as f:
            f.write(f"{epoch} {batch}\\n")
        return x, y
'''


def test_a_task_of_before_the_where_trains_and_resumes_with_its_batches_counted(
        tmp_path, monkeypatch):
    """Review 7's survivors S7-13 and S7-12: ``prepare(self, x, y, epoch, batch)`` (the
    seam's older form) is accepted at load, and after a mid-epoch SIGTERM and --resume
    auto its ``batch`` goes on from where the epoch was (MixUp's draws depend on it), not
    from 0 again."""
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "older.py").write_text(code + OLDER_PREPARE)
    seen = tmp_path / "batches.txt"
    monkeypatch.setenv("BATCHES_SEEN", str(seen))
    argv = ["--task", f"{tmp_path / 'older.py'}:OlderPrepare", *tiny_args(tmp_path / "run")]
    with stop_at_step(2):
        assert train.main(argv) == 128 + signal.SIGTERM
    assert train.main([*argv, "--resume", "auto"]) == 0
    assert seen.read_text().split("\n")[:-1] == ["0 0", "0 1", "0 2", "0 3"]


RESUMED = ("model", "optimizer", "scaler", "rng", "progress")


def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path,
                                                                         task_file):
    args = ("--task", task_file, "--network", "simple_cnn")
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main([*tiny_args(full, epochs=2), *args]) == 0
    with stop_at_step(3):  # of 8: inside the first epoch
        assert train.main([*tiny_args(stopped, epochs=2), *args]) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 3
    assert train.main([*tiny_args(stopped, epochs=2), *args, "--resume", "auto"]) == 0
    a, b = final_state(full), final_state(stopped)
    assert_states_equal({k: a[k] for k in RESUMED}, {k: b[k] for k in RESUMED})
    timings = ("compute_efficiency", "data_time", "compute_time", "epoch_time",
               "samples_per_sec", "tflops")
    last_full, last_stopped = read_metrics(full)[-1], read_metrics(stopped)[-1]
    assert {k: v for k, v in last_full.items() if k not in timings} == \
        {k: v for k, v in last_stopped.items() if k not in timings}


def test_two_processes_of_8_equal_one_of_16(tmp_path, task_file):
    args = ("--task", task_file, "--optimizer", "sgd", "--momentum", "0", "--lr", "0.01")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train.main([*tiny_args(one, batch=16, epochs=2), *args]) == 0
    torchrun([*tiny_args(two, batch=8, epochs=2), *args])
    torch.testing.assert_close(final_state(two)["model"], final_state(one)["model"])
    a, b = read_metrics(one)[-1], read_metrics(two)[-1]
    assert a["step"] == b["step"] == 8
    for key in ("val_loss", "val_r2", "train_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.parametrize("name, expected", [
    ("missing.py:Regression", "no file 'missing.py'"),
    ("{tasks}:Nope", "has no class 'Nope' (its tasks: Regression)"),
    ("{tasks}:RegressionEvaluation", "no tasks.Task subclass 'RegressionEvaluation'"),
    ("regression", "invalid choice: 'regression'"),
])
def test_a_task_that_cannot_be_found_is_one_error_line(tmp_path, task_file, name, expected,
                                                      monkeypatch, capsys):
    name = name.format(tasks=task_file.rsplit(":", 1)[0])
    monkeypatch.chdir(tmp_path)
    code, _, err = main_in_process(train.main, ["--task", name, *tiny_args(tmp_path / "run")],
                                   capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], err
    assert not (tmp_path / "run").exists()


def test_test_py_json_holds_the_tasks_figures(tmp_path, task_file, capsys, monkeypatch):
    assert train.main(["--task", task_file, *tiny_args(tmp_path / "run")]) == 0
    out = tmp_path / "r.json"
    code, _, err = main_in_process(load_test_py().main, [
        "--checkpoint", str(tmp_path / "run" / "checkpoints" / "last.pt"), "--json", str(out),
        "--task", task_file], capsys)
    assert code == 0, err
    report, record = json.loads(out.read_text()), read_metrics(tmp_path / "run")[-1]
    assert report["loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    assert report["r2"] == pytest.approx(record["val_r2"], rel=1e-6, abs=1e-9)
    assert report["count"] == 12  # the synthetic set's validation fifth of 64
    moved = tmp_path / "elsewhere.py"  # (the file moved, or test.py run from elsewhere)
    moved.write_text(open(task_file.split(":")[0]).read())
    monkeypatch.setattr(tasks, "_named", set())  # (a new process: only --task's file named)
    monkeypatch.setattr(tasks, "_loaded", {})
    code, _, err = main_in_process(load_test_py().main, [  # S7-24: --task replaces the
        "--checkpoint", str(tmp_path / "run" / "checkpoints" / "last.pt"), "--task",  # run's
        f"{moved}:Regression", "--json", str(out)], capsys)  # recorded task file
    assert code == 0 and json.loads(out.read_text())["loss"] == report["loss"], err
    # Round 7's F10: its export, evaluated with --task naming the class in another file
    # (test.py run from elsewhere): that task, said in a note, never the recorded file.
    exported = tmp_path / "m.pt2"
    code, _, err = main_in_process(load_test_py().main, [
        "--checkpoint", str(tmp_path / "run" / "checkpoints" / "last.pt"), "--export",
        str(exported), "--task", task_file], capsys)
    assert code == 0, err
    monkeypatch.setattr(tasks, "_named", set())
    monkeypatch.setattr(tasks, "_loaded", {})
    code, out, err = main_in_process(load_test_py().main, [
        "--model", str(exported), "--task", f"{moved}:Regression", "--json", str(out_m := (
            tmp_path / "m.json"))], capsys)
    assert code == 0, err
    assert f"was exported by a run of --task {task_file}; it is evaluated with --task " \
           f"{moved}:Regression" in out
    assert json.loads(out_m.read_text())["loss"] == pytest.approx(report["loss"], rel=1e-5)


DENOISER = '''
import torch
import torch.nn.functional as F

import networks
import tasks


@networks.register("tiny_denoiser")  # this file's own network, trained by name
def tiny_denoiser(num_classes, in_channels, image_size):
    return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 8, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, in_channels, 3, padding=1))


class Denoise(tasks.Task):
    """Noise of its own per sample, drawn from the step's ``where``: split-proof."""

    lower_is_better = True
    default_network = "tiny_denoiser"
    own_networks = ("tiny_denoiser",)
    own_networks_are = "this file's denoiser"

    @classmethod
    def build(cls, config, train_set, val_set=None):
        return cls()

    def noise(self, x, where):
        g = where.generator(x.device)
        return torch.randn(where.step_samples, *x.shape[1:], generator=g,
                           device=x.device)[where.mine]

    def loss(self, model, x, y, where):
        return F.mse_loss(model(x + self.noise(x, where)), x)

    @staticmethod
    def predict(model, x, tta=False):
        g = torch.Generator().manual_seed(len(x))
        return model(x + torch.randn(x.shape, generator=g)) - x

    def evaluation(self, device, model=None):
        return SquaredError(device)


class PerMicroBatch(Denoise):
    """The same noise drawn per micro-batch: what an accumulated step cannot repeat."""

    def noise(self, x, where):
        g = torch.Generator().manual_seed(where.batch)
        return torch.randn(x.shape, generator=g)


class SquaredError(tasks.Evaluation):
    def __init__(self, device):
        super().__init__()
        self.add_state("totals", torch.zeros(2, dtype=torch.float64), "sum")
        self.to(device)

    def update(self, error, y, x=None):
        self.totals += torch.stack([error.double().pow(2).sum(),
                                    torch.tensor(float(error.numel()), dtype=torch.float64)])

    def compute(self):
        sse, n = self.totals.tolist()
        return {"loss": sse / n, "count": int(n)}
'''


@pytest.mark.slow
def test_a_task_drawing_from_where_trains_8_plus_8_and_2x8_as_one_batch_of_16(tmp_path,
                                                                               capsys):
    # The "done when": noise per sample from ``where`` survives accumulation and
    # torchrun (1e-5); the same noise drawn per micro-batch does not (the test can fail).
    # The task's own network trains by name (its default), resumes and is named.
    (tmp_path / "denoise.py").write_text(DENOISER)
    task = f"{tmp_path / 'denoise.py'}:Denoise"

    def run(name, batch, *extra, kind=task, epochs=2):
        return [*tiny_args(tmp_path / name, batch=batch, epochs=epochs,
                           network="tiny_denoiser"), "--task", kind, "--momentum", "0",
                *extra]

    one = run("one", 16)
    at = one.index("--network")
    assert train.main(one[:at] + one[at + 2:]) == 0  # the task's default network
    assert "training tiny_denoiser on synthetic" in capsys.readouterr().out
    assert train.main(run("accumulated", 8, "--virtual-batch-size", "16")) == 0
    torchrun(run("two", 8))
    whole = final_state(tmp_path / "one")["model"]
    for parts in ("accumulated", "two"):
        got = final_state(tmp_path / parts)["model"]
        for name in whole:
            torch.testing.assert_close(got[name], whole[name], rtol=0, atol=1e-5)
    per_micro_batch = f"{tmp_path / 'denoise.py'}:PerMicroBatch"
    assert train.main(run("pm-one", 16, kind=per_micro_batch)) == 0
    assert train.main(run("pm-accumulated", 8, "--virtual-batch-size", "16",
                          kind=per_micro_batch)) == 0
    a, b = final_state(tmp_path / "pm-one")["model"], final_state(tmp_path / "pm-accumulated")[
        "model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-4
    assert train.main(run("one", 16, "--resume", "auto", epochs=3)) == 0
    assert final_state(tmp_path / "one")["epoch"] == 3
    done = fork_run([sys.executable, os.path.join(ROOT, "test.py"), "--checkpoint",
                     str(tmp_path / "one" / "checkpoints" / "last.pt"), "--task",
                     task], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tiny_denoiser on synthetic" in done.stdout


@pytest.mark.parametrize("extra, expected", [
    ("class Bad(Regression):\n    evaluation = None\n",
     "Bad has no evaluation: a task writes evaluation(self, device, model=None)"),
    ("class Bad(tasks.Task):\n    @classmethod\n    def build(cls, config, train_set, "
     "val_set=None):\n        return cls()\n\n    def evaluation(self, device, model=None):"
     "\n        return RegressionEvaluation(device)\n",
     "Bad has no loss: a task writes loss(self, model, x, y, where)"),
    ("class Bad(Regression):\n    def loss(self, model, x):\n        return x.sum()\n",
     "Bad.loss(self, model, x) cannot be called as the loop calls it: write "
     "loss(self, model, x, y, where)"),
    ("class Bad(Regression):\n    def prepare(self, x):\n        return x\n",
     "Bad.prepare(self, x) cannot be called as the loop calls it"),
    ("class Bad(tasks.Task):\n    def loss(self, model, x, y):\n        return x.sum()\n\n"
     "    def evaluation(self, device, model=None):\n        return None\n",
     "Bad has no build: a task writes build(cls, config, train_set, val_set=None)"),
    ("class Bad(Regression):\n    @classmethod\n    def build(cls, config, train_set, "
     "val_set=None):\n        pass\n", "Bad.build returned NoneType, not the task"),
])
def test_a_task_missing_a_part_or_with_a_wrong_signature_is_one_line_at_load(tmp_path, extra,
                                                                             expected,
                                                                             monkeypatch,
                                                                             capsys):
    code = re.findall(r"```python\n(.*?)```", readme_section(), re.S)[0]
    (tmp_path / "bad.py").write_text(code + "\n\n" + extra)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tasks, "_loaded", {})  # "bad.py:Bad" is another file in each case
    code, _, err = main_in_process(train.main, ["--task", "bad.py:Bad",
                                                *tiny_args(tmp_path / "run")], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --task bad.py:Bad: ") and \
        expected in lines[0], err
    assert not (tmp_path / "run").exists()


PAYLOAD = "open('RAN', 'w').close()  # what any file of code could do when imported\n"


@pytest.mark.slow
def test_a_checkpoint_naming_a_task_file_never_imports_it(tmp_path, task_file, monkeypatch,
                                                          capsys):
    # Issue 51's F1: test.py and --resume of a checkpoint whose config names a task file
    # say which flag to add, in one line (exit 2), and the file has not run.
    from machinery import checkpoint

    assert train.main(["--task", task_file, *tiny_args(tmp_path / "run")]) == 0
    (tmp_path / "payload.py").write_text(PAYLOAD)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    state.pop("checksum")
    state["config"]["task"] = "payload.py:Classifier"
    checkpoint.save_checkpoint(state, str(tmp_path / "received.pt"))  # a valid checksum
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for main, *args in ((load_test_py().main, "--checkpoint", "received.pt"),
                        (train.main, "--resume", "received.pt", "--run-dir", "resumed")):
        code, _, err = main_in_process(main, [*args, "--device", "cpu"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (args, err)
        assert lines[0].startswith("error:") and \
            lines[0].endswith("add --task payload.py:Classifier"), lines
        assert not (tmp_path / "RAN").exists(), args
