"""Datasets, transforms, the deterministic sampler and the per-sample loaders.

Determinism promise (docs/design.md): the order of samples in an epoch depends only on the
seed and the epoch, and a sample's random augmentation only on (seed, epoch, index).
``EpochBatchSampler`` yields keys ``(index, epoch)``. A sample's crop offset and flip are
drawn from a counter-based integer hash of (seed, epoch, index) (``crop_flip_draws``);
any other random transform draws from torch's generator, which ``SeededDataset`` seeds
from the same key. So results do not depend on the batch size, the number of DataLoader
workers, the number of processes, or where a run was resumed.

This is the per-sample path: ``SeededDataset`` in a DataLoader (``build_loader``), one PIL
image or tensor at a time, in worker processes. The device path (device_data.py) holds a
whole set on the training device and makes whole batches there with the same draws and
the same arithmetic (``crop_flip_draws``, ``normalise``), so both paths give the same
samples, bit for bit on the CPU.
"""

import atexit
import contextlib
import hashlib
import multiprocessing
import multiprocessing.util  # noqa: F401 (see _end_leftover_workers)
import os
import re
import signal
import socket
import sys
import time

import torch
import torch.utils.data
from torchvision import datasets as tv_datasets
from torchvision.transforms import v2

from machinery import files, runtime
from machinery.runtime import say
from ops import Interrupted, UserError
from pipeline import decoded_cache, hf_data, presets, recipes, shards, sources
from pipeline.images import UnreadableImage, load_image
from pipeline.sample_transforms import (
    FOLDERS,
    PHOTO_SIDE,
    STATS,
    Normalise,
    SampleCrop,
    SampleFlip,
    sample_seed,
    seeded,
)

TORCHVISION_SETS = {"cifar10": tv_datasets.CIFAR10, "cifar100": tv_datasets.CIFAR100,
                    "mnist": tv_datasets.MNIST, "fashion_mnist": tv_datasets.FashionMNIST}
DATASETS = sorted(TORCHVISION_SETS) + ["imagefolder", "synthetic", "hf", "shards"]


class SeededDataset(torch.utils.data.Dataset):
    """A dataset whose random transform is seeded per sample from (seed, epoch, index).

    Indexed by a key ``(index, epoch)`` (or a plain index, meaning epoch 0). The global
    torch RNG is forked around the transform, so augmentation never disturbs the
    randomness of the model (dropout) in the main process.

    Args:
        base: a map-style dataset returning ``(image, label)``.
        transform: applied to the image.
        seed: the run's seed.
        random: whether ``transform`` is random (training augmentation).
        classes: class names, in label order.
        in_channels: channels of the transformed images.
        image_size: side of the transformed (square) images.
    """

    def __init__(self, base, transform, seed, random, classes, in_channels, image_size):
        self.base = base
        self.transform = transform
        self.seed = seed
        self.random = random
        self.classes = [files.printable(c) for c in classes]  # non-UTF-8 names escaped
        self.num_classes = len(self.classes)
        self.in_channels = in_channels
        self.image_size = image_size

    def __len__(self):
        return len(self.base)

    def unreadable_count(self):
        """The number of distinct files of the set found unreadable so far by this process
        or its DataLoader workers (0 for sets that read no files)."""
        count = getattr(self.base, "unreadable_count", None)
        return count() if count is not None else 0

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        if getattr(self.base, "streamed", False):  # read in the epoch's order (shards.py)
            self.base.epoch = epoch
        image, label = self.base[index]
        if not self.random:
            return self.transform(image), label
        # Crop and flip read the key (current_sample); any other random transform draws
        # from torch's CPU generator, seeded for this sample and restored afterwards
        # (torch.random.fork_rng does the same but costs 50x more per sample).
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(sample_seed(self.seed, epoch, index))
        try:
            with seeded(self.seed, epoch, index):
                return self.transform(image), label
        finally:
            generator.set_state(state)


class SyntheticImages(torch.utils.data.Dataset):
    """Learnable images made in memory: a smooth random template per class plus noise.

    Templates are 4x4 random patterns upsampled to the image size, so they survive the
    default crop-and-flip augmentation and a small CNN learns to tell them apart.

    Args:
        size: number of samples.
        num_classes: number of classes (labels are balanced).
        in_channels: channels of the images.
        image_size: side of the square images.
        seed: seeds templates, labels and noise (the same seed gives the same set).
        split: ``"train"`` or ``"val"``; the two share templates, not samples.
        noise: standard deviation of the per-pixel noise.
    """

    def __init__(self, size, num_classes, in_channels, image_size, seed, split, noise=0.6):
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, in_channels, 4, 4, generator=g)
        templates = torch.nn.functional.interpolate(coarse, size=(image_size, image_size),
                                                    mode="bilinear", align_corners=False)
        templates = templates / templates.std(dim=(1, 2, 3), keepdim=True)
        g.manual_seed(seed * 2 + (split == "val"))  # splits share templates, not samples
        self.labels = torch.arange(size) % num_classes
        self.labels = self.labels[torch.randperm(size, generator=g)]
        noise = noise * torch.randn(size, in_channels, image_size, image_size, generator=g)
        self.images = templates[self.labels] + noise  # (size, C, H, W), about N(0, 1)
        self.classes = [f"class{i}" for i in range(num_classes)]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class SafeImageFolder(tv_datasets.ImageFolder):
    """An ImageFolder on which an unreadable image never stops a run.

    A sample whose file cannot be read (see ``load_image``) is replaced by the next readable
    sample of the set, wrapping around: the replacement depends only on the files, so
    results are the same with any number of workers and after a resume. A ``warning:``
    line naming the file goes to stderr. Unreadable files are flagged in a shared-memory
    tensor that the main process and the DataLoader workers (forked, or spawned: it is
    pickled as shared memory) all see; flagged files are skipped without reading them
    again, so each is reported once.

    Args:
        root: the folder with one sub-folder per class.

    Raises:
        UserError: no image of the set can be read (checked when it is built, from the
            first image on, in the process that builds it).
    """

    def __init__(self, root, check=True):
        super().__init__(root, loader=load_image)
        self.unreadable = torch.zeros(len(self.samples), dtype=torch.uint8).share_memory_()
        # (width, height) of each image read with a short side (photos) before it was
        # resized, (0, 0) before; shared with the decoding workers as ``unreadable`` is
        self.source_sizes = torch.zeros(len(self.samples), 2,
                                        dtype=torch.int32).share_memory_()
        if check:  # (photos skip it: their decoded cache reads them all, or reuses)
            self[0]  # finds a readable image now, or raises UserError

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None,
                     allow_empty=False):
        """torchvision's ``make_dataset`` (the same samples in the same order), except that
        a directory reached a second time (a symbolic link to a parent, to another class
        folder, to itself) is skipped with one warning each: the set is what is on disk,
        each image under its own class, once."""
        if is_valid_file is None:
            def is_valid_file(path):
                return tv_datasets.folder.has_file_allowed_extension(path, extensions)
        seen = {}  # (device, inode) -> the path a directory was first reached by
        for path in [directory] + [os.path.join(directory, c) for c in class_to_idx]:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                seen.setdefault((st.st_dev, st.st_ino), path)
        instances, found = [], set()
        for target_class in sorted(class_to_idx):
            target_dir = os.path.join(directory, target_class)
            if not os.path.isdir(target_dir):
                continue
            walked = []
            for root, dirs, fnames in os.walk(target_dir, followlinks=True):
                dirs[:] = _first_visits(root, sorted(dirs), seen)
                walked.append((root, fnames))
            for root, fnames in sorted(walked):
                for fname in sorted(fnames):
                    path = os.path.join(root, fname)
                    if is_valid_file(path):
                        instances.append((path, class_to_idx[target_class]))
                        found.add(target_class)
        empty = set(class_to_idx) - found
        if empty and not allow_empty:
            raise FileNotFoundError(f"Found no valid file for the classes "
                                    f"{', '.join(sorted(empty))}")
        return instances

    def __getitem__(self, index):
        return self.read(index, self.loader)

    def read(self, index, loader):
        """Sample ``index`` read with ``loader`` (a path -> image function), or, where its
        file is unreadable, the next readable one (see the class)."""
        size = len(self.samples)
        for i in (j % size for j in range(index, index + size)):
            if self.unreadable[i]:
                continue
            path, label = self.samples[i]
            try:
                image = loader(path)
            except UnreadableImage as e:
                self.unreadable[i] = 1
                say(f"warning: skipping unreadable image {path} ({e}); the next readable "
                    f"image of the set stands in for it", file=sys.stderr)
                continue
            size = getattr(image, "info", {}).get("source_size")
            if size is not None:
                self.source_sizes[i] = torch.tensor(size, dtype=torch.int32)
            return image, label
        raise UserError(f"no image in {self.root!r} can be read (see the warnings above)")

    def unreadable_count(self):
        """The number of distinct files of the set found unreadable so far."""
        return int(self.unreadable.sum())


def _first_visits(root, dirs, seen):
    """The sub-directories of ``root`` not reached before (``seen``, updated); each one
    reached again is named in a warning."""
    keep = []
    for name in dirs:
        path = os.path.join(root, name)
        try:
            st = os.stat(path)
        except OSError:
            keep.append(name)  # os.walk reports nothing for it either
            continue
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first == path:
            keep.append(name)
        else:
            say(f"warning: skipping {path}: it is {first} again (a symbolic link to a "
                f"folder already read); its images are read once, under their own folder",
                file=sys.stderr)
    return keep


def set_identity(dataset):
    """What a checkpoint records of the training set, to tell a resume onto other data:
    ``{"size": N, "fingerprint": hex}``. For an image folder (photos too) the fingerprint
    hashes every sample's path (relative to the split, its own bytes: a name that is not
    UTF-8 too) and label; for the other sets, their kind and labels (the synthetic set:
    its recipe)."""
    base, h = dataset.base, hashlib.sha256()
    if isinstance(base, CachedImages):  # photos: their folder's files, as small images'
        base = base.folder
    if isinstance(base, SafeImageFolder):
        for path, label in base.samples:
            h.update(os.fsencode(os.path.relpath(path, base.root)) + f"\0{label}\n".encode())
    elif isinstance(base, SyntheticImages):
        h.update(f"synthetic {dataset.seed} {dataset.image_size} {dataset.in_channels} "
                 f"{dataset.num_classes}".encode())
        h.update(base.labels.numpy().tobytes())
    elif hasattr(base, "identity"):  # hf, shards (sources.py): their contents, labels
        h.update(base.identity())
    else:
        h.update(type(base).__name__.encode())
        h.update(torch.as_tensor(getattr(base, "targets", [])).numpy().tobytes())
    return {"size": len(dataset), "fingerprint": h.hexdigest()}


def unreadable_reason(path):
    """Why ``load_image`` refuses a file (read again: workers that found it said it once)."""
    try:
        load_image(path)
    except UnreadableImage as e:
        return str(e)
    return "unreadable when it was read"


def mirror_keeps_class(name):
    """Whether a mirrored image of dataset ``name`` is still of its class (a mirrored digit
    is another digit): training flips and --tta flip apply only where it is."""
    return name not in recipes.DIGITS


def _transforms(name, image_size, augment, from_pil=True, policy=((), ())):
    """The train (maybe augmented) and eval transforms of a dataset.

    Images are cropped and flipped as uint8 (cheaper), then scaled to [0, 1] floats and
    normalised with the dataset's statistics. Crop and flip draw from (seed, epoch,
    index) (``SampleCrop``, ``SampleFlip``); the device path does the same to whole
    batches (``device_pipeline`` reads these lists: a transform it does not know keeps
    a run on the per-sample path). ``policy`` is ``recipes.policy_transforms``'s pair:
    an AutoAugment-family policy after crop and flip, random erasing after normalising.
    """
    front = [v2.ToImage()] if from_pil else []
    if name in FOLDERS:  # (images of any size: an image folder, hf, shards)
        front.append(v2.Resize((image_size, image_size), antialias=True))
    back = [Normalise(*STATS[name])] if name in STATS else []  # every PIL set has STATS
    aug = []
    if augment:
        aug = [SampleCrop(padding=max(image_size // 8, 1))]
        if mirror_keeps_class(name):
            aug.append(SampleFlip())
    if augment:
        aug, back_train = aug + list(policy[0]), back + list(policy[1])
    else:
        back_train = back
    train, evaluation = front + aug + back_train, front + back
    return (v2.Compose(train) if train else v2.Identity(),
            v2.Compose(evaluation) if evaluation else v2.Identity())


def _torchvision_split(name, data_dir, train):
    cls = TORCHVISION_SETS[name]
    try:
        return cls(data_dir, train=train, download=False)
    except RuntimeError:
        pass  # not there yet: download it
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    try:
        return cls(data_dir, train=train, download=True)
    except Exception as e:  # URLError, HTTPError, OSError, checksum errors...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"could not download {name} into {data_dir!r} ({reason}); offline? Put an "
            f"existing copy there and pass --data-dir, or train on --dataset imagefolder "
            f"or --dataset synthetic") from None
    finally:
        socket.setdefaulttimeout(old_timeout)


def _imagefolder_splits(config, policy, log, stop):
    data_dir, image_size = config["data_dir"], config["image_size"]
    augment, seed = config["augment"], config["seed"]
    train_dir = os.path.join(data_dir, "train")
    val_dir = next((os.path.join(data_dir, s) for s in ("val", "test")
                    if os.path.isdir(os.path.join(data_dir, s))), None)
    if not os.path.isdir(train_dir) or val_dir is None:
        raise UserError(f"--dataset imagefolder needs {data_dir!r} to hold train/ and val/ "
                        f"(or test/) folders with one sub-folder per class")
    try:
        photos = image_size >= PHOTO_SIDE
        train = SafeImageFolder(train_dir, check=not photos)
        val = SafeImageFolder(val_dir, check=not photos)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"cannot read image folders in {data_dir!r}: {e}") from None
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(f"the class folders of {train_dir!r} and {val_dir!r} differ: only "
                        f"in train: {only_train or 'none'}; only in "
                        f"{os.path.basename(val_dir)}: {only_val or 'none'}")
    if len(train.classes) == 1:
        say(f"warning: {train_dir!r} has a single class folder ({train.classes[0]!r}): "
            f"every label is the same, so there is nothing to learn", file=sys.stderr)
    if image_size >= PHOTO_SIDE:  # photos: decoded once into the cache, read from there
        t_train, t_eval = presets.transforms(config, policy)
        p = presets.preset(config)
        decoder = presets.ShortSide(presets.stored_side(image_size, config["crop_pct"]),
                                    p["interpolation"])
        cache_dir = config.get("cache_dir") or decoded_cache.default_cache_dir(data_dir)
        train, val = (CachedImages(folder, decoded_cache.decoded_folder(
            folder, decoder, cache_dir, config["num_workers"], log, stop,
            unreadable_reason)) for folder in (train, val))
        say_upscaled((train.folder, val.folder), decoder.side, image_size)
    else:
        t_train, t_eval = _transforms("imagefolder", image_size, augment, policy=policy)
    return (SeededDataset(train, t_train, seed, augment, train.classes, 3, image_size),
            SeededDataset(val, t_eval, seed, False, val.classes, 3, image_size))


def say_upscaled(folders, side, crop):
    """One warning line for the photos of ``folders`` decoded just now whose short side was
    under ``side`` (so they were upscaled), none when there are none; the smallest is named.

    Args:
        folders: SafeImageFolders (their ``source_sizes``, filled as they were decoded).
        side: the short side photos are stored at (``presets.stored_side``).
        crop: the crop's side (--image-size).
    """
    sizes = torch.cat([f.source_sizes for f in folders]).long()
    paths = [path for f in folders for path, _ in f.samples]
    short = sizes.min(dim=1).values
    small = (short > 0) & (short < side)
    if not small.any():
        return
    smallest = int(torch.where(small, short, side).argmin())
    under_crop = int(((short > 0) & (short < crop)).sum())
    width, height = sizes[smallest].tolist()
    say(f"warning: {int(small.sum())} of {int((short > 0).sum())} photos decoded were smaller "
        f"than the {side} px their short side is stored at, so they were upscaled "
        f"({under_crop} of them smaller than the {crop} px crop itself); the smallest: "
        f"{paths[smallest]} ({width}x{height})", file=sys.stderr)


class CachedImages(torch.utils.data.Dataset):
    """An image folder's photos from its decoded cache: ``(image, label)`` with a (3, h, w)
    uint8 image (short side ``presets.stored_side``), read from a memory map.

    Args:
        folder: the SafeImageFolder (its classes; its unreadable images, flagged while
            the cache was built or named by its record).
        decoded: its ``decoded_cache.Decoded``.
    """

    def __init__(self, folder, decoded):
        self.folder, self.decoded = folder, decoded
        self.classes, self.root = folder.classes, folder.root

    def __len__(self):
        return len(self.decoded)

    def __getitem__(self, index):
        return self.decoded.image(index), int(self.decoded.labels[index])

    def unreadable_count(self):
        return self.folder.unreadable_count()


@contextlib.contextmanager
def requeue_on_stop(config):
    """Marks the ``ops.Interrupted`` of a stop signal that is ``--requeue-signal``'s
    (SLURM's warning before a time limit) with ``requeue = True``: train.main then
    requeues the job, as a stop during training does."""
    try:
        yield
    except Interrupted as e:
        e.requeue = e.signum == signal.Signals[f"SIG{config.get('requeue_signal', 'USR1')}"]
        raise


def build_datasets(config, log=say, should_stop=None):
    """Builds the training and validation datasets named by the config.

    Args:
        config: a resolved config (every flag; ``config.with_defaults`` fills a stored
            one): ``dataset``, ``data_dir``, ``seed``, ``augment``, ``image_size``,
            ``synthetic_size``, ``num_classes`` and the policy flags (``auto_augment``,
            ``randaugment_magnitude``, ``random_erase``). ``in_channels``, not a flag,
            sets the synthetic set's channels (default 3).

    Returns:
        ``(train, val)``: two SeededDataset with ``classes``, ``num_classes``,
        ``in_channels`` and ``image_size`` attributes. The training set augments when
        ``config["augment"]``; the validation set never does.

        An image folder reads its images with ``load_image``; unreadable ones are replaced
        and counted (see ``SafeImageFolder``, ``SeededDataset.unreadable_count``). One with a
        single class gets a ``warning:`` line on stderr. At ``image_size`` 64 and above
        it is photos (presets.py): both splits are decoded once into their decoded cache
        (``crop_pct``, ``crop_min_scale``, ``num_workers``; ``cache_dir``, not a flag,
        defaults to ``<data-dir>/.cache``) and read from there.

    Args (more):
        log: prints where a decoded cache is and how big.
        should_stop: returns a signal's number to stop a cache build at (``ops.
            Interrupted``, its ``requeue`` set: ``requeue_on_stop``), or None.

    Raises:
        UserError: unknown dataset, missing directory, download impossible, an image
            folder without a single readable image.
    """
    name, data_dir, seed = config["dataset"], config["data_dir"], config["seed"]
    augment, image_size = config["augment"], config["image_size"]
    policy = recipes.policy_transforms(  # --auto-augment, --random-erase
        config["auto_augment"], config["randaugment_magnitude"], config["random_erase"], name)
    if name == "synthetic":
        size, classes, channels = (config["synthetic_size"], config["num_classes"],
                                   config.get("in_channels", 3))
        if size < 1 or classes < 2:
            raise UserError("--synthetic-size must be at least 1 and --num-classes at least 2")
        train = SyntheticImages(size, classes, channels, image_size, seed, "train")
        val = SyntheticImages(max(size // 5, 1), classes, channels, image_size, seed, "val")
        t_train, t_eval = _transforms(name, image_size, augment, from_pil=False,
                                      policy=policy)
        return (SeededDataset(train, t_train, seed, augment, train.classes, channels, image_size),
                SeededDataset(val, t_eval, seed, False, val.classes, channels, image_size))
    if name == "imagefolder":
        if not os.path.isdir(data_dir):
            raise UserError(f"--data-dir {data_dir!r} does not exist")
        with requeue_on_stop(config):
            return _imagefolder_splits(config, policy, log, should_stop)
    if name in ("hf", "shards"):  # pipeline/hf_data.py, pipeline/shards.py
        train, val = hf_data.splits(config) if name == "hf" else shards.splits(config, log)
        t_train, t_eval = sources.as_photos(config, (train, val), policy) or _transforms(
            name, image_size, augment, policy=policy)  # (photos: as a folder's, presets.py)
        return (SeededDataset(train, t_train, seed, augment, train.classes, 3, image_size),
                SeededDataset(val, t_eval, seed, False, val.classes, 3, image_size))
    if name not in TORCHVISION_SETS:
        raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    train, val = (_torchvision_split(name, data_dir, split) for split in (True, False))
    side, channels = native_geometry(name)
    t_train, t_eval = _transforms(name, side, augment, policy=policy)
    return (SeededDataset(train, t_train, seed, augment, train.classes, channels, side),
            SeededDataset(val, t_eval, seed, False, val.classes, channels, side))


def native_geometry(name):
    """``(side, channels)`` of a torchvision set's images (MNIST's 28 and 1, CIFAR's 32
    and 3), whatever --image-size says; None for the others."""
    if name not in TORCHVISION_SETS:
        return None
    return (28, 1) if name in recipes.DIGITS else (32, 3)


class EpochBatchSampler:
    """Batches of keys ``(index, epoch)`` in an order that depends on (seed, epoch) only.

    The epoch's permutation is cut into global batches of ``batch_size * world_size``;
    process ``rank`` takes its contiguous share of each. So P processes with batch B see
    together exactly what one process with batch P*B sees. The last global batch keeps
    every remaining sample (none dropped); where it has fewer samples than processes, a
    process with no sample gets one stand-in sample with weight 0 (``plan()`` says so).

    Args:
        size: samples in the dataset.
        batch_size: samples per batch per process.
        seed: the run's seed.
        shuffle: permute each epoch (training) or keep the index order.
        rank: this process's rank.
        world_size: number of processes.
        order: ``(seed, epoch) -> permutation`` where the set has an order of its own
            (streamed shards, shards.py); None: ``torch.randperm``.
    """

    def __init__(self, size, batch_size, seed, shuffle=True, rank=0, world_size=1, order=None):
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.order = order
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0
        self.observer = None  # told of every batch handed out (machinery/ledger.py)

    def set_epoch(self, epoch, start=0):
        """Selects the epoch and the number of its samples already seen (to skip them)."""
        self.epoch, self.start = epoch, start

    def _order(self):
        if not self.shuffle:
            return torch.arange(self.size)
        if self.order is not None:
            return self.order(self.seed, self.epoch)
        g = torch.Generator().manual_seed(self.seed * 10_007 + self.epoch)
        return torch.randperm(self.size, generator=g)

    def _chunks(self):
        """Global batches of the rest of the epoch: (global indices, local indices)."""
        order = self._order()[self.start:]
        if len(order) == 0:  # resumed after the epoch's last step: nothing left (split of
            return           # an empty tensor would give one empty batch)
        step = self.batch_size * self.world_size
        for chunk in order.split(step):
            if len(chunk) == step:
                local = chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            else:
                local = chunk.tensor_split(self.world_size)[self.rank]
            yield chunk, local

    def plan(self):
        """``(global_count, local_count)`` of each remaining batch, in order."""
        return [(len(chunk), len(local)) for chunk, local in self._chunks()]

    def __len__(self):
        return -(-(self.size - self.start) // (self.batch_size * self.world_size))

    def index_batches(self):
        """This process's remaining batches of the epoch as int64 tensors of indices (the
        keys of ``__iter__`` without the epoch, which is ``self.epoch``); an ``observer``
        hears ``begin(epoch, start)``, then ``batch(global count, local indices)`` of each."""
        if self.observer is not None:
            self.observer.begin(self.epoch, self.start)
        for chunk, local in self._chunks():
            if self.observer is not None:
                self.observer.batch(len(chunk), local)
            yield local if len(local) else chunk[-1:]  # stand-in: weighted 0, keeps
            #                                             collectives in step

    def __iter__(self):
        for local in self.index_batches():
            yield [(i, self.epoch) for i in local.tolist()]


def build_loader(dataset, batch_sampler=None, batch_size=None, num_workers=0,
                 pin_memory=False, sampler=None):
    """A DataLoader that keeps every sample and never draws from the global RNG.

    Args:
        dataset: the dataset.
        batch_sampler: an EpochBatchSampler (training), or None.
        batch_size: batch size when no batch_sampler is given (evaluation).
        num_workers: worker processes (persistent; they ignore SIGINT/SIGTERM/SIGHUP).
        pin_memory: page-locked host memory for faster copies to CUDA.
        sampler: an index sampler for evaluation (e.g. one shard of the set).

    Returns:
        The torch.utils.data.DataLoader.
    """
    kwargs = dict(batch_size=batch_size, shuffle=False, drop_last=False, sampler=sampler)
    if batch_sampler is not None:
        kwargs = dict(batch_sampler=batch_sampler)
    return torch.utils.data.DataLoader(
        dataset, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=num_workers > 0, worker_init_fn=runtime.ignore_stop_signals,
        generator=torch.Generator().manual_seed(0),  # iter() must not draw from torch's RNG
        **kwargs)


def shard_indices(size, rank, world_size):
    """The contiguous share of ``range(size)`` evaluated by ``rank``: no padding, no repeat."""
    return list(range(rank * size // world_size, (rank + 1) * size // world_size))


_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([0-9, ]+)\) (?:is killed by "
                          r"signal: ([^.]+)\.|exited unexpectedly( with exit code)?)")


def worker_death(error):
    """The line that says what happened when ``error`` is the DataLoader's report of a
    worker that died (``RuntimeError: DataLoader worker (pid N) is killed by signal:
    Killed``, or ``exited unexpectedly``); else None.

    A worker killed with SIGKILL is, unless someone sent it, the kernel's out-of-memory
    killer's doing; SIGBUS, a full shared memory (/dev/shm), which workers hand their
    batches through.

    A worker killed while this process read a batch from it can also surface as the
    socket it shared the batch through, reset (``ConnectionResetError``: the DataLoader
    looked for dead workers a moment before the kernel had reaped it): then the workers
    of the loader in ``error``'s frames say which one died.

    Args:
        error: an exception.

    Returns:
        The line (without ``error:``), or None.
    """
    names = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
    if isinstance(error, ConnectionError):
        dead = _dead_workers(error)
        if not dead:
            return None
        pids = ", ".join(str(w.pid) for w in dead)
        code = dead[0].exitcode  # (negative: the signal that ended it)
        how = signal.strsignal(-code) if code < 0 else None
    else:
        match = _WORKER_DIED.search(str(error))
        if not isinstance(error, RuntimeError) or match is None:
            return None
        pids, how, code = match[1].strip(), match[2], match[3]
    if how is None and code is None:  # found dead while the loader waited: its status is
        how = _killed_by(error)       # with the loader's frame (its SIGCHLD handler has it)
    what = f"was killed by {names.get(how, how)}" if how else "exited unexpectedly"
    if how is not None and names.get(how) == "SIGBUS":
        cause = ("most likely out of shared memory (/dev/shm, which workers hand batches "
                 "through): use fewer --num-workers or a smaller --batch-size, or give the "
                 "machine (a container: --shm-size) more")
    elif (how is None and code is None) or names.get(how) == "SIGKILL":
        cause = ("most likely the kernel's out-of-memory killer: the machine ran out of "
                 "memory; use fewer --num-workers or a smaller --batch-size")
    else:
        cause = "it crashed; --num-workers 0 reads the data in this process and shows why"
    return (f"a DataLoader worker (pid{'s' if ',' in pids else ''} {pids}) {what}: {cause}. "
            f"The checkpoints are intact: continue with --resume auto")


def _dead_workers(error, wait=2.0):
    """The worker processes that ended with an error (an exit code other than 0) of the
    DataLoader iterator in ``error``'s frames (``self._workers``), each waited for up to
    ``wait`` seconds in all: one being killed is reaped a moment after its sockets close."""
    traceback, workers = error.__traceback__, []
    while traceback is not None and not workers:
        workers = list(getattr(traceback.tb_frame.f_locals.get("self"), "_workers", None) or ())
        traceback = traceback.tb_next
    deadline = time.monotonic() + wait
    for worker in workers:
        if worker.exitcode is None:
            with contextlib.suppress(Exception):  # (not a child of this process)
                worker.join(max(deadline - time.monotonic(), 0))
    return [w for w in workers if w.exitcode not in (None, 0)]


def _killed_by(error):
    """The description (``signal.strsignal``) of the signal that killed the workers that
    the DataLoader found dead while it waited (``exited unexpectedly``), or None: their
    ``multiprocessing.Process`` objects, exit codes included, are the ``failed_workers``
    of the frame that raised ``error``."""
    traceback = error.__traceback__
    while traceback is not None:
        for worker in traceback.tb_frame.f_locals.get("failed_workers", ()):
            code = getattr(worker, "exitcode", None)
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    return signal.strsignal(-code)
        traceback = traceback.tb_next
    return None


def _end_leftover_workers(grace=2.0):
    """At exit: ends the daemonic child processes still running, DataLoader workers that
    an error left behind. They ignore SIGTERM (``runtime.ignore_stop_signals``), which is
    all that multiprocessing's own exit handler sends them before it waits for them:
    forever. So SIGTERM first (any other child may end cleanly), then, after ``grace``
    seconds, SIGKILL."""
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises for a worker that dies: here, that is the point
    with contextlib.suppress(ValueError):  # (not the main thread)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for process in children:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in children:
        process.join(max(deadline - time.monotonic(), 0))
        if process.is_alive():
            process.kill()
            process.join(10)


# multiprocessing.util registers its exit handler when it is imported (above); atexit
# runs the last registered first: ours, then it.
atexit.register(_end_leftover_workers)


def shutdown_loader(loader):
    """Stops a loader's persistent workers now (not at interpreter exit, where workers that
    ignore SIGTERM would be waited for)."""
    # DataLoader has no public way to stop persistent workers before it is garbage
    # collected; its iterator's _shutdown_workers is what its own __del__ calls.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None
