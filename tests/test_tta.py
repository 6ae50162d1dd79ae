"""Test-time flips (--tta flip): the mirror's logits are averaged in, digits excepted."""

import json

import torch
from helpers import tiny_args

import tasks
import train
from machinery import engine
from tasks.classification import Classification

FOUR = Classification(4)  # classes

CPU = torch.device("cpu")


class MirrorInvariant(torch.nn.Module):
    """Global average pooling, then a linear layer: a mirror image gives the same logits."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


def batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(5, 3, 6, 6, generator=g), torch.randint(0, 4, (5,), generator=g))
            for _ in range(n)]


def test_flips_change_nothing_for_a_mirror_invariant_network():
    torch.manual_seed(0)
    net, loop = MirrorInvariant(), engine.LoopSettings(device=CPU)
    plain = engine.evaluate(net, batches(), loop, FOUR)
    flipped = engine.evaluate(net, batches(), loop, FOUR, tta=True)
    assert torch.equal(plain["confusion"], flipped["confusion"])
    assert abs(plain["loss"] - flipped["loss"]) < 1e-6


def test_flips_average_the_logits_of_an_image_and_its_mirror():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 4))
    loop = engine.LoopSettings(device=CPU)
    result = engine.evaluate(net, batches(), loop, FOUR, tta=True)
    with torch.no_grad():
        loss, correct = 0.0, 0
        for x, y in batches():
            logits = (net(x) + net(torch.flip(x, dims=[3]))) / 2
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
    assert abs(result["loss"] - loss / 15) < 1e-6 and result["acc"] == correct / 15
    assert result["loss"] != engine.evaluate(net, batches(), loop, FOUR)["loss"]


def test_train_validates_with_flips_and_digits_keep_their_side(tmp_path):
    assert train.main(tiny_args(tmp_path / "flip", "--tta", "flip")) == 0
    assert train.main(tiny_args(tmp_path / "plain")) == 0
    read = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])
            for d in ("flip", "plain")]
    assert read[0]["val_loss"] != read[1]["val_loss"]  # the mlp is not mirror-invariant
    assert tasks.use_tta({"tta": "flip", "dataset": "cifar10"})
    assert not tasks.use_tta({"tta": "flip", "dataset": "mnist"})
    assert not tasks.use_tta({"tta": "none", "dataset": "cifar10"})
