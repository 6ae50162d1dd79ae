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
