"""--profile-steps N (profiling.py): a torch.profiler trace of N optimizer steps under
<run-dir>/profile/, the top operators and a data-/compute-bound line; the profiler
never changes the weights and is closed however the run ends."""

import glob
import json
import os
import re
import signal

import pytest
import torch
from helpers import assert_states_equal, final_state, stop_at_step, tiny_args

import train
from reporting import profiling

BOUND = re.compile(r"^profile: (data|compute)-bound: waited for data \d+\.\d% of the time "
                   r"\(data \d+\.\d+ s, compute \d+\.\d+ s over (\d+) steps?", re.M)


def traces(run_dir):
    return glob.glob(os.path.join(run_dir, "profile", "*.pt.trace.json"))


def read_trace(run_dir):
    """The run's one trace, parsed: (its path, its events)."""
    found = traces(run_dir)
    assert len(found) == 1, found
    with open(found[0]) as f:
        trace = json.load(f)
    return found[0], trace["traceEvents"]


def step_spans(events):
    """The ProfilerStep#k spans of a trace, by name."""
    return sorted(e["name"] for e in events
                  if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#"))


def check_closed():
    assert not torch.autograd._profiler_enabled()  # nothing left recording


def test_profile_steps_writes_one_trace_and_reports(tmp_path, capfd):
    assert train.main(tiny_args(tmp_path, "--profile-steps", "2")) == 0  # 4 steps: 1+1+2
    out, err = capfd.readouterr()
    check_closed()
    path, events = read_trace(tmp_path)
    assert os.path.basename(path).startswith("rank0.")
    names = {e.get("name") for e in events}
    assert names & {"aten::addmm", "aten::mm"}, sorted(n for n in names if n)[:40]
    assert step_spans(events) == ["ProfilerStep#2", "ProfilerStep#3"]  # steps 3 and 4
    assert "profile: top operators by self CPU time" in out
    rows = re.findall(r"^ +\d+\.\d% +\d+\.\d{3} ms  (\S+) \(\d+ calls?\)$", out, re.M)
    assert 1 <= len(rows) <= profiling.TOP_OPERATORS and "aten::addmm" in rows, out
    assert not any(r.startswith("ProfilerStep") for r in rows)
    assert f"profile: steps 3-4 in {path}" in out
    bound = BOUND.findall(out)
    assert len(bound) == 1 and bound[0][1] == "2", out  # one window, its 2 steps
    assert "gpuGetDeviceCount" not in err and "Traceback" not in err


def test_profiling_spans_epochs_and_leaves_the_weights_alone(tmp_path, capsys, trained_run):
    # 4 steps an epoch: steps 3-6 are recorded, across the end of the first epoch
    assert train.main(tiny_args(tmp_path, "--profile-steps", "4", epochs=2)) == 0
    out = capsys.readouterr().out
    _, events = read_trace(tmp_path)
    assert step_spans(events) == [f"ProfilerStep#{k}" for k in range(2, 6)]
    bound = BOUND.findall(out)  # the timer restarted at the epoch: the last 2 steps
    assert len(bound) == 1 and bound[0][1] == "2", out
    assert "the last of the 4 recorded" in out
    plain = trained_run(epochs=2)
    assert not os.path.exists(os.path.join(plain, "profile"))  # flag 0: no profiler at all
    profiled, reference = final_state(tmp_path), final_state(plain)
    for key in ("model", "optimizer", "rng"):
        assert_states_equal(profiled[key], reference[key])


def test_more_steps_than_the_run_has_and_max_steps_in_the_window(tmp_path, capsys):
    # --max-steps 3 ends the run inside what 10 profiled steps would have been
    assert train.main(tiny_args(tmp_path, "--profile-steps", "10", "--max-steps", "3",
                                epochs=2)) == 0
    out = capsys.readouterr().out
    check_closed()
    assert "the run has 3 optimizer step(s) left; profiling 1 of them" in out
    _, events = read_trace(tmp_path)
    assert step_spans(events) == ["ProfilerStep#2"]
    assert [b[1] for b in BOUND.findall(out)] == ["1"]
    assert "--max-steps 3 reached at step 3" in out


def test_a_signal_inside_the_window_writes_what_was_recorded(tmp_path, capsys):
    with stop_at_step(3, signal.SIGTERM):  # the first recorded step of 1+1+4
        code = train.main(tiny_args(tmp_path, "--profile-steps", "4", epochs=2))
    out = capsys.readouterr().out
    assert code == 128 + signal.SIGTERM
    check_closed()
    assert "profile: the run ended after 1 of the 4 steps to profile" in out
    _, events = read_trace(tmp_path)
    assert "ProfilerStep#2" in step_spans(events)
    assert [b[1] for b in BOUND.findall(out)] == ["1"]
    assert "SIGTERM: saved" in out


def test_a_failing_run_closes_the_profiler_and_writes_no_trace(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path, "--profile-steps", "10", "--lr", "1e30",
                                "--max-nonfinite", "2", epochs=5))
    captured = capsys.readouterr()
    assert code == 1 and "not finite for" in captured.err
    check_closed()
    assert traces(tmp_path) == [] and "profile: top operators" not in captured.out
    assert train.main(tiny_args(tmp_path / "after", "--profile-steps", "1")) == 0  # again
    assert len(traces(tmp_path / "after")) == 1


@pytest.mark.parametrize("asked, remaining, expected", [
    (2, 100, (1, 1, 2)), (10, 4, (1, 1, 2)), (5, 3, (1, 1, 1)), (5, 2, (0, 1, 1)),
    (5, 1, (0, 0, 1)), (3, 0, (0, 0, 0)),
])
def test_plan_keeps_one_recorded_step_first(asked, remaining, expected):
    assert profiling.plan(asked, remaining) == expected


def test_bound_line_names_the_bottleneck():
    data_bound = profiling.bound_line(0.5, 1.5, 3)
    assert data_bound.startswith("profile: data-bound: waited for data 25.0% of the time")
    assert "--num-workers" in data_bound and "--data-on-device" in data_bound
    on_device = profiling.bound_line(0.5, 1.5, 3, on_device=True)  # workers do not apply
    assert on_device.startswith("profile: data-bound:") and "--num-workers" not in on_device
    compute = profiling.bound_line(0.05, 1.95, 1)
    assert compute == ("profile: compute-bound: waited for data 2.5% of the time (data "
                       "0.050 s, compute 1.950 s over 1 step)")


def test_one_trace_per_process_under_ddp(tmp_path):
    from helpers import torchrun
    out = torchrun(tiny_args(tmp_path, "--profile-steps", "1", "--data-on-device", "off",
                             size=128))  # 4 steps of 2 x 16 (asserts exit 0)
    found = sorted(os.path.basename(p).split(".")[0] for p in traces(tmp_path))
    assert found == ["rank0", "rank1"], out
    for path in traces(tmp_path):
        with open(path) as f:
            assert step_spans(json.load(f)["traceEvents"]) == ["ProfilerStep#2"]
    assert out.count("profile: top operators") == 1 and len(BOUND.findall(out)) == 1, out
    assert "(and one per other process)" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_trace_has_kernels_and_memory(tmp_path, capsys):
    args = tiny_args(tmp_path, "--profile-steps", "2", network="simple_cnn", image=16)
    args[args.index("--device") + 1] = "cuda"
    assert train.main(args) == 0
    out = capsys.readouterr().out
    _, events = read_trace(tmp_path)
    assert any(e.get("cat") == "kernel" for e in events)        # CUDA activity
    assert any(e.get("name") == "[memory]" for e in events)     # profile_memory
    assert step_spans(events) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert "profile: top operators by self CUDA time" in out and len(BOUND.findall(out)) == 1
