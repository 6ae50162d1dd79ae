"""A GAN: dcgan.py's generator and discriminator trained in two phases, FID and KID of the
generator's images at each validation (gan_metrics.py), the lowest FID picking best.pt;
what test.py gives for its checkpoints (PNGs of seeded latents, FID and KID, the
generator for export).
"""

import argparse
import copy
import os

import torch

import dcgan
import ops
from machinery import engine, hardware
from machinery.runtime import say
from ops import UserError
from reporting import gan_metrics
from tasks import Evaluation, Phase, Task, check_own_network_and_data, refuse
from tasks._generative import (
    FID_SAMPLES,
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


def _int_at_least(low):
    return lambda v: type(v) is int and v >= low  # not bool, not float (NaN included)


# The DCGAN paper's recipe (a classifier's SGD at 0.1 with a cosine would diverge)
GAN_RECIPE = {"optimizer": "adam", "lr": 2e-4, "betas": [0.5, 0.999], "weight_decay": 0.0,
              "scheduler": "none", "warmup_epochs": 0.0, "augment": False}


def gan_defaults(config, explicit):
    """--task gan's own defaults where the user set none: the DCGAN network, the paper's
    recipe (``GAN_RECIPE``: Adam 2e-4 with betas (0.5, 0.999), no weight decay, a constant
    rate), no augmentation (a padded crop would teach the generator black borders), and
    the dataset's own image side (MNIST's 28, CIFAR-10's 32)."""
    if "network" not in explicit:
        config["network"] = "dcgan"
    config.update({k: v for k, v in GAN_RECIPE.items() if k not in explicit})
    if "image_size" not in explicit and config["dataset"] in NATIVE_SIDE:
        config["image_size"] = NATIVE_SIDE[config["dataset"]]


def _check_gan(config):
    """What --task gan takes, and the flags that make no sense for it: one line each."""
    check_own_network_and_data(config, "gan", "dcgan", "dcgan.py", GAN_DATASETS)
    side = config["image_size"]
    if side not in dcgan.IMAGE_SIZES:
        raise UserError(f"--task gan: --image-size must be one of "
                        f"{', '.join(map(str, dcgan.IMAGE_SIZES))} (got {side})")
    refused = [(config["mixup_alpha"] or config["cutmix_alpha"], "--mixup-alpha/--cutmix-alpha",
                "mix images and labels; a GAN has no labels"),
               (config["tta"] != "none", "--tta", "averages a classifier's predictions"),
               (config["freeze"], "--freeze", "is not for a GAN's two networks"),
               (config["pretrained"], "--pretrained", "loads one network's weights"),
               (config["grad_checkpointing"], "--grad-checkpointing",
                "has no DCGAN implementation"),
               (config["find_lr"], "--find-lr", "sweeps one optimizer's learning rate"),
               (config["gpus"] and "," in str(config["gpus"]), "--gpus with several GPUs",
                "(DataParallel) is not for a GAN: use torchrun")]
    refuse("gan", refused)
    if config["fid_samples"] == 0 and config["early_stop_patience"]:
        raise UserError("--early-stop-patience follows FID, and --fid-samples 0 measures "
                        "none: give --fid-samples, or drop --early-stop-patience")
    if config["compile"] and config["gan_loss"] == "wgan-gp":  # the CUDA review's H1
        raise UserError("--compile with --gan-loss wgan-gp: the gradient penalty "
                        "differentiates the critic twice, which torch.compile's autograd "
                        "does not support; drop --compile, or take another --gan-loss")


class GAN(Task):
    """A GAN (dcgan.py's generator and discriminator): per step the discriminator's phase
    (``--d-steps`` times, each with new latents on the same real batch), then the
    generator's on the images the discriminator last judged; FID and KID of the
    generator's images from fixed latents at each validation (gan_metrics.py), the lowest
    FID picking best.pt.

    Latents are drawn from (seed, epoch, the step's first sample, phase, repeat) for all
    of a step's samples at once, and each micro-batch of each process takes its own
    slice (``engine.Where``): accumulation and any number of processes draw what one
    large batch draws. Real images are brought to [-1, 1] (the generator's tanh range):
    the dataset's normalisation is undone (the synthetic set, about N(0, 1), is taken as
    it is). Labels are ignored.

    Args:
        config: the run's (``gan_loss``, ``gp_weight``, ``latent_dim``, ``seed``,
            ``fid_samples``, ``fid_features``, ``d_steps``, ``dataset``).
        train_set: the training set (its normalisation).
    """

    name = "gan"
    lower_is_better = True  # best.pt: the lowest FID
    averaged_name = "generator"  # --ema-decay averages the generator
    network_lr = {"discriminator": "lr_d"}  # --lr-d (None: --lr)
    shown_figures = ("loss_d", "loss_g")  # the epoch line's two losses
    grid = 64  # fixed latents shown as a grid in TensorBoard at each validation

    default_network = "dcgan"
    own_networks = ("dcgan",)  # --network dcgan: for --task gan alone
    own_networks_are = "a GAN's pair of networks"
    stored_needs = (  # what test.py reads to rebuild the generator (dcgan.build)
        ("latent_dim", _int_at_least(1), "an integer of at least 1", False),
        ("image_size", lambda v: type(v) is int and v in dcgan.IMAGE_SIZES,
         f"one of {', '.join(map(str, dcgan.IMAGE_SIZES))}", False),
        ("in_channels", lambda v: type(v) is int and v in (1, 3), "1 or 3", False),
        ("gan_loss", lambda v: v in dcgan.GAN_LOSSES,
         f"one of {', '.join(dcgan.GAN_LOSSES)}", True),
        ("gan_width", _int_at_least(1), "an integer of at least 1", True),
    )
    own_flags = ("gan_loss", "gp_weight", "gan_spectral_norm", "gan_attention", "gan_width",
                 "gan_batch_norm", "latent_dim", "d_steps", "lr_d", "fid_samples",
                 "fid_features")  # config.py's GAN group
    flags_title = "GANs (--task gan)"
    datasets_named = GAN_DATASETS
    ranges = {"gp_weight": ((lambda v: v >= 0), "must be at least 0"),
              "gan_width": ((lambda v: 1 <= v <= 4096), "must be in [1, 4096]"),
              "latent_dim": ((lambda v: 1 <= v <= 100_000), "must be in [1, 100000]"),
              "d_steps": ((lambda v: 1 <= v <= 100), "must be in [1, 100]"),
              "lr_d": ((lambda v: v is None or v >= 0), "must not be negative"),
              "fid_samples": ((lambda v: v is None or v == 0 or v >= 2),
                              "must be 0 (no FID) or at least 2")}
    best_depends_on = ("fid_features",)  # another classifier's FID is not comparable

    @staticmethod
    def flags(g):
        """A GAN's networks, losses, phases and figures (dcgan.py)."""
        g.add_argument("--gan-loss", default="vanilla", choices=["vanilla", "lsgan", "hinge",
                                                                "wgan-gp"],
                       help="losses.GANLoss: vanilla (BCE, the generator's non-saturating "
                       "-log D(G(z))), lsgan, hinge, or wgan-gp (Wasserstein with the gradient "
                       "penalty; a critic without BatchNorm)")
        g.add_argument("--gp-weight", type=float, default=10.0,
                       help="the gradient penalty's weight (--gan-loss wgan-gp)")
        g.add_argument("--gan-spectral-norm", action="store_true",
                       help="spectral normalisation of every discriminator layer (no BatchNorm)")
        g.add_argument("--gan-attention", action="store_true",
                       help="a SAGAN self-attention block in each network (layers.SelfAttention)")
        g.add_argument("--gan-width", type=int, default=64,
                       help="channels of the generator's last and the discriminator's first "
                       "hidden map (the DCGAN paper's ngf = ndf)")
        g.add_argument("--gan-batch-norm", action=argparse.BooleanOptionalAction, default=True,
                       help="BatchNorm in the hidden layers of both networks (the paper's); "
                       "without it a micro-batch's images are independent, so accumulation "
                       "and any number of processes give the large batch's steps")
        g.add_argument("--latent-dim", type=int, default=100, help="length of the latent z")
        g.add_argument("--d-steps", type=int, default=1,
                       help="discriminator steps per generator step (each on the same real "
                       "batch with new latents); one global step per batch")
        g.add_argument("--lr-d", type=float, default=None,
                       help="the discriminator's peak learning rate (default: --lr)")
        g.add_argument("--fid-samples", type=int, default=None,
                       help="generated images (from fixed seeded latents) and as many real "
                       "validation images for FID and KID at each validation; at most the "
                       "validation set's size (the default is capped there, with a "
                       "warning); 0: no FID (best.pt is then the last checkpoint) (default: "
                       f"{FID_SAMPLES})")
        g.add_argument("--fid-features", default=None, metavar="CHECKPOINT",
                       help="FID and KID on the penultimate features of this project's "
                       "classifier checkpoint (keys *_classifier) instead of Inception-v3 "
                       "(whose weights must be under TORCH_HOME)")

    @classmethod
    def defaults(cls, config, explicit):
        gan_defaults(config, explicit)

    @classmethod
    def check_config(cls, config):
        _check_gan(config)

    @classmethod
    def build_networks(cls, config, dataset):
        """dcgan.py's generator and discriminator, as an ``nn.ModuleDict``."""
        channels = dataset.in_channels if dataset is not None else config["in_channels"]
        try:
            return dcgan.networks(config, channels)
        except ValueError as e:
            raise UserError(str(e)) from None

    @classmethod
    def recorded(cls, config, dataset):
        """The flags and the images' channels: test.py and export rebuild the generator
        from the config alone."""
        return {**config, "in_channels": dataset.in_channels}

    @classmethod
    def build(cls, config, train_set, val_set=None):
        """The GAN, measuring FID on ``fid_samples(config, val_set)`` images."""
        return cls(config, train_set, fid_samples(config, val_set),
                   len(val_set) if val_set is not None else 0)

    def __init__(self, config, train_set, fid_samples=None, val_size=0):
        self.val_size = val_size  # (each process keeps its share of the first FID images)
        self.kind, self.gp_weight = config["gan_loss"], config["gp_weight"]
        self.latent_dim, self.seed = config["latent_dim"], config["seed"]
        self.fid_samples = FID_SAMPLES if fid_samples is None else fid_samples
        self.phases = (Phase("discriminator", config["d_steps"]), Phase("generator"))
        self.features = None
        if self.fid_samples:  # else no figure: the sample grid alone, best.pt the last
            self.features = gan_metrics.build_features(config["fid_features"])  # fails early
            suffix = "" if self.features.name == "inception" else f"_{self.features.name}"
            self.figures, self.best = (f"fid{suffix}", f"kid{suffix}"), f"fid{suffix}"
        else:
            self.figures, self.best = (), None
        self.transform = train_set.transform  # its normalisation, undone for the real images

    def to_device(self, batch, device, memory_format):
        """The real images on ``device`` in [-1, 1] (``gan_metrics.to_generator_range``,
        as test.py takes them), and the labels (unused)."""
        x, y = Task.to_device(batch, device, memory_format)
        return gan_metrics.to_generator_range(x, self.transform), y

    def latents(self, network, where, device):
        """This micro-batch's latents for ``network``'s phase: the slice ``where`` names
        of the step's draw, made on the CPU from (seed, epoch, step, phase, repeat)."""
        phase = 0 if network == "discriminator" else 1
        key = (((self.seed * 1_000_003 + where.epoch) * 1_000_003 + where.first) * 7 + phase) \
            * 101 + where.repeat
        g = torch.Generator().manual_seed(key % (2**63 - 1))
        z = torch.randn(where.step_samples, self.latent_dim, generator=g)
        return ops.from_host(z[where.offset:where.offset + where.count], device)

    def phase_loss(self, network, model, plain, x, y, where, kept):
        """The loss of ``network``'s phase for one micro-batch and its figures (detached).

        The discriminator's: ``dcgan.discriminator_loss`` on the real images and the
        generator's images of new latents (detached: nothing reaches the generator). The
        generator's: ``dcgan.generator_loss`` through the bare discriminator (its
        parameters do not require gradients in this phase) on the images the
        discriminator's last repeat judged, as the PyTorch example's loop does: made with
        their graph and kept when the micro-batch is its step's only one (``where.alone``),
        else (accumulation: every micro-batch's graph would be held) made again from the
        kept latents, the same images. ``model`` holds the wrapped networks (DDP),
        ``plain`` the bare ones, ``kept`` this micro-batch's scratch for the step.
        """
        if network == "generator":
            fake = kept.pop("fake", None)
            if fake is None:
                fake = model["generator"](kept.pop("z"))
            return dcgan.generator_loss(plain["discriminator"], fake, self.kind)
        z = self.latents(network, where, x.device)
        last = where.repeat == self.phases[0].repeats - 1
        if last and where.alone:  # the generator's phase back-propagates through these
            fake = kept["fake"] = model["generator"](z)
        else:
            with torch.no_grad():
                fake = plain["generator"](z)
            if last:
                kept["z"] = z
        return dcgan.discriminator_loss(model["discriminator"], x, fake, self.kind,
                                        self.gp_weight)

    evaluating_on = fewer_fid_samples  # --preflight's one batch: FID on fewer images

    @staticmethod
    def averaged(net):
        """The network --ema-decay averages: the generator."""
        return net["generator"]

    def counted(self, net):
        """What a step's FLOPs are counted on (``ops.train_flops_per_sample``)."""
        return dcgan.StepFlops(net["generator"], net["discriminator"], self.phases[0].repeats)

    @staticmethod
    def predict(model, x, tta=False):
        """Evaluation reads the real images; the generator is asked in ``result``."""
        return x

    def evaluation(self, device, model=None):
        return GANEvaluation(self, model)

    @staticmethod
    def extra_figures(result, names, suffix=""):
        """KID's standard deviation over its subsets (``val_kid_std<...>``)."""
        return {f"val_{k}{suffix}": v for k, v in result.items() if k.startswith("kid_std")}

    @staticmethod
    def images(result, names, title):
        """The fixed latents' samples, as a grid."""
        return [("samples", result["grid"])]

    def example(self, dataset):
        return (self.latent_dim,)

    def summarised(self, net, dataset):
        """Each network on its own input: latents, images."""
        image = (dataset.in_channels, dataset.image_size, dataset.image_size)
        return [("generator", net["generator"], (self.latent_dim,)),
                ("discriminator", net["discriminator"], image)]


    # ---------------------------------------------------------------------- test.py

    exported_is = "generator (it makes images)"
    test_flags = IMAGE_FLAGS
    test_reads = ("samples", "out", "fid_samples", "fid_features")

    @classmethod
    def test_sets(cls, config, request):
        return fid_sets(cls, config, request)

    @classmethod
    def tested(cls, config, val_set, request):
        """The GAN for test.py: FID and KID (its own validation) on ``--fid-samples``
        images of the latents and subsets of ``--seed``; --samples' latents made (and
        their memory checked) before anything is written."""
        asked_for(request, "GAN", "generator")
        n, config = checked_fid(request, config, val_set)
        task = cls(config, val_set or _Shape(config), n, len(val_set) if val_set else 0)
        task.request, task.dataset = request, config["dataset"]
        task.latents_asked = sample_latents(request.samples, config["latent_dim"],
                                            request.seed) if request.samples else None
        return task

    def report(self, result, key, path):
        """The figures asked for: FID and KID of --fid-samples images (none without)."""
        scores = {k: v for k, v in result.items() if k.startswith(("fid", "kid"))}
        extra = dict(fid_samples=self.fid_samples, fid_features=self.request.fid_features,
                     **scores) if scores else {}
        return {key: path, "task": self.name, "seed": self.seed, **extra}

    def format_report(self, report, title):
        what = (f"generated images (latents of seed {self.seed})")
        line = fid_line(report, what, self.dataset)
        if line is not None:
            line += (f", on the penultimate features of the classifier "
                     f"{report['fid_features']} (not Inception: comparable only with the "
                     f"same checkpoint)" if report["fid_features"] else
                     ", on Inception-v3's pool features")
        return "\n".join([title] + ([line] if line else []))

    def outputs(self, net, result, val_set, report):
        """--samples: the generator's images of the latents of --seed as PNGs."""
        if self.latents_asked is None:
            return
        request = self.request
        generator = copy.deepcopy(net["generator"]).to(request.device)
        names = write_samples(generator, self.latents_asked, request.out, request.batch_size)
        report["samples"] = {"count": len(names), "dir": request.out}
        say(f"wrote {len(names)} samples to {request.out} ({os.path.basename(names[0])} to "
            f"{os.path.basename(names[-1])}; latents of seed {self.seed})")

    @staticmethod
    def exported(net, config, val_set):
        """The CPU generator: latents in, images out."""
        return net["generator"], (config["latent_dim"],), described(config), EXPORT_NAMES


class GANEvaluation(Evaluation):
    """One GAN evaluation: the first ``fid_samples`` real validation images, then (in
    ``compute``) as many of the generator's images from the fixed latents, their FID and
    KID (gan_metrics.measure) and a grid of the first ``GAN.grid``. Under DDP each
    process extracts the features of its share of the real images and sends them to
    process 0 (``_generative.real_features``), generates its share of the images by index
    and sends their features there too (``_generative.generated_scores``); process 0
    measures and makes the grid, the others take its figures: every process decides
    alike and the figures are those of the generator process 0 saves.

    Args:
        task: the ``GAN``.
        model: what is evaluated: the run's networks (``nn.ModuleDict``) or the moving
            average of the generator.
    """

    def __init__(self, task, model):
        super().__init__()  # no state to reduce: compute gathers the images process 0 needs
        self.task, self.real, self.have = task, [], 0
        generator = model["generator"] if isinstance(model, torch.nn.ModuleDict) else model
        self.measured = (engine.bare(generator),)  # (a tuple: not a submodule of the metric)

    def update(self, real, y, x=None):
        want = real_share(self.task.fid_samples, self.task.val_size) - self.have
        if want > 0:
            self.real.append(real[:want].float().cpu())
            self.have += len(self.real[-1])

    def compute(self):
        """``fid``/``kid``/``kid_std`` (``_classifier`` with --fid-features), ``count``
        (images on each side) and ``grid`` (an (H, W, 3) uint8 array)."""
        import torch.distributed as dist

        task, (generator,) = self.task, self.measured
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        result = scores = None
        if task.fid_samples:  # every process makes its share (one process: all, as test.py)
            task.features.to(next(generator.parameters()).device)
            real = real_features(task, self.real)  # (process 0's; None elsewhere)
            latents = dcgan.fixed_latents(task.fid_samples, task.latent_dim, task.seed)
            scores = generated_scores(
                task, lambda indices: gan_metrics.generate(generator, latents[indices]), real)
        if not several or dist.get_rank() == 0:
            result = {"count": task.fid_samples, **(scores or {})}
            result["grid"] = sample_grid(
                generator, dcgan.fixed_latents(task.grid, task.latent_dim, task.seed))
        if several:
            shared = [result]
            dist.broadcast_object_list(shared, src=0)
            result = shared[0]
        return result


# ------------------------------------------------------------- test.py's generator

EXPORT_NAMES = ("latents", "images")  # the exported generator's input and output (ONNX)
GENERATOR_CONFIG = ("latent_dim", "image_size", "in_channels", "gan_loss", "gan_width",
                    "gan_attention", "gan_spectral_norm")  # what rebuilds a generator


def described(config):
    """What an exported generator's metadata says (``export.generator_metadata``): the
    config keys that rebuild it, its input and its output."""
    latents, images = EXPORT_NAMES
    side, channels = config["image_size"], config["in_channels"]
    return (GENERATOR_CONFIG,
            f"{latents}: float32 (batch, {config['latent_dim']}) drawn from N(0, 1) "
            f"(dcgan.fixed_latents(n, latent_dim, seed) for the run's fixed ones)",
            f"{images}: float32 (batch, {channels}, {side}, {side}) in [-1, 1]; "
            f"(x + 1) * 127.5, rounded, gives 0..255 pixels")


def sample_latents(n, latent_dim, seed):
    """dcgan.fixed_latents for --samples, refused in one line where they alone would take
    more than half the memory available (a mistyped N)."""
    need, free = n * latent_dim * 4, hardware.available_memory()
    if free and need > free // 2:
        raise UserError(f"--samples {n}: the latents alone need {need / 2**30:.1f} GiB, more "
                        f"than half the {free / 2**30:.1f} GiB of memory available")
    return dcgan.fixed_latents(n, latent_dim, seed)


class _Shape:
    """A dataset's shape without its images: what a generator's networks and transform
    need when test.py reads no data (``--samples`` alone)."""

    def __init__(self, config):
        self.in_channels = config["in_channels"]
        self.transform = None


TASK = GAN
