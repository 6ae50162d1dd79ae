"""The decoded cache: every image of a folder decoded once, stored on disk, trusted only whole.

An image folder is decoded once into ``<data-dir>/.cache`` (``decoded_folder``) and read
from there after: by the device path (device_data.py) and, for photos (presets.py), by
the DataLoader workers too. What an image becomes is a ``Decoder``'s business: resized to
a fixed square (``Resized``: small folders, the device path) or to a short side, aspect
kept (``presets.ShortSide``: photos, a cache of images of many sizes).

A cache is two files: the images (``.npy``, (N, 3, S, S) uint8, for a fixed size; ``.bin``
for sizes that vary: the pixels of every image one after the other, then their (C, H, W)
shapes as int32) and a record (``.json``: the folder's fingerprint, the labels, the
images found unreadable, CRC-32 checksums of the images file and of the record). Both are
written with ``files.atomic_write``, the record last, with plain writes (a full disk is an
OSError, never the SIGBUS of a memory-mapped sparse file). A cache is used only when its
record matches the folder's fingerprint now (``folder_fingerprint``: paths, labels,
sizes, modification and status-change times, inodes, the decoding and the decoders'
versions) and both checksums match; anything else is rebuilt, a damaged cache with a
warning. A build's temporary file carries its writer's ``runtime.owner_tag()``, so the
next build removes what a killed one left (``_remove_orphans``).
"""

import contextlib
import glob
import hashlib
import json
import os
import sys
import time
import zlib

import numpy as np
import torch
import torch.utils.data
import torchvision

from machinery import files, runtime
from machinery.runtime import say
from ops import Interrupted, UserError

CACHE_VERSION = 3    # of the cache's layout and record
ORPHAN_AGE = 3600    # s: a temporary cache file of no known writer, untouched this long, goes
DECODE_BATCH = 16    # images a decoding worker hands over at a time (a stop waits for one)
_UNWRITABLE = set()  # cache directories this process could not write (warned about once)


class Resized:
    """Decodes an image as the per-sample path of a small folder does (``load_image``,
    then ``front``: ``v2.ToImage``, ``v2.Resize((S, S))``): a fixed (3, S, S) uint8."""

    def __init__(self, front, image_size):
        self.front, self.shape = front, (3, image_size, image_size)
        self.name = f"{image_size}px"

    def describe(self):
        return repr(self.front)

    def __call__(self, folder, index):
        image, label = folder[index]  # an unreadable image: the next readable one
        return self.front(image).as_subclass(torch.Tensor), label


class Decoded:
    """What a cache holds, as CPU tensors (memory-mapped where it is on disk).

    Attributes:
        images: uint8, (N, C, S, S) when every image has one size (``shapes`` is None);
            otherwise flat, every image's pixels in turn, read with ``image(i)``.
        labels: int64 (N,).
        shapes: int64 (N, 3) of (C, H, W), or None; ``offsets``: int64 (N + 1,) into the
            flat ``images``, or None.
    """

    def __init__(self, images, labels, shapes=None):
        self.images, self.labels = images, labels
        self.shapes, self.offsets = shapes, None
        if shapes is not None:
            sizes = shapes.prod(dim=1)
            self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])

    def __len__(self):
        return len(self.labels)

    def image(self, i):
        """Image ``i`` as a (C, H, W) uint8 view."""
        if self.shapes is None:
            return self.images[i]
        c, h, w = self.shapes[i].tolist()
        start = int(self.offsets[i])
        return self.images[start:start + c * h * w].view(c, h, w)

    @property
    def nbytes(self):
        return self.images.numel()


def default_cache_dir(data_dir):
    """Where decoded caches live by default: ``<data-dir>/.cache``."""
    return os.path.join(data_dir, ".cache")


def folder_fingerprint(folder, decoder):
    """A hash of what a decoded cache depends on: every image's relative path, label, size,
    modification and status-change times and inode, the decoding (``decoder.describe()``:
    the image size among it) and the versions of the decoders (torch, torchvision, PIL).

    The status-change time (ctime) and the inode see a file replaced by another of the
    same size whose modification time was set back to the old one, as ``rsync -a``,
    ``tar x`` and ``cp -p`` do: no program can set a ctime.
    """
    import PIL

    h = hashlib.sha256()
    h.update(json.dumps({"version": CACHE_VERSION, "decoder": decoder.describe(),
                         "classes": folder.classes, "torch": torch.__version__,
                         "torchvision": torchvision.__version__,
                         "PIL": PIL.__version__}).encode())
    for path, label in folder.samples:
        try:
            st = os.stat(path)
            facts = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        except OSError:
            facts = [-1]
        h.update(json.dumps([os.path.relpath(path, folder.root), label, *facts])
                 .encode() + b"\n")
    return h.hexdigest()


class _Decoding(torch.utils.data.Dataset):
    """A folder's images through a decoder (what the cache holds), one at a time.

    A user error in a decoding worker (no image of the folder can be read) comes back as
    ``(None, message)``: raised there, the DataLoader would re-raise it here with the
    worker's whole traceback as its message; ``_decoded_batches`` raises it as one line.
    """

    def __init__(self, folder, decoder):
        self.folder, self.decoder = folder, decoder

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, index):
        try:
            return self.decoder(self.folder, index)
        except UserError as e:
            return None, str(e)


def _as_list(batch):
    return batch  # images of many sizes: no stacking


def _decoded_batches(folder, decoder, num_workers, stop):
    """Every image of ``folder`` through ``decoder``, in order: lists of ``(image, label)``
    (uint8 (C, H, W) tensors), decoded by ``num_workers`` processes.

    Raises:
        ops.Interrupted: ``stop()`` named a signal (checked after every batch).
    """
    loader = torch.utils.data.DataLoader(
        _Decoding(folder, decoder), batch_size=DECODE_BATCH, num_workers=num_workers,
        collate_fn=_as_list, worker_init_fn=runtime.ignore_stop_signals,
        generator=torch.Generator().manual_seed(0))
    for batch in loader:
        if stop is not None and stop() is not None:
            raise Interrupted(stop(), f"while decoding {folder.root} into its cache")
        for image, label in batch:
            if image is None:  # (see _Decoding)
                raise UserError(label)
            if decoder.shape is not None and tuple(image.shape) != decoder.shape:
                raise ValueError(f"decoded an image of shape {tuple(image.shape)}, expected "
                                 f"{decoder.shape}")
        yield batch


def _write_images(path, n, decoder, batches):
    """Writes the decoded images to ``path`` as they come, atomically: an ``.npy`` of
    (N, 3, S, S) for a fixed size, else the pixels one after the other and then the
    int32 (C, H, W) shapes.

    Returns:
        ``(labels, crc)``: int64 numpy labels and the CRC-32 of the whole file's content
        after the ``.npy`` header.
    """
    labels, shapes, crc = [], [], 0

    def write(f):
        nonlocal crc
        if decoder.shape is not None:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "|u1", "fortran_order": False, "shape": (n, *decoder.shape)})
        for batch in batches:
            for image, label in batch:
                pixels = np.ascontiguousarray(image.numpy())
                f.write(memoryview(pixels).cast("B"))
                crc = zlib.crc32(pixels, crc)
                labels.append(label)
                shapes.append(image.shape)
        if decoder.shape is None:
            tail = np.asarray(shapes, dtype="<i4").reshape(-1, 3)
            f.write(tail.tobytes())
            crc = zlib.crc32(tail, crc)

    files.atomic_write(path, write, mode="wb", prefix=f".tmp-{runtime.owner_tag()}~")
    return np.asarray(labels, dtype=np.int64), crc


def _remove_orphans(cache_dir):
    """Removes temporary cache files whose writer is gone: of this host and a process that
    no longer runs (``runtime.orphan``), or, unattributed, untouched for ``ORPHAN_AGE``."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return
    for name in names:
        if not name.startswith(".tmp-"):
            continue
        path = os.path.join(cache_dir, name)
        with contextlib.suppress(OSError):
            stale = "~" not in name and time.time() - os.stat(path).st_mtime > ORPHAN_AGE
            if runtime.orphan(name) or stale:
                os.remove(path)


def _record_checksum(record):
    """The CRC-32 of a cache record's contents (all but its ``checksum``), canonical JSON."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _crc(array, chunk=64 * 2**20):
    """The CRC-32 of an array's bytes, in chunks (a memory map is read once)."""
    flat, crc = array.reshape(-1).view(np.uint8), 0
    for start in range(0, flat.size, chunk):
        crc = zlib.crc32(flat[start:start + chunk], crc)
    return crc


def _open_images(path, n, decoder, pixels=None, verify=True):
    """The images file of ``n`` images as a Decoded (memory-mapped, without labels) and
    the CRC-32 of its content (None unless ``verify``); ``pixels``: the bytes of pixels
    of a file of many sizes. Raises ValueError or OSError for a file that does not fit."""
    if decoder.shape is not None:
        images = np.load(path, mmap_mode="c")  # copy-on-write: torch can wrap it
        if images.shape != (n, *decoder.shape) or images.dtype != np.uint8:
            raise ValueError(f"they are {images.dtype} {images.shape}, not uint8 "
                             f"{(n, *decoder.shape)}")
        return Decoded(torch.from_numpy(images), None), _crc(images) if verify else None
    size = os.path.getsize(path)
    pixels = size - 12 * n if pixels is None else int(pixels)
    if pixels < 0 or size != pixels + 12 * n:
        raise ValueError(f"the file holds {size} bytes, not {pixels + 12 * n}")
    whole = np.memmap(path, dtype=np.uint8, mode="c")
    shapes = torch.from_numpy(whole[pixels:].view("<i4").reshape(n, 3).astype(np.int64))
    if int(shapes.prod(dim=1).sum()) != pixels:
        raise ValueError("its shapes do not add up to its pixels")
    return (Decoded(torch.from_numpy(whole[:pixels]), None, shapes),
            _crc(whole) if verify else None)


def _open_cache(base, suffix, fingerprint, folder, decoder):
    """The cache ``base`` + suffix with its record, if it can be trusted.

    Returns:
        ``(decoded, record, problem)``: the cache and its record, or Nones and, when a
        cache is there but damaged (its record or images do not match their checksums,
        it names files the folder lacks, the images file is cut short), why (None when
        there is none).
    """
    try:
        with open(base + ".json", encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None, None, None
    except (OSError, ValueError) as e:
        return None, None, f"its record cannot be read ({e})"
    names = {os.path.relpath(p, folder.root) for p, _ in folder.samples}
    checksum = record.get("checksum", {}) if isinstance(record, dict) else {}
    if not isinstance(checksum, dict) or checksum.get("record") != _record_checksum(record):
        return None, None, "its record does not match its checksum"
    if record.get("fingerprint") != fingerprint \
            or len(record.get("labels", ())) != len(folder.samples) \
            or not set(record.get("unreadable", {})) <= names:
        return None, None, "its record does not describe this folder"
    try:
        decoded, crc = _open_images(base + suffix, len(record["labels"]), decoder,
                                    record.get("pixels", -1) if decoder.shape is None
                                    else None)
    except (OSError, ValueError) as e:
        return None, None, f"its images cannot be read ({e})"
    if crc != checksum.get("images"):
        return None, None, "its images do not match their checksum"
    decoded.labels = torch.as_tensor(record["labels"], dtype=torch.long)
    return decoded, record, None


def decoded_folder(folder, decoder, cache_dir, num_workers=0, log=say, stop=None,
                   unreadable_reason=None):
    """A data.SafeImageFolder decoded once into ``cache_dir``, memory-mapped after.

    The files ``<cache_dir>/decoded-<split>-<decoder.name>-<folder>-<fingerprint>.npy``
    (or ``.bin``) and ``.json`` (see the module's docstring). Unreadable images are
    replaced by the next readable one and counted, as on the per-sample path; a reused
    cache marks them again in ``folder.unreadable`` and warns about each. A cache
    directory that cannot be written (read-only, full) gets one warning, and the images
    are decoded into memory for this run.

    Args:
        folder: the data.SafeImageFolder.
        decoder: a ``Resized`` or ``presets.ShortSide``.
        cache_dir: where the cache goes.
        num_workers: processes that decode.
        log: prints the cache's place and size.
        stop: called between batches; a signal number it returns stops the build
            (``ops.Interrupted``, nothing left behind). None: never.
        unreadable_reason: ``path -> why`` for the record (``images.load_image``'s error).

    Returns:
        A ``Decoded``.
    """
    split = os.path.basename(os.path.normpath(folder.root))
    place = hashlib.sha256(os.fsencode(os.path.abspath(folder.root))).hexdigest()[:8]
    prefix = os.path.join(cache_dir, f"decoded-{split}-{decoder.name}-{place}-")
    fingerprint = folder_fingerprint(folder, decoder)
    base, suffix = prefix + fingerprint[:16], ".npy" if decoder.shape else ".bin"
    _remove_orphans(cache_dir)
    decoded, record, problem = _open_cache(base, suffix, fingerprint, folder, decoder)
    if problem is not None:
        say(f"warning: the decoded cache {base}{suffix} is damaged ({problem}); rebuilding "
            f"it", file=sys.stderr)
    if decoded is not None:
        _mark_unreadable(folder, record["unreadable"])
        log(f"decoded cache: {base}{suffix} ({_about(decoded)}), reused")
        return decoded
    start = time.perf_counter()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        labels, crc = _write_images(base + suffix, len(folder.samples), decoder,
                                    _decoded_batches(folder, decoder, num_workers, stop))
    except OSError as e:
        if cache_dir not in _UNWRITABLE:  # once, not once per split
            say(f"warning: cannot write the decoded cache in {cache_dir} "
                f"({e.strerror or e}); decoding the images into memory for this run only",
                file=sys.stderr)
        _UNWRITABLE.add(cache_dir)
        return _decode_into_memory(folder, decoder, num_workers, stop)
    decoded, _ = _open_images(base + suffix, len(labels), decoder, verify=False)
    decoded.labels = torch.from_numpy(labels)
    _write_record(folder, decoder, fingerprint, labels, crc, decoded, base, prefix,
                  unreadable_reason)
    log(f"decoded cache: {base}{suffix} ({_about(decoded)}), built in "
        f"{time.perf_counter() - start:.1f} s")
    return decoded


def _about(decoded):
    n = len(decoded)
    if decoded.shapes is None:
        c, h, w = decoded.images.shape[1:]
        return f"{n} images of {c}x{h}x{w}, {mib(decoded.nbytes)}"
    return f"{n} images of many sizes, {mib(decoded.nbytes)}"


def mib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _mark_unreadable(folder, unreadable):
    """Flags, and warns about, the images a reused cache found unreadable."""
    where = {os.path.relpath(p, folder.root): i for i, (p, _) in enumerate(folder.samples)}
    for rel, reason in unreadable.items():
        folder.unreadable[where[rel]] = 1
        say(f"warning: skipping unreadable image {os.path.join(folder.root, rel)} "
            f"({reason}; as found when the decoded cache was built); the next "
            f"readable image of the set stands in for it", file=sys.stderr)


def _decode_into_memory(folder, decoder, num_workers, stop):
    """The images decoded into memory, for a run whose cache cannot be written."""
    images, labels = [], []
    for batch in _decoded_batches(folder, decoder, num_workers, stop):
        for image, label in batch:
            images.append(image)
            labels.append(label)
    labels = torch.as_tensor(labels, dtype=torch.long)
    if decoder.shape is not None:
        return Decoded(torch.stack(images), labels)
    shapes = torch.as_tensor([list(image.shape) for image in images], dtype=torch.long)
    return Decoded(torch.cat([image.reshape(-1) for image in images]), labels, shapes)


def _write_record(folder, decoder, fingerprint, labels, crc, decoded, base, prefix,
                  unreadable_reason):
    """Writes the record that makes a built cache trusted (unless the folder changed
    meanwhile), then removes the caches of the folder's older contents."""
    reason = unreadable_reason or (lambda path: "unreadable while the cache was built")
    unreadable = {os.path.relpath(p, folder.root): reason(p)
                  for (p, _), bad in zip(folder.samples, folder.unreadable.tolist()) if bad}
    if folder_fingerprint(folder, decoder) != fingerprint:
        say(f"warning: {folder.root} changed while it was decoded; its cache will be "
            f"rebuilt by the next run", file=sys.stderr)
        return
    record = {"version": CACHE_VERSION, "fingerprint": fingerprint, "root": folder.root,
              "labels": labels.tolist(), "unreadable": unreadable}
    if decoder.shape is None:
        record["pixels"] = decoded.nbytes
    else:
        record["shape"] = [len(labels), *decoder.shape]
    record["checksum"] = {"images": crc, "record": _record_checksum(record)}
    try:
        files.atomic_write(base + ".json", lambda f: json.dump(record, f))
    except OSError as e:  # the images are whole: use them, the next run rebuilds
        say(f"warning: cannot write {base}.json ({e.strerror or e}); the decoded "
            f"cache will be rebuilt by the next run", file=sys.stderr)
        return
    for old in glob.glob(glob.escape(prefix) + "*"):  # caches of older contents
        if not old.startswith(base + "."):
            with contextlib.suppress(OSError):
                os.remove(old)
