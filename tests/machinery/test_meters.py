"""machinery/meters.py: the device-side counters a training step adds to, read in one
transfer."""

import math

import torch

from machinery.engine import TrainState
from machinery.meters import Counters, LossMeter


def test_a_tasks_figures_are_summed_by_name_over_micro_batches_finite_only():
    counters = Counters(torch.device("cpu"))
    counters.add_figures({"loss_d": torch.tensor(0.5), "d_real": torch.tensor(0.25)}, 4)
    counters.add_figures({"loss_d": torch.tensor(1.5), "d_real": torch.tensor(math.nan)}, 2)
    counters.add_figures({"loss_g": torch.tensor(2.0, dtype=torch.bfloat16)}, 3)
    counters.add_figures({"loss_d": torch.tensor(1.0)}, 1)  # one more call, other names
    counters.add_figures({}, 5)  # a phase without figures adds nothing
    figures = counters.read()["figures"]
    assert list(figures) == ["d_real", "loss_d", "loss_g"]  # sorted by name
    assert figures["loss_d"] == (0.5 * 4 + 1.5 * 2 + 1.0, 7)
    assert figures["d_real"] == (0.25 * 4, 4)  # the NaN's micro-batch is not counted
    assert figures["loss_g"] == (6.0, 3)
    assert counters.read()["figures"] == {}  # a read starts new sums


def test_the_loss_meter_means_the_figures_over_a_window():
    counters = Counters(torch.device("cpu"))
    meter = LossMeter(counters)
    for value, n in ((1.0, 2), (4.0, 6)):
        counters.add_figures({"loss_d": torch.tensor(value)}, n)
        counters.add_loss(torch.tensor(value), n)
    state = TrainState()
    meter.collect(state)
    assert meter.figures() == {"loss_d": (1.0 * 2 + 4.0 * 6) / 8}
    assert state.figures == {"loss_d": (26.0, 8)}


def test_folded_losses_keep_the_streaks_and_sums_of_one_by_one_adding():
    # Losses are kept in a list and folded every FOLD_NORMS micro-batches (a few kernels
    # for all of them); the sums, the streaks of non-finite losses (across folds and
    # reads) and the first non-finite one must be what adding them one by one gives.
    from machinery import meters

    generator = torch.Generator().manual_seed(0)
    n = 3 * meters.FOLD_NORMS + 11
    bad = torch.rand(n, generator=generator) < 0.3
    bad[102:107] = True  # a streak of 5 across a fold: 64 losses after the read at 40,
    #                    the list is folded at 104
    values = torch.rand(n, generator=generator) * 3
    counters = Counters(torch.device("cpu"))
    streak = worst = 0
    total, count, first = 0.0, 0, None
    reads = {40, 150}  # reads part-way: the streak goes on across them
    for i in range(n):
        value = math.nan if bad[i] else float(values[i])
        counters.add_loss(torch.tensor(value, dtype=torch.float32), 4 + i % 3)
        assert len(counters.losses) < meters.FOLD_NORMS
        if bad[i]:
            streak += 1
            first = i if first is None else first
        else:
            streak = 0
            total += float(torch.tensor(value, dtype=torch.float32)) * (4 + i % 3)
            count += 4 + i % 3
        worst = max(worst, streak)
        if i in reads or i == n - 1:
            got = counters.read()
            assert (got["streak"], got["worst_streak"]) == (streak, worst), i
            assert got["loss_sum"] == total and got["loss_count"] == count
            start = 0 if i == 40 else (41 if i == 150 else 151)
            assert got["first_nonfinite_loss"] == (None if first is None else first - start)
            total, count, first, worst = 0.0, 0, None, 0


def test_folded_figures_are_exact_sums_over_calls_and_dtypes():
    from machinery import meters

    counters = Counters(torch.device("cpu"))
    expected = {"loss_d": [0.0, 0], "d_real": [0.0, 0], "grad_norm_d": [0.0, 0]}
    for i in range(2 * meters.FOLD_NORMS + 5):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        d = torch.tensor(0.1 + i / 7, dtype=dtype)
        r = torch.tensor(math.inf if i == 33 else 0.5 - i / 300)
        counters.add_figures({"loss_d": d, "d_real": r}, 16 - i % 2)
        counters.add_figures({"grad_norm_d": torch.tensor(float(i))}, 1)
        assert len(counters.kept_figures) < meters.FOLD_NORMS
        for name, value, k in (("loss_d", d, 16 - i % 2), ("d_real", r, 16 - i % 2),
                               ("grad_norm_d", torch.tensor(float(i)), 1)):
            if math.isfinite(float(value)):
                expected[name][0] += float(value) * k
                expected[name][1] += k
    figures = counters.read()["figures"]
    assert figures == {name: tuple(v) for name, v in sorted(expected.items())}
