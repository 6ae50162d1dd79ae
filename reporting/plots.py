"""Pictures a run shows in TensorBoard: the confusion matrix of a validation.

Drawn with matplotlib's object API on an Agg canvas (no pyplot: no global figure state,
no display), returned as an ``HxWx3`` uint8 array for ``RunLog.image``.
"""

import numpy as np

from machinery import files

NAMED_CLASSES = 30      # up to this many classes, their names label the axes
ANNOTATED_CLASSES = 12  # up to this many, each cell shows its share


def confusion_image(confusion, classes, title=""):
    """The confusion matrix with each row (a true class) divided by its count, so the
    diagonal reads as each class's accuracy.

    Args:
        confusion: a ``(C, C)`` tensor or array of counts, rows true, columns predicted.
        classes: the class names, in label order.
        title: a line above the matrix (e.g. the accuracy and the epoch).

    Returns:
        An ``(H, W, 3)`` uint8 array.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(confusion, dtype=np.float64)
    n = counts.shape[0]
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    side = min(max(4.5, 0.32 * n + 2.5), 14.0)  # inches: a cell stays readable
    figure = Figure(figsize=(side + 1.0, side), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    shown = axes.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(shown, ax=axes, fraction=0.046, pad=0.04)
    named = n <= NAMED_CLASSES
    ticks = np.arange(n) if named else np.unique(np.linspace(0, n - 1, 11).round()).astype(int)
    # a folder named in Latin-1 (b"caf\xe9") is escaped: matplotlib takes UTF-8 text only
    labels = [files.printable(str(classes[i])) if named else str(i) for i in ticks]
    axes.set_xticks(ticks, labels, rotation=90 if named and n > 6 else 0,
                    fontsize=8 if n > 12 else 10)
    axes.set_yticks(ticks, labels, fontsize=8 if n > 12 else 10)
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    if title:
        axes.set_title(files.printable(title), fontsize=10)
    if n <= ANNOTATED_CLASSES:
        for i in range(n):
            for j in range(n):
                if counts[i, j]:
                    axes.text(j, i, f"{shares[i, j]:.2f}", ha="center", va="center",
                              fontsize=8, color="white" if shares[i, j] > 0.5 else "black")
    figure.tight_layout()
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
