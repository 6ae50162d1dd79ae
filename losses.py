"""Losses as nn.Modules, and ``build_criterion`` used by train.py."""

import torch.nn as nn


def build_criterion(config):
    """Builds the training criterion from the resolved config.

    Args:
        config: a mapping with ``label_smoothing`` (float in [0, 1)).

    Returns:
        ``nn.CrossEntropyLoss`` with that label smoothing, mean over the batch.
    """
    return nn.CrossEntropyLoss(label_smoothing=float(config.get("label_smoothing", 0.0)))
