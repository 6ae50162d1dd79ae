"""--dataset hf: a Hugging Face ``datasets`` dataset as an image classification set.

``--data-dir`` names one of three things, tried in this order:

- a folder written by ``save_to_disk`` (a ``DatasetDict``: its splits by name);
- a folder of Parquet files (the hub's layout: ``train-00000-of-00004.parquet``, or
  ``data/train-*.parquet``, ...), read by ``datasets.load_dataset`` as the hub's are;
- the name of a hub dataset (``user/name``) that ``datasets`` has cached (run once with
  the network: ``datasets.load_dataset(name)``); read offline, from that cache only.

The image column is the one whose feature is an ``Image`` and the label column the one
that is a ``ClassLabel`` (or ``--image-column``, ``--label-column``); the class names are
the ClassLabel's. Images are read as their encoded bytes and decoded by the image
folder's own reader (sources.py), so they go through the same per-sample path, bit for
bit.
"""

import contextlib
import glob
import os

from ops import UserError
from pipeline.sources import EncodedImages, check_labels


class HFImages(EncodedImages):
    """One split of a ``datasets.Dataset``: ``(RGB PIL image, label)`` by row.

    Args:
        table: the split (a ``datasets.Dataset``).
        image_column, label_column: the columns.
        classes: the class names, in label order.
        where: the split, in words.
    """

    def __init__(self, table, image_column, label_column, classes, where):
        import datasets

        labels = list(table[label_column])
        check_labels(labels, classes, where)
        super().__init__(labels, classes, where)
        # the encoded bytes (and path), not a decoded PIL image: decoded by load_image
        self.table = table.select_columns([image_column]).cast_column(
            image_column, datasets.Image(decode=False))
        self.column = image_column
        self.fingerprint = getattr(table, "_fingerprint", "") or ""

    def encoded(self, index):
        cell = self.table[int(index)][self.column]
        if cell is None:
            return b""  # (no image: unreadable)
        if cell.get("bytes") is not None:
            return cell["bytes"]
        with open(cell["path"], "rb") as f:  # an Image column that keeps paths only
            return f.read()

    def name(self, index):
        return f"row {index} of {self.where}"

    def content_name(self):
        return f"{self.where} {self.fingerprint}"


@contextlib.contextmanager
def _offline():
    """Hub datasets are read from the local cache only, never downloaded behind a run's
    back (a run on a node without the network would wait on retries), unless the user set
    HF_HUB_OFFLINE=0: the ``datasets`` and ``huggingface_hub`` switches, set meanwhile."""
    import datasets
    import huggingface_hub

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("0", "false", "no", "off"):
        yield
        return
    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before


def open_dataset(data_dir):
    """The ``DatasetDict`` that ``--data-dir`` names (see the module's docstring).

    Raises:
        UserError: nothing there, or nothing ``datasets`` can read; the message says what
            to place where.
    """
    import datasets

    if os.path.isdir(data_dir):
        if os.path.exists(os.path.join(data_dir, "dataset_dict.json")) or \
                os.path.exists(os.path.join(data_dir, "state.json")):
            try:
                found = datasets.load_from_disk(data_dir)
            except Exception as e:  # FileNotFoundError, ValueError, pyarrow's errors
                raise UserError(f"--data-dir {data_dir!r}: cannot read the dataset saved "
                                f"there ({type(e).__name__}: {_first_line(e)})") from None
            if isinstance(found, datasets.Dataset):
                raise UserError(f"--data-dir {data_dir!r} holds one split, not a dataset of "
                                f"splits: save a DatasetDict ({{'train': ..., 'validation': "
                                f"...}}) with save_to_disk")
            return found
        if glob.glob(os.path.join(data_dir, "**", "*.parquet"), recursive=True):
            return _load(datasets, data_dir, f"the Parquet files in {data_dir!r}")
        raise UserError(f"--data-dir {data_dir!r} holds neither a dataset written by "
                        f"save_to_disk nor Parquet files")
    if os.path.exists(data_dir) or data_dir.startswith((".", "/")):
        raise UserError(f"--data-dir {data_dir!r} does not exist")
    return _load(datasets, data_dir, f"the hub dataset {data_dir!r}")


def _load(datasets, path, what):
    import huggingface_hub

    try:
        with _offline(), open(os.devnull, "w") as quiet, \
                contextlib.redirect_stderr(quiet):  # (its progress bars)
            return datasets.load_dataset(path)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError,
            huggingface_hub.errors.OfflineModeIsEnabled) as e:
        if os.path.isdir(path):
            raise UserError(f"cannot read {what}: {_first_line(e)}") from None
        cache = datasets.config.HF_DATASETS_CACHE
        raise UserError(
            f"{what} is not in the datasets cache ({cache}): download it once where the "
            f"network is (python -c \"import datasets; datasets.load_dataset('{path}')\", "
            f"with HF_DATASETS_CACHE={cache}), or save it with save_to_disk and pass "
            f"that folder as --data-dir") from None
    except Exception as e:  # a damaged file: pyarrow's and datasets' own errors
        raise UserError(f"cannot read {what} ({type(e).__name__}: {_first_line(e)})") \
            from None


def _first_line(e):
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def columns(table, image_column, label_column, where):
    """``(image column, label column, class names)`` of a split, from its features (an
    ``Image``, a ``ClassLabel``) or as named.

    Raises:
        UserError: a named column it lacks, or none of the kind to find.
    """
    import datasets

    features = table.features
    for named, flag in ((image_column, "--image-column"), (label_column, "--label-column")):
        if named and named not in features:
            raise UserError(f"{flag} {named!r}: {where} has no such column (it has: "
                            f"{', '.join(features)})")
    image = image_column or next((c for c, f in features.items()
                                  if isinstance(f, datasets.Image)), None)
    label = label_column or next((c for c, f in features.items()
                                  if isinstance(f, datasets.ClassLabel)), None)
    if image is None or label is None:
        missing = "an Image" if image is None else "a ClassLabel"
        flag = "--image-column" if image is None else "--label-column"
        raise UserError(f"{where} has no column whose feature is {missing} (columns: "
                        f"{', '.join(features)}): name it with {flag}")
    if not isinstance(features[image], datasets.Image):
        table_image = features[image]
        raise UserError(f"--image-column {image!r} of {where} holds {table_image}, not "
                        f"images")
    if isinstance(features[label], datasets.ClassLabel):
        classes = list(features[label].names)
    else:
        values = [int(x) for x in table[label]]
        classes = [str(i) for i in range(max(values, default=0) + 1)]
    return image, label, classes


def splits(config):
    """``(train, val)``: the two HFImages that ``config`` names (``data_dir``,
    ``train_split``, ``val_split``, ``image_column``, ``label_column``)."""
    data_dir = config["data_dir"]
    found = open_dataset(data_dir)
    names = list(found)
    train_name = config.get("train_split") or "train"
    val_name = config.get("val_split") or next(
        (s for s in ("validation", "test", "val") if s in found), "validation")
    for name, flag in ((train_name, "--train-split"), (val_name, "--val-split")):
        if name not in found:
            raise UserError(f"{flag} {name!r}: {data_dir!r} has no such split (it has: "
                            f"{', '.join(names)})")
    out = []
    for name in (train_name, val_name):
        where = f"{data_dir}[{name}]"
        image, label, classes = columns(found[name], config.get("image_column"),
                                        config.get("label_column"), where)
        out.append(HFImages(found[name], image, label, classes, where))
    train, val = out
    if len(train) == 0:
        raise UserError(f"{train.where} has no rows")
    if len(val.classes) != len(train.classes):
        raise UserError(f"the splits {train_name!r} and {val_name!r} of {data_dir!r} have "
                        f"{len(train.classes)} and {len(val.classes)} classes")
    return train, val
