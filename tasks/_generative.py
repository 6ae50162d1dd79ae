"""What the generative tasks share (gan.py, diffusion.py): the sets they train on and
each one's own image side, FID's real images (the first of the validation set, their
features gathered on process 0; test.py's), how many FID measures (``--fid-samples``
and its default, fewer for --preflight's one batch), the sample grid TensorBoard shows,
and the seeded samples test.py writes as PNGs. Not a task (the leading underscore keeps
it out of ``--task``'s registry); a generator's images themselves (``generate``,
``to_uint8``) are gan_metrics.py's, which measures them.
"""

import contextlib
import io
import os
import re
import sys

import torch
import torchvision
from PIL import Image, PngImagePlugin

from machinery import files, runtime
from machinery.runtime import say
from ops import TooFewImages, UserError
from pipeline import data
from reporting import gan_metrics
from reporting.gan_metrics import generate, to_uint8
from tasks._report import TestFlags

GAN_DATASETS = ("mnist", "fashion_mnist", "cifar10", "imagefolder", "synthetic")
NATIVE_SIDE = {name: data.native_geometry(name)[0] for name in GAN_DATASETS
               if data.native_geometry(name)}  # (MNIST's 28, CIFAR-10's 32)
FID_SAMPLES = 10_000  # --fid-samples' default, capped at the validation set's size


def first_images(kept, n):
    """The first ``n`` images of the validation set, for FID: on process 0 (None on the
    others; one process: its own). ``kept`` is this process's, in order, at most ``n`` (its
    shard is contiguous: in rank order the shards are the set's order). Each process
    sends only its share of the first ``n`` (their counts gathered first), and only to
    process 0 (``gather_object``): under NCCL no GPU holds every process's images.

    Raises:
        TooFewImages: the set has fewer than ``n`` images (on every process alike).
    """
    import torch.distributed as dist

    mine = torch.cat(kept) if kept else torch.zeros(0)
    if n == 0:  # (--fid-samples 0: no FID, nothing to gather)
        return mine[:0]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        have, first = len(mine), mine[:n]
    else:
        rank, counts = dist.get_rank(), [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(mine))
        have = sum(counts)
        parts = counts if rank == 0 else None  # (a list to fill on process 0)
        dist.gather_object(mine[:max(0, n - sum(counts[:rank]))], parts, dst=0)
        first = torch.cat([p for p in parts if len(p)] or [mine[:0]])[:n] if rank == 0 \
            else None
    if have < n:
        raise TooFewImages(f"--fid-samples {n}: the validation set has {have} images; lower "
                           f"--fid-samples")
    return first


def real_features(task, kept, batch_size=256):
    """The features (``gan_metrics.extract``'s) of the validation set's first
    ``task.fid_samples`` images, on process 0 (None on the others; one process: its own).
    ``kept`` is this process's share of them (``real_share``); each process extracts its
    own and sends process 0 only their features (``first_images``), not their pixels: no
    process extracts the others' images, none receives pixels (the CUDA review's N-L6).

    Raises:
        TooFewImages: the set has fewer than ``task.fid_samples`` images.
    """
    mine = [gan_metrics.extract(task.features, torch.cat(kept), batch_size)] if kept else []
    return first_images(mine, task.fid_samples)


def real_share(n, val_size):
    """How many of the first ``n`` validation images this process's shard holds (the
    shards of ``data.shard_indices``: contiguous, in rank order): all it keeps for FID,
    so no process holds more than its share (``val_size`` 0, unknown: ``n``)."""
    import torch.distributed as dist

    if not val_size or not (dist.is_available() and dist.is_initialized()):
        return n
    rank, world = dist.get_rank(), dist.get_world_size()
    first, end = rank * val_size // world, (rank + 1) * val_size // world
    return max(0, min(end, n) - first)


def share(n, rank, world):
    """Process ``rank``'s indices of images ``0`` to ``n - 1`` of a validation's generation:
    a contiguous block, the blocks in rank order (``n`` split as evenly as it goes)."""
    return torch.arange(n * rank // world, n * (rank + 1) // world)


def generated_scores(task, make, real, batch_size=256):
    """FID and KID (``gan_metrics.measure``) of the ``task.fid_samples`` images that
    ``make(indices)`` makes for indices 0 on, against the real images' features ``real``
    (``real_features``'s: process 0's; None on the others), each image a function of its
    index alone (the fixed latents; a sampler's noise of (seed, index)).

    One process makes and measures them all, as test.py does. Under DDP the generation is
    split over the processes by index (``share``): each makes its share, extracts its
    features batch by batch (``made_features``) and sends them to process 0, which
    measures. No
    process samples alone while the others wait in a collective (whose timeout a long
    sampling would outlast: the CUDA review's M3), and the figures are one process's up
    to float rounding.

    Returns:
        ``measure``'s dict on process 0 (one process: its own); None on the others.
    """
    import torch.distributed as dist

    n, features = task.fid_samples, task.features
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return gan_metrics.measure(features, real, made_features(
            features, make, torch.arange(n), batch_size), task.seed, batch_size,
            extracted=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    found = made_features(features, make, share(n, rank, world), batch_size)  # (n_r, D)
    parts = [None] * world if rank == 0 else None
    dist.gather_object(found, parts, dst=0)
    if rank != 0:
        return None
    return gan_metrics.measure(features, real, torch.cat(parts), task.seed, batch_size,
                               extracted=True)


def made_features(features, make, indices, batch_size):
    """The features (``gan_metrics.extract``'s: ``(len(indices), D)`` float64 on the CPU)
    of the images ``make`` makes for ``indices``, one batch of ``batch_size`` at a time:
    never more than one batch of images alive, on any device (the CUDA review's L5: 10,000
    images of 256 px were 16 GB on the GPU, twice). The batches are those ``make`` would
    cut from the whole, so the features are the same bits."""
    found = [gan_metrics.extract(features, make(chunk), batch_size)
             for chunk in indices.split(batch_size) if len(chunk)]
    return torch.cat(found) if found else gan_metrics.extract(features, torch.zeros(0))


@contextlib.contextmanager
def fewer_fid_samples(task, count):
    """``Task.evaluating_on`` for a task measuring FID on ``task.fid_samples`` images:
    on at most ``count`` for the while (the same code, fewer images)."""
    kept = task.fid_samples
    task.fid_samples = min(kept, count)
    try:
        yield None if task.fid_samples == kept else \
            f"FID and KID on one batch's {task.fid_samples} images (the run's: {kept})"
    finally:
        task.fid_samples = kept


def fid_samples(config, val_set):
    """The images FID and KID measure at each validation: --fid-samples, or its default
    (``FID_SAMPLES``) capped at the validation set's size with one warning; 0: none.

    Raises:
        UserError: --fid-samples given above the validation set's size (the line names
            both ways out).
    """
    n = config["fid_samples"]
    if n == 0 or val_set is None:
        if n == 0:
            runtime.main_print("--fid-samples 0: no FID or KID at validation (the sample "
                               "grid only); best.pt is the last checkpoint")
        return n
    if n is None:
        n = min(FID_SAMPLES, len(val_set))
        if n < FID_SAMPLES:
            if n < 2:
                raise UserError(f"FID needs at least 2 validation images; the validation set "
                                f"has {len(val_set)}: train without FID (--fid-samples 0)")
            runtime.main_print(f"warning: --fid-samples: the validation set has "
                               f"{len(val_set)} images, fewer than the default "
                               f"{FID_SAMPLES}: FID and KID measure {n}", file=sys.stderr)
        return n
    if n > len(val_set):
        raise UserError(f"--fid-samples {n}: the validation set has {len(val_set)} images; "
                        f"lower --fid-samples (at most {len(val_set)}), or train without FID "
                        f"(--fid-samples 0)")
    return n


class ImageFlags(TestFlags):
    """test.py's flags of the tasks that make images (gan, diffusion, pix2pix): their
    images as PNGs, FID and KID, a sampler's steps; --samples and --out also serve
    detection (its validation images with their boxes drawn)."""

    title = "a checkpoint of a task that makes images (--task {tasks})"
    description = ("its generator (the moving average by default: --weights), from the "
                   "fixed inputs of --seed; --export writes it: its inputs in, images (N, C, "
                   "H, W) in [-1, 1] out. --samples and --out also serve a detector: the "
                   "first validation images with their predictions drawn")
    directories = ("out",)
    seeded = ("samples", "fid_samples")
    words = {"samples": ("is for a GAN checkpoint's generator",
                         "needs --checkpoint (of a task that makes or draws images): --model "
                         "evaluates an exported network's predictions"),
             "fid_samples": ("measures a GAN's FID",
                             "needs --checkpoint (of a task that makes images): --model "
                             "evaluates an exported network's predictions"),
             "sample_steps": ("is for a task that samples in steps", None),
             "sampler": ("is for a task that samples in steps", None)}

    def add(self, group):
        group.description = self.description
        add = group.add_argument
        add("--samples", type=int, default=None, metavar="N", help="write N images as PNGs "
            "into --out (000000.png, ...): the same command writes the same files")
        add("--out", default=None, metavar="DIR", help="where --samples writes (created if "
            "need be)")
        add("--fid-samples", type=int, default=None, metavar="N", help="FID and KID of N "
            "generated images against the first N validation images, on Inception-v3 (its "
            "weights file under TORCH_HOME, never downloaded): the task's own validation, "
            "on the checkpoint")
        add("--fid-features", default=None, metavar="CHECKPOINT", help="with --fid-samples: "
            "on the penultimate features of a classifier this project trained instead "
            "(fid_classifier, kid_classifier: comparable only with the same checkpoint)")
        add("--sample-steps", type=int, default=None, metavar="N", help="a task that "
            "samples in steps: the timesteps a sample walks (default: the training run's)")
        add("--sampler", default=None, help="a task that samples in steps: how (its "
            "--sampler choices; default: the training run's)")

    def check(self, args):
        for flag, value, low in (("--samples", args.samples, 1),
                                 ("--fid-samples", args.fid_samples, 2)):  # two covariances
            if value is not None and value < low:
                raise UserError(f"{flag} must be at least {low}")
        if args.out is not None and not args.out.strip():
            raise UserError("--out needs a directory name")
        if args.fid_features is not None and not args.fid_features.strip():
            raise UserError("--fid-features needs a file name")
        if (args.samples is None) != (args.out is None):
            raise UserError("--samples N needs --out DIR (where the PNGs go)"
                            if args.out is None else
                            "--out DIR is where --samples N writes; give --samples")
        if args.fid_features is not None and args.fid_samples is None:
            raise UserError("--fid-features CHECKPOINT picks the features of FID; give "
                            "--fid-samples N too")


IMAGE_FLAGS = ImageFlags()


def asked_for(request, kind, made):
    """Refuses a generator's test.py run that asks for nothing (``made``: what it makes)."""
    if not (request.samples or request.fid_samples or request.export):
        raise UserError(f"{request.checkpoint!r} is a {kind} checkpoint: there is no accuracy "
                        f"to evaluate; ask for --samples N --out DIR (PNGs), --fid-samples "
                        f"N (FID, KID) or --export FILE (the {made})")


def fid_sets(task_class, config, request):
    """``Report.test_sets`` of a task that makes images: the data only for --fid-samples."""
    if not request.fid_samples:
        return None
    return task_class.datasets(dict(config, augment=False), say)


def checked_fid(request, config, val_set):
    """--fid-samples against the validation set (``val_set``: None without it): the count
    and the features' config for the task's own validation ``Evaluation``."""
    n = request.fid_samples or 0
    if n and len(val_set) < n:
        raise UserError(f"--fid-samples {n}: the validation split of {config['dataset']} "
                        f"has only {len(val_set)} images")
    return n, dict(config, fid_features=request.fid_features, seed=request.seed)


def fid_line(report, what, dataset):
    """The FID/KID line of a report (``what``: the images and their inputs)."""
    s = "" if report.get("fid_features") is None else "_classifier"
    if f"fid{s}" not in report:
        return None
    n = report["fid_samples"]
    return (f"fid{s} {report[f'fid{s}']:.4f}  kid{s} {report[f'kid{s}']:.6f} (std "
            f"{report[f'kid_std{s}']:.6f}): {n} {what} against the first {n} validation "
            f"images of {dataset}")


def write_samples(generator, latents, out_dir, batch_size):
    """The generator's image of each latent as a PNG, ``out_dir/000000.png`` on (grey for
    one channel, RGB for three), each written atomically; returns the file names.

    Raises:
        UserError: a file of those names is there and is not this tool's (``refuse_replacing``),
            before anything is generated or written.
        files.OutputError: a write failed (a full disk); files written before are whole.
    """
    refuse_replacing(out_dir, [f"{i:06d}.png" for i in range(len(latents))])
    names, replaced = [], []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for chunk in latents.split(batch_size):
            pixels = to_uint8(generate(generator, chunk, batch_size)).cpu()
            for image in pixels:  # (C, H, W) uint8
                names.append(os.path.join(out_dir, f"{len(names):06d}.png"))
                if _write_png(image, names[-1]):
                    replaced.append(os.path.basename(names[-1]))
    except OSError as e:
        raise files.output_failed("--out", names[-1] if names else out_dir, e,
                                  names[:-1]) from None
    if replaced:  # a file of that name held another image (a user's, another seed's)
        say(f"warning: {len(replaced)} file(s) in {out_dir} held other images and were "
            f"replaced ({replaced[0]}{' ...' if len(replaced) > 1 else ''})", file=sys.stderr)
    older = sorted(f for f in os.listdir(out_dir)
                   if re.fullmatch(r"\d{6,}\.png", f) and int(f[:-4]) >= len(names))
    if older:  # kept (never deleted), but not of this run: say so
        say(f"warning: {out_dir} also holds {len(older)} numbered PNGs that this run did "
            f"not write ({older[0]} on)", file=sys.stderr)
    return names


def _write_png(image, path):
    """Writes ``image`` as a PNG at ``path``; returns whether a different file was there."""
    png = encode_png(image)
    other = False
    if os.path.isfile(path):
        with open(path, "rb") as f:
            other = f.read() != png
    files.atomic_write(path, lambda f: f.write(png), "wb")
    return other


OWN_PNG = ("Software", "test.py --samples")  # the text chunk that marks test.py's outputs


def encode_png(image):
    """``image``, ``(C, H, W)`` uint8, as the bytes of a PNG (L for one channel, RGB for
    three) carrying ``OWN_PNG``: test.py's --samples (pix2pix's outputs too)."""
    info = PngImagePlugin.PngInfo()
    info.add_text(*OWN_PNG)
    png = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).squeeze(2).numpy()).save(png, "PNG", pnginfo=info)
    return png.getvalue()


def _own_png(path):
    """Whether ``path`` is a PNG that test.py wrote (``encode_png``'s text chunk)."""
    try:
        with Image.open(path, formats=["PNG"]) as image:
            return image.info.get(OWN_PNG[0]) == OWN_PNG[1]
    except Exception:  # not an image, not a PNG, a directory, unreadable: not ours
        return False


def refuse_replacing(out_dir, names):
    """Refuses, before anything is written, to replace a file of ``names`` in ``out_dir``
    that test.py did not write (a user's image or notes): only its own earlier outputs
    are replaced.

    Raises:
        UserError: naming those files.
    """
    foreign = [name for name in names if os.path.lexists(os.path.join(out_dir, name))
               and not _own_png(os.path.join(out_dir, name))]
    if foreign:
        shown = ", ".join(files.printable(name) for name in foreign[:5])
        raise UserError(f"--out {files.printable(out_dir)}: --samples would replace "
                        f"{len(foreign)} file(s) there that test.py did not write ({shown}"
                        f"{' ...' if len(foreign) > 5 else ''}): move them, or name another "
                        f"--out")


def sample_grid(generator, latents, nrow=None):
    """A grid of the generator's samples for the fixed latents, as TensorBoard takes it
    (``runlog.image``).

    Args:
        generator: G (sampled in eval mode; its mode is put back).
        latents: ``(n, latent_dim)``.
        nrow: images per row (default: about the square root of n).

    Returns:
        An ``(H, W, 3)`` uint8 numpy array: the samples, [-1, 1] mapped to [0, 255],
        2 px apart (grayscale repeated to three channels).
    """
    images = generate(generator, latents).cpu()  # (n, C, h, w)
    n = len(images)
    nrow = nrow or max(1, round(n ** 0.5))
    grid = torchvision.utils.make_grid(to_uint8(images), nrow=nrow, padding=2)  # (3, H, W)
    return grid.permute(1, 2, 0).contiguous().numpy()
