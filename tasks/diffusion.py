"""A diffusion model: ddpm.py's U-Net trained to predict the noise of DDPM's forward
process; at each validation the noise-prediction loss at seeded timesteps, a fixed-seed
sample grid, and FID and KID of sampled images (gan_metrics.py), the lowest FID picking
best.pt; what test.py gives for its checkpoints (PNGs of seeded samples, FID and KID,
the denoiser for export).
"""

import argparse
import copy
import os

import torch

import ddpm
from machinery import engine
from machinery.runtime import say
from ops import UserError
from pipeline import data
from reporting import gan_metrics
from tasks import Evaluation, Task, check_own_network_and_data, refuse
from tasks._generative import (
    GAN_DATASETS,
    IMAGE_FLAGS,
    NATIVE_SIDE,
    asked_for,
    checked_fid,
    fewer_fid_samples,
    fid_line,
    fid_samples,
    fid_sets,
    generated_scores,
    real_features,
    real_share,
    sample_grid,
    write_samples,
)

# Ho et al.'s recipe: Adam 2e-4, no weight decay, a constant rate after the warmup, the
# gradient clipped at norm 1; no crop (a padded crop would teach the model black borders)
DIFFUSION_RECIPE = {"optimizer": "adam", "lr": 2e-4, "betas": [0.9, 0.999],
                    "weight_decay": 0.0, "scheduler": "none", "warmup_epochs": 0.0,
                    "augment": False, "grad_clip": 1.0, "label_smoothing": 0.0}
DIFFUSION_CONFIG = ("image_size", "in_channels", "diffusion_steps", "noise_schedule",
                    "diffusion_width", "diffusion_blocks", "sampler", "sample_steps")
EXPORT_NAMES = ("images", "timesteps", "noise")  # the denoiser's inputs and output (ONNX)
_VAL = 7_777_777  # the validation draws' own stream (training's keys hold the epoch)


def _int_in(low, high):
    return lambda v: type(v) is int and low <= v <= high  # not bool, not float


def _check(config):
    """What --task diffusion takes, and the flags that make no sense for it: one line
    each."""
    check_own_network_and_data(config, "diffusion", "ddpm", "ddpm.py", GAN_DATASETS)
    side = config["image_size"]
    try:
        ddpm.check_image_size(side)
    except ValueError as e:
        raise UserError(f"--task diffusion: --image-size: {e}") from None
    refused = [(config["mixup_alpha"] or config["cutmix_alpha"], "--mixup-alpha/--cutmix-alpha",
                "mix images and labels; a diffusion model has no labels"),
               (config["label_smoothing"], "--label-smoothing",
                "smooths a classifier's targets; the target here is the noise"),
               (config["augment"], "--augment",
                "pads and crops, and the model would learn the borders (--diffusion-flip "
                "mirrors the images)"),
               (config["tta"] != "none", "--tta", "averages a classifier's predictions"),
               (config["freeze"], "--freeze", "is not for a diffusion model's one U-Net"),
               (config["pretrained"], "--pretrained", "loads a classifier's weights"),
               (config["grad_checkpointing"], "--grad-checkpointing",
                "has no implementation in ddpm.py"),
               (config["find_lr"], "--find-lr", "sweeps a classifier's learning rate"),
               (config["gpus"] and "," in str(config["gpus"]), "--gpus with several GPUs",
                "(DataParallel) is not for a diffusion model: use torchrun")]
    refuse("diffusion", refused)
    if config["sample_steps"] is not None and config["sample_steps"] > \
            config["diffusion_steps"]:
        raise UserError(f"--sample-steps {config['sample_steps']}: there are "
                        f"{config['diffusion_steps']} timesteps (--diffusion-steps)")
    if config["fid_samples"] == 0 and config["early_stop_patience"]:
        raise UserError("--early-stop-patience follows FID, and --fid-samples 0 measures "
                        "none: give --fid-samples, or drop --early-stop-patience")


class Diffusion(Task):
    """A DDPM (ddpm.py's U-Net, one network): per step each image gets a
    timestep and noise, the U-Net predicts the noise of the noised image, the loss is
    their mean squared error; the validations measure that loss at seeded timesteps, and
    on the moving average (the U-Net itself without --ema-decay) sample a grid from fixed
    seeds and FID and KID of ``--fid-samples`` images (``--sampler``, ``--sample-steps``).

    The draws (timesteps, noise, mirror flags) come from the step's ``tasks.Where``:
    every micro-batch of every process draws the whole step's on its device from
    ``where.generator`` and takes its own slice (``where.mine``), so accumulation and any
    number of processes draw exactly what one large batch draws, and a resumed run what
    the whole run drew. Images are brought to [-1, 1] (``gan_metrics.to_generator_range``).

    Args:
        config: the run's.
        train_set: the training set (its normalisation, its channels).
        val_set: the validation set (its size: this process's shard's first position).
        fid_samples: images FID measures (``_generative.fid_samples``; 0: none).
    """

    name = "diffusion"
    lower_is_better = True  # best.pt: the lowest FID
    grid = 64  # images of fixed seeds shown as a grid at each validation

    default_network = "ddpm"
    own_networks = ("ddpm",)  # --network ddpm: for --task diffusion alone
    own_networks_are = "a diffusion model's U-Net"
    stored_needs = (  # what test.py reads to rebuild the U-Net and its sampler
        ("image_size", lambda v: type(v) is int and v % 4 == 0 and 8 <= v <= 256,
         "a multiple of 4 from 8 to 256", False),
        ("in_channels", lambda v: type(v) is int and v in (1, 3), "1 or 3", False),
        ("diffusion_steps", _int_in(2, 100_000), "an integer in [2, 100000]", False),
        ("noise_schedule", lambda v: v in ddpm.SCHEDULES,
         f"one of {', '.join(ddpm.SCHEDULES)}", False),
        ("diffusion_width", _int_in(1, 4096), "an integer in [1, 4096]", True),
        ("diffusion_blocks", _int_in(1, 8), "an integer in [1, 8]", True),
    )
    own_flags = ("diffusion_steps", "noise_schedule", "sampler", "sample_steps",
                 "diffusion_width", "diffusion_blocks", "diffusion_flip", "fid_samples",
                 "fid_features")  # the last two: the GAN group's flags, read here too
    flags_title = "diffusion (--task diffusion)"
    datasets_named = GAN_DATASETS
    ranges = {"diffusion_steps": ((lambda v: 2 <= v <= 100_000), "must be in [2, 100000]"),
              "sample_steps": ((lambda v: v is None or 1 <= v <= 100_000),
                               "must be in [1, 100000]"),
              "diffusion_width": ((lambda v: 1 <= v <= 4096), "must be in [1, 4096]"),
              "diffusion_blocks": ((lambda v: 1 <= v <= 8), "must be in [1, 8]")}
    # FID with other features, another sampler or other steps is not comparable
    best_depends_on = ("fid_features", "sampler", "sample_steps")

    @staticmethod
    def flags(g):
        """The schedule, the U-Net and the sampler (ddpm.py); --fid-samples and
        --fid-features are the GAN group's."""
        g.add_argument("--diffusion-steps", type=int, default=1000,
                       help="T, the timesteps of the forward (noising) process")
        g.add_argument("--noise-schedule", default="linear", choices=list(ddpm.SCHEDULES),
                       help="the betas: linear (Ho et al.'s 1e-4 to 0.02, scaled by 1000 / "
                       "T) or cosine (Nichol & Dhariwal)")
        g.add_argument("--sampler", default="ddim", choices=list(ddpm.SAMPLERS),
                       help="how validation (and test.py) samples: ddim (deterministic "
                       "from the starting noise) or ddpm (ancestral)")
        g.add_argument("--sample-steps", type=int, default=None,
                       help=f"timesteps a sample walks (evenly spaced; default: "
                       f"{ddpm.DDIM_STEPS} for ddim, all of --diffusion-steps for ddpm)")
        g.add_argument("--diffusion-width", type=int, default=64,
                       help="channels of the U-Net at full resolution (x1, x2, x2 below)")
        g.add_argument("--diffusion-blocks", type=int, default=2,
                       help="residual blocks per resolution of the U-Net")
        g.add_argument("--diffusion-flip", action=argparse.BooleanOptionalAction,
                       default=True, help="mirror half the training images (drawn with "
                       "the noise), where the set allows it (not digits)")

    @classmethod
    def defaults(cls, config, explicit):
        """The ddpm network, Ho et al.'s recipe (``DIFFUSION_RECIPE``) and the dataset's
        own image side, where the user set none."""
        if "network" not in explicit:
            config["network"] = "ddpm"
        config.update({k: v for k, v in DIFFUSION_RECIPE.items() if k not in explicit})
        if "image_size" not in explicit and config["dataset"] in NATIVE_SIDE:
            config["image_size"] = NATIVE_SIDE[config["dataset"]]

    @classmethod
    def check_config(cls, config):
        _check(config)

    @classmethod
    def build_networks(cls, config, dataset):
        """ddpm.py's U-Net."""
        try:
            return ddpm.build(config, dataset.in_channels if dataset is not None
                              else config["in_channels"])
        except ValueError as e:
            raise UserError(str(e)) from None

    @classmethod
    def recorded(cls, config, dataset):
        """The flags and the images' channels: test.py and export rebuild the U-Net from
        the config alone."""
        return {**config, "in_channels": dataset.in_channels}

    @classmethod
    def build(cls, config, train_set, val_set=None):
        """The task, measuring FID on ``_generative.fid_samples(config, val_set)`` images."""
        return cls(config, train_set, val_set, fid_samples(config, val_set))

    def __init__(self, config, train_set, val_set=None, fid_samples=0):
        self.seed, self.steps = config["seed"], config["diffusion_steps"]
        self.schedule = ddpm.Schedule(config["noise_schedule"], self.steps)
        self.sampler, self.sample_steps = config["sampler"], config["sample_steps"]
        self.flip = config["diffusion_flip"] and data.mirror_keeps_class(config["dataset"])
        self.shape = (train_set.in_channels, config["image_size"], config["image_size"])
        self.on_average = bool(config["ema_decay"])  # samples of the moving average
        self.batch_size = config["batch_size"]
        self.val_size = len(val_set) if val_set is not None else 0
        self.fid_samples = fid_samples or 0
        self.features, self.figures, self.best = None, ("loss",), None
        if self.fid_samples:  # else the loss and the sample grid: best.pt the last
            self.features = gan_metrics.build_features(config["fid_features"])  # fails early
            suffix = "" if self.features.name == "inception" else f"_{self.features.name}"
            self.figures, self.best = ("loss", f"fid{suffix}", f"kid{suffix}"), f"fid{suffix}"
        self.transform = train_set.transform  # its normalisation, undone
        self._val_at = 0  # the next validation image's position in the set

    # ------------------------------------------------------------------- a step

    def to_device(self, batch, device, memory_format):
        """The images on ``device`` in [-1, 1], and the labels (unused)."""
        x, y = Task.to_device(batch, device, memory_format)
        return gan_metrics.to_generator_range(x, self.transform), y

    def draws(self, where, device):
        """This micro-batch's timesteps, noise and mirror flags: its rows
        (``where.mine``) of the step's draws, made on ``device`` from
        ``where.generator`` (``ddpm.training_draws``)."""
        t, noise, flips = ddpm.training_draws(where.generator(device), where.step_samples,
                                              self.shape, self.steps, device)
        return t[where.mine], noise[where.mine], flips[where.mine]

    def loss(self, model, x, y, where):
        """The noise-prediction loss of one micro-batch (``ddpm.loss``) through the
        (wrapped) U-Net, the images mirrored where their flags say."""
        t, noise, flips = self.draws(where, x.device)
        if self.flip:
            x = torch.where(flips[:, None, None, None], x.flip(-1), x)
        return ddpm.loss(model, self.schedule, x, t, noise)[0]

    evaluating_on = fewer_fid_samples  # --preflight's one batch: FID on fewer images

    @staticmethod
    def counted(net):
        """What a step's FLOPs are counted on: the U-Net's forward and backward."""
        return ddpm.StepFlops(net)

    def summarised(self, net, dataset):
        return [("denoiser", ddpm.StepFlops(net), self.example(dataset))]

    # -------------------------------------------------------------- validation

    def val_draws(self, first, n, device):
        """Timesteps and noise of validation images ``first`` to ``first + n - 1``: each
        image's from (seed, its position in the set) (in chunks of ``ddpm.CHUNK``: the
        same whatever the batches and the processes)."""
        c0, c1 = first // ddpm.CHUNK, (first + n - 1) // ddpm.CHUNK
        ts, noises = [], []
        for c in range(c0, c1 + 1):
            g = torch.Generator().manual_seed(engine.key(self.seed, _VAL, c))
            t, noise, _ = ddpm.training_draws(g, ddpm.CHUNK, self.shape, self.steps, "cpu")
            ts.append(t)
            noises.append(noise)
        skip = first - c0 * ddpm.CHUNK
        return (torch.cat(ts)[skip:skip + n].to(device),
                torch.cat(noises)[skip:skip + n].to(device))

    def predict(self, model, x, tta=False):
        """Each validation image's noise-prediction loss at its seeded timestep (``(N,)``,
        under the run's autocast)."""
        unet = engine.bare(model)
        t, noise = self.val_draws(self._val_at, len(x), x.device)
        self._val_at += len(x)
        return ddpm.loss(unet, self.schedule, x, t, noise)[1]

    def evaluation(self, device, model=None):
        """The loss of ``model`` (the run's U-Net, or its moving average, whose parameters
        need no gradients); samples, the grid and FID on the moving average when there is
        one."""
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if several else (0, 1)
        self._val_at = rank * self.val_size // world  # its shard's first (data.shard_indices)
        unet = engine.bare(model)
        averaged = not any(p.requires_grad for p in unet.parameters())  # recipes.EMA's
        return DiffusionEvaluation(self, unet, sampling=averaged or not self.on_average)

    def sampler_of(self, unet, kind=None, steps=None, seed=None):
        """``ddpm.Sampler`` of ``unet`` with the run's sampler, steps and seed (or those
        given)."""
        return ddpm.Sampler(unet, self.schedule, kind or self.sampler,
                            steps or self.sample_steps, self.seed if seed is None else seed)

    @staticmethod
    def extra_figures(result, names, suffix=""):
        """KID's standard deviation over its subsets (``val_kid_std<...>``)."""
        return {f"val_{k}{suffix}": v for k, v in result.items() if k.startswith("kid_std")}

    @staticmethod
    def images(result, names, title):
        """The fixed seeds' samples, as a grid (on the evaluation that sampled)."""
        return [("samples", result["grid"])] if "grid" in result else []

    # ---------------------------------------------------------------------- test.py

    exported_is = "denoiser (it makes images)"
    test_flags = IMAGE_FLAGS
    test_reads = ("samples", "out", "fid_samples", "fid_features", "sample_steps", "sampler")

    @classmethod
    def test_sets(cls, config, request):
        return fid_sets(cls, config, request)

    @classmethod
    def tested(cls, config, val_set, request):
        """The diffusion model for test.py: its own validation samples (FID and KID of
        --fid-samples images) with --sampler and --sample-steps, the noise of --seed."""
        asked_for(request, "diffusion", "denoiser")
        path, steps = request.checkpoint, request.sample_steps
        if steps is not None and not 1 <= steps:
            raise UserError("--sample-steps must be at least 1")
        if request.sampler is not None and request.sampler not in ddpm.SAMPLERS:
            raise UserError(f"--sampler must be one of {', '.join(ddpm.SAMPLERS)} (got "
                            f"{request.sampler!r})")
        steps = steps or config["sample_steps"]
        if steps is not None and steps > config["diffusion_steps"]:
            raise UserError(f"--sample-steps {steps}: {path!r} has "
                            f"{config['diffusion_steps']} timesteps")
        n, config = checked_fid(request, config, val_set)
        config.update(sampler=request.sampler or config["sampler"], sample_steps=steps,
                      batch_size=request.batch_size, ema_decay=0)  # samples what it is given
        task = cls(config, val_set or _Shape(config), val_set, n)
        task.request, task.dataset = request, config["dataset"]
        return task

    def report(self, result, key, path):
        """The sampler, and the figures asked for: FID and KID of --fid-samples images."""
        scores = {k: v for k, v in result.items() if k.startswith(("fid", "kid"))}
        extra = dict(fid_samples=self.fid_samples, fid_features=self.request.fid_features,
                     **scores) if scores else {}
        steps = self.sample_steps or (ddpm.DDIM_STEPS if self.sampler == "ddim"
                                      else self.steps)
        return {key: path, "task": self.name, "seed": self.seed, "sampler": self.sampler,
                "sample_steps": steps, **extra}

    def format_report(self, report, title):
        line = fid_line(report, f"sampled images (seed {self.seed})", self.dataset)
        return "\n".join([f"{title}; {report['sampler']} sampling in "
                          f"{report['sample_steps']} steps"] + ([line] if line else []))

    def outputs(self, net, result, val_set, report):
        """--samples: the images of indices 0 on, from the noise of --seed, as PNGs."""
        request = self.request
        if not request.samples:
            return
        sampler = self.sampler_of(copy.deepcopy(net).to(request.device))
        names = write_samples(sampler, torch.arange(request.samples), request.out,
                              request.batch_size)
        report["samples"] = {"count": len(names), "dir": request.out}
        say(f"wrote {len(names)} samples to {request.out} ({os.path.basename(names[0])} to "
            f"{os.path.basename(names[-1])}; noise of seed {self.seed})")

    @staticmethod
    def exported(net, config, val_set):
        """The CPU U-Net: images and timesteps in, noise out."""
        side, channels = config["image_size"], config["in_channels"]
        return net, [(channels, side, side), ()], described(config), EXPORT_NAMES


class DiffusionEvaluation(Evaluation):
    """One evaluation of a diffusion model: the mean noise-prediction loss over the
    validation images (summed over the processes); where it samples, the first
    ``fid_samples`` real images too, then (in ``compute``) the grid of the fixed seeds
    and FID and KID of as many sampled images. Under DDP each process samples its share
    of the images by index and sends their features to process 0, with those of its share
    of the real images (``_generative.real_features``), which measures and
    samples the grid; the others take its figures (as the GAN task's ``GANEvaluation``).

    Args:
        task: the ``Diffusion``.
        unet: the U-Net evaluated (bare).
        sampling: whether this evaluation samples (the moving average's, or the U-Net's
            without one).
    """

    def __init__(self, task, unet, sampling):
        super().__init__(gather_objects=True)
        self.task, self.sampling, self.real, self.have = task, sampling, [], 0
        self.add_state("total", torch.zeros(2, dtype=torch.float64), "sum")  # sum, count
        self.measured = (unet,)  # (a tuple: not a submodule of the metric)

    def update(self, losses, y, x=None):
        self.total += torch.stack([losses.double().sum().cpu(),
                                   torch.tensor(float(len(losses)), dtype=torch.float64)])
        want = real_share(self.task.fid_samples, self.task.val_size) - self.have \
            if self.sampling else 0
        if want > 0:
            self.real.append(x[:want].float().cpu())
            self.have += len(self.real[-1])

    def compute(self):
        """``loss`` and ``count``; where it samples, ``grid`` (an (H, W, 3) uint8 array)
        and ``fid``/``kid``/``kid_std`` (``_classifier`` with --fid-features)."""
        import torch.distributed as dist

        task, (unet,) = self.task, self.measured
        total, count = self.total.tolist()
        result = {"loss": total / count if count else float("nan"), "count": int(count)}
        if not self.sampling:
            return result
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        sampled, scores, sampler = None, None, task.sampler_of(unet)
        if task.fid_samples:  # every process samples its share (one process: all)
            task.features.to(next(unet.parameters()).device)
            real = real_features(task, self.real, task.batch_size)  # (process 0's)
            scores = generated_scores(
                task, lambda indices: gan_metrics.generate(sampler, indices, task.batch_size),
                real, task.batch_size)
        if not several or dist.get_rank() == 0:
            sampled = dict(scores or {})
            sampled["grid"] = sample_grid(sampler, torch.arange(task.grid))
        if several:
            shared = [sampled]
            dist.broadcast_object_list(shared, src=0)
            sampled = shared[0]
        return {**result, **sampled}


# ------------------------------------------------------------- test.py's denoiser

class _Shape:
    """A dataset's shape without its images (test.py's --samples alone reads no data)."""

    def __init__(self, config):
        self.in_channels, self.transform = config["in_channels"], None


def described(config):
    """What an exported denoiser states besides the run's identity
    (``export.generator_metadata``'s ``described``): the config keys that rebuild it, its
    input and its output."""
    images, timesteps, noise = EXPORT_NAMES
    side, channels = config["image_size"], config["in_channels"]
    return (DIFFUSION_CONFIG,
            f"{images}: float32 (batch, {channels}, {side}, {side}), the noised images x_t "
            f"in the [-1, 1] scale; {timesteps}: float32 (batch,), t in "
            f"[0, {config['diffusion_steps']}) ({config['noise_schedule']} schedule)",
            f"{noise}: float32 (batch, {channels}, {side}, {side}), the predicted noise "
            f"(ddpm.Sampler walks it to images)")


TASK = Diffusion
