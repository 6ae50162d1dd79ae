"""Image-to-image translation (pix2pix, Isola et al., 2017): pix2pix.py's U-Net generator
and PatchGAN discriminator trained in two phases on pairs of images (pair_data.py), the
conditional GAN loss plus ``--l1-weight`` x L1 (and ``--perceptual-weight`` x VGG19's
perceptual loss); PSNR, SSIM (torchmetrics) and L1 of the generator's outputs on the
validation pairs, the highest PSNR picking best.pt, a picture of input | output | target;
what test.py gives for its checkpoints (the figures, the outputs as PNGs, the generator
for export).
"""

import contextlib
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

import torch

import losses
import ops
import pix2pix
from machinery import engine, files
from machinery.runtime import say
from ops import UserError
from pipeline import device_data, pair_data
from tasks import Evaluation, Phase, Task, check_own_network_and_data, refuse
from tasks._generative import IMAGE_FLAGS, encode_png, refuse_replacing

# The paper's recipe (Adam 2e-4, betas (0.5, 0.999)), a constant rate; the paper's jitter
# (resize 286, crop 256, flip) is pair_data's augmentation, kept on by default.
PIX2PIX_RECIPE = {"optimizer": "adam", "lr": 2e-4, "betas": [0.5, 0.999],
                  "weight_decay": 0.0, "scheduler": "none", "warmup_epochs": 0.0,
                  "label_smoothing": 0.0}


def _vgg19_file():
    """Where PerceptualLoss looks for VGG19's ImageNet weights (the torch hub cache)."""
    from torchvision.models import VGG19_Weights

    name = Path(urlparse(VGG19_Weights.IMAGENET1K_V1.url).path).name
    return Path(torch.hub.get_dir()) / "checkpoints" / name


class Pix2Pix(Task):
    """pix2pix: per step the discriminator's phase (real pairs against the generator's
    outputs, detached), then the generator's (the discriminator's verdict on its outputs
    plus ``--l1-weight`` x L1 to the targets); PSNR, SSIM and L1 at each validation.

    The generator's outputs of a micro-batch are made once, with their graph, when it is
    its step's only one (as the paper's loop), else again in the generator's phase: its
    dropout masks are hashed from each sample's place in the epoch (``pix2pix.sample_keys``),
    so the two are the same images, and accumulation and any number of processes train
    what one large batch trains (InstanceNorm, the default: per sample).

    Args:
        config: the run's (``pix2pix_gan_loss``, ``l1_weight``, ``perceptual_weight``,
            ``seed``).
    """

    name = "pix2pix"
    figures = ("psnr", "ssim", "l1")  # val_psnr, val_ssim, val_l1
    best = "psnr"                     # best.pt: the highest PSNR
    averaged_name = "generator"       # --ema-decay averages the generator
    shown_figures = ("loss_d", "loss_g")
    examples = 4                      # validation pairs in the picture

    default_network = "pix2pix"
    own_networks = ("pix2pix",)
    own_networks_are = "pix2pix's U-Net generator and PatchGAN discriminator"
    own_flags = ("l1_weight", "perceptual_weight", "pix2pix_gan_loss", "pix2pix_norm",
                 "pix2pix_width", "pix2pix_dropout")
    flags_title = "image-to-image (--task pix2pix)"
    datasets_named = pair_data.DATASETS
    ranges = {"l1_weight": ((lambda v: v >= 0), "must be at least 0"),
              "perceptual_weight": ((lambda v: v >= 0), "must be at least 0"),
              "pix2pix_width": ((lambda v: 1 <= v <= 4096), "must be in [1, 4096]"),
              "pix2pix_dropout": ((lambda v: 0 <= v < 1), "must be in [0, 1)")}
    stored_needs = (  # what test.py reads to rebuild the generator (pix2pix.build)
        ("image_size", lambda v: type(v) is int and v > 0 and v % 2 ** pix2pix.MIN_DOWNS == 0,
         f"a multiple of {2 ** pix2pix.MIN_DOWNS}", False),
        ("in_channels", lambda v: type(v) is int and v in (1, 3), "1 or 3", False),
        ("out_channels", lambda v: type(v) is int and v in (1, 3), "1 or 3", False),
        ("pix2pix_norm", lambda v: v in pix2pix.NORMS, f"one of {', '.join(pix2pix.NORMS)}",
         True),
        ("pix2pix_width", lambda v: type(v) is int and v >= 1, "an integer of at least 1",
         True),
    )

    @staticmethod
    def flags(g):
        """pix2pix's losses and networks (pix2pix.py)."""
        g.add_argument("--l1-weight", type=float, default=100.0,
                       help="the weight of the L1 distance of the generator's outputs to the "
                       "targets in its loss (the paper's lambda)")
        g.add_argument("--perceptual-weight", type=float, default=0.0,
                       help="the weight of losses.PerceptualLoss (VGG19 features, Johnson et "
                       "al.) in the generator's loss; 0: none; its ImageNet weights must be "
                       "in TORCH_HOME's hub cache (never downloaded)")
        g.add_argument("--pix2pix-gan-loss", default="vanilla", choices=pix2pix.GAN_LOSSES,
                       help="losses.GANLoss of the PatchGAN's scores: vanilla (BCE, the "
                       "paper's) or lsgan")
        g.add_argument("--pix2pix-norm", default="instance", choices=pix2pix.NORMS,
                       help="normalisation in both networks: instance (per sample, so "
                       "accumulation and any number of processes give the large batch's "
                       "steps), batch (the paper's; a sample then depends on its "
                       "micro-batch) or none")
        g.add_argument("--pix2pix-width", type=int, default=64,
                       help="channels of the first layer of each network (the paper's ngf "
                       "= ndf)")
        g.add_argument("--pix2pix-dropout", type=float, default=0.5,
                       help="dropout of the U-Net's inner decoder layers (64 px and above), "
                       "masks hashed from (seed, epoch, sample)")

    @classmethod
    def defaults(cls, config, explicit):
        """The pix2pix network and the paper's optimizer (``PIX2PIX_RECIPE``) where the
        user set none."""
        if "network" not in explicit:
            config["network"] = "pix2pix"
        config.update({k: v for k, v in PIX2PIX_RECIPE.items() if k not in explicit})

    @classmethod
    def check_config(cls, config):
        """What --task pix2pix takes, and the flags that make no sense for it: one line
        each."""
        check_own_network_and_data(config, "pix2pix", "pix2pix", "pix2pix.py",
                                   pair_data.DATASETS)
        try:
            pix2pix.downs(config["image_size"])
        except ValueError as e:
            raise UserError(str(e)) from None
        refused = [
            (config["mixup_alpha"] or config["cutmix_alpha"], "--mixup-alpha/--cutmix-alpha",
             "mix the inputs of a batch, not their targets"),
            (config["auto_augment"] != "none", "--auto-augment",
             "would move the input and not its target"),
            (config["random_erase"], "--random-erase", "would erase the input, not its target"),
            (config["tta"] != "none", "--tta", "averages a classifier's predictions"),
            (config["label_smoothing"], "--label-smoothing", "smooths a classifier's labels"),
            (config["freeze"], "--freeze", "is not for pix2pix's two networks"),
            (config["pretrained"], "--pretrained", "loads one network's weights"),
            (config["grad_checkpointing"], "--grad-checkpointing",
             "has no pix2pix implementation"),
            (config["find_lr"], "--find-lr", "sweeps one optimizer's learning rate"),
            (config["data_on_device"] == "on", "--data-on-device on",
             "has no path for pairs (they are read by DataLoader workers)"),
            (config["gpus"] and "," in str(config["gpus"]), "--gpus with several GPUs",
             "(DataParallel) is not for two networks: use torchrun")]
        refuse("pix2pix", refused)

    @classmethod
    def datasets(cls, config, log, should_stop=None):
        """SeededDatasets of (input, target) (pair_data.py)."""
        return pair_data.build_datasets(config, log, should_stop)

    @classmethod
    def loaders(cls, config, procs, train_set, val_set, sampler, stop=None):
        """DataLoader workers (pairs have no device path)."""
        def per_sample(config, train_set, val_set, device):
            workers = config["num_workers"]
            return False, (f"data path: per-sample DataLoader, {workers} "
                           f"worker{'s' * (workers != 1)} (pairs have no device path)")
        return device_data.build_loaders(config, procs, train_set, val_set, sampler, stop,
                                         per_sample)

    set_identity = staticmethod(pair_data.set_identity)

    @classmethod
    def build_networks(cls, config, dataset):
        """pix2pix.py's generator and discriminator, as an ``nn.ModuleDict``."""
        try:
            return pix2pix.networks(config, dataset.in_channels, dataset.out_channels)
        except ValueError as e:
            raise UserError(str(e)) from None

    @classmethod
    def recorded(cls, config, dataset):
        """The flags and the images' channels: test.py rebuilds the generator from them."""
        return {**config, "in_channels": dataset.in_channels,
                "out_channels": dataset.out_channels}

    @classmethod
    def build(cls, config, train_set, val_set=None):
        return cls(config)

    def __init__(self, config):
        self.criterion_of = pix2pix.criterion(config["pix2pix_gan_loss"])
        self.l1_weight = config["l1_weight"]
        self.perceptual_weight = config["perceptual_weight"]
        self.seed = config["seed"]
        self.phases = (Phase("discriminator"), Phase("generator"))
        self.perceptual = None
        if self.perceptual_weight:
            path = _vgg19_file()
            if not path.is_file():
                raise UserError(f"--perceptual-weight {self.perceptual_weight:g} needs VGG19's "
                                f"ImageNet weights in {path} (TORCH_HOME's hub cache; never "
                                f"downloaded here): put the file there, or train without it "
                                f"(--perceptual-weight 0)")
            self.perceptual = losses.PerceptualLoss(weights="imagenet")

    def keys(self, generator, where, device):
        """The dropout keys of a micro-batch's samples: their places in the epoch; None
        where ``generator`` (bare) drops nothing (below 64 px, or ``--pix2pix-dropout 0``)."""
        if not (generator.dropout > 0 and generator.dropped):
            return None
        first = where.first + where.offset
        positions = torch.arange(first, first + where.count)
        return ops.from_host(pix2pix.sample_keys(self.seed, where.epoch, positions), device)

    def phase_loss(self, network, model, plain, x, y, where, kept):
        """The loss of ``network``'s phase for one micro-batch and its figures (detached).

        The discriminator's: ``pix2pix.discriminator_loss`` on (input, target) and (input,
        output), the output made with its graph and kept for the generator's phase when
        the micro-batch is its step's only one (``where.alone``), else without (made
        again there: the same images). The generator's: ``pix2pix.generator_loss``
        through the bare discriminator (its parameters do not require gradients then).
        """
        if network == "generator":
            fake = kept.pop("fake", None)
            if fake is None:
                fake = model["generator"](x, self.keys(plain["generator"], where, x.device))
            if self.perceptual is not None:
                self.perceptual.to(x.device)
            return pix2pix.generator_loss(plain["discriminator"], x, y, fake,
                                          self.criterion_of, self.l1_weight, self.perceptual,
                                          self.perceptual_weight)
        keys = self.keys(plain["generator"], where, x.device)
        if where.alone:
            fake = kept["fake"] = model["generator"](x, keys)
        else:
            with torch.no_grad():
                fake = plain["generator"](x, keys)
        return pix2pix.discriminator_loss(model["discriminator"], x, y, fake,
                                          self.criterion_of)

    @staticmethod
    def averaged(net):
        """The network --ema-decay averages: the generator."""
        return net["generator"]

    @staticmethod
    def counted(net):
        """What a step's FLOPs are counted on (``ops.train_flops_per_sample``)."""
        return pix2pix.StepFlops(net["generator"], net["discriminator"])

    def summarised(self, net, dataset):
        """Each network on its own input: an image; an input and a target together."""
        side = dataset.image_size
        return [("generator", net["generator"], (dataset.in_channels, side, side)),
                ("discriminator", net["discriminator"],
                 (dataset.in_channels + dataset.out_channels, side, side))]

    @staticmethod
    def predict(model, x, tta=False):
        """The generator's outputs (the run's, or its moving average)."""
        generator = model["generator"] if isinstance(model, torch.nn.ModuleDict) else model
        return engine.bare(generator)(x)

    keep = 0  # test.py --samples: the first outputs kept as images

    def evaluation(self, device, model=None):
        return Pix2PixEvaluation(device, self.examples, self.keep)

    @staticmethod
    def images(result, names, title):
        """A few validation pairs: input | output | target, one row each."""
        inputs, outputs, targets = result["examples"]
        return [("pictures", pix2pix.triptych(inputs, outputs, targets))]

    # ---------------------------------------------------------------------- test.py

    exported_is = "generator (it makes images)"
    test_flags = IMAGE_FLAGS
    test_reads = ("samples", "out")

    @classmethod
    def tested(cls, config, val_set, request):
        """The task for test.py: PSNR, SSIM and L1 on the validation pairs (its own
        validation), keeping the first --samples outputs; a file of theirs in --out that
        test.py did not write is refused before the generator runs."""
        task = super().tested(config, val_set, request)
        if request.samples and request.samples > len(val_set):
            raise UserError(f"--samples {request.samples}: the validation set has "
                            f"{len(val_set)} pairs")
        if request.samples:
            refuse_replacing(request.out, output_names(val_set, request.samples))
        task.keep = request.samples or 0
        return task

    def report(self, result, key, path):
        return {key: path, "task": self.name,
                **{k: result[k] for k in ("psnr", "ssim", "l1", "count")}}

    @staticmethod
    def format_report(report, title):
        return (f"{title}\npsnr {report['psnr']:.4f}  ssim {report['ssim']:.4f}  l1 "
                f"{report['l1']:.4f} ({report['count']} validation pairs)")

    def outputs(self, net, result, val_set, report):
        """--samples: the first validation pairs' generated images as PNGs."""
        request = self.request
        if not request.samples:
            return
        names = write_outputs(result["outputs"], val_set, request.out)
        report["samples"] = {"count": len(names), "dir": request.out}
        say(f"wrote {len(names)} outputs to {request.out} ({names[0]} to {names[-1]}: the "
            f"first validation pairs' generated images)")

    @staticmethod
    def exported(net, config, val_set):
        """The CPU generator: images in, images out."""
        side = config["image_size"]
        return (net["generator"], (config["in_channels"], side, side), described(config),
                ("inputs", "outputs"))


@contextlib.contextmanager
def full_float32(device):
    """cuDNN without TF32 inside the block on a CUDA ``device`` (nothing elsewhere).

    SSIM's Gaussian filter is a depthwise convolution; torch sends a channels_last one
    (``--channels-last`` outputs keep their format through torchmetrics' padding) to
    cuDNN, whose TF32 rounds the filter's inputs to 10 bits: SSIM(x, x) of the synthetic
    pairs' flat shapes read 0.93 instead of 1 (CUDA review 6's L1). The images are made
    NCHW-contiguous too, which keeps the filter on torch's own float32 kernel."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = before


class Pix2PixEvaluation(Evaluation):
    """One validation of pix2pix, counted on the device: PSNR and SSIM of the outputs
    against the targets, both in [0, 1] (torchmetrics' ``PeakSignalNoiseRatio``: the
    mean squared error over the whole set, then in dB; ``StructuralSimilarityIndexMeasure``:
    the mean of the images' SSIMs, an 11-pixel Gaussian window), and L1 in [-1, 1] (the
    training loss's term, unweighted); each metric's states are reduced over the
    processes when computed. The first ``examples`` pairs of this process are kept for
    the picture.

    Args:
        device: where the sums live.
        examples: how many of the first pairs to keep for the picture.
    """

    def __init__(self, device, examples=4, keep=0):
        super().__init__()
        self.want, self.kept, self.keep, self.outputs = examples, None, keep, []
        # here, not at the top: torchmetrics is imported at a validation (tasks.Evaluation)
        from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

        self.psnr = PeakSignalNoiseRatio(data_range=1.0)
        self.ssim = StructuralSimilarityIndexMeasure(data_range=1.0)
        self.add_state("l1_sum", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("elements", torch.zeros((), dtype=torch.long), "sum")
        self.add_state("pairs", torch.zeros((), dtype=torch.long), "sum")
        self.to(device)

    def update(self, out, y, x=None):
        out, y = out.float(), y.float()
        self.psnr.update((out + 1) / 2, (y + 1) / 2)
        with full_float32(out.device):  # SSIM's filter on NCHW, without TF32 (review 6's L1)
            self.ssim.update(((out + 1) / 2).contiguous(), ((y + 1) / 2).contiguous())
        self.l1_sum += (out - y).abs().sum(dtype=torch.float64)
        self.elements += out.numel()
        self.pairs += len(out)
        if self.kept is None and x is not None:
            n = self.want
            self.kept = (x[:n].detach().float().cpu(), out[:n].cpu(), y[:n].cpu())
        have = sum(len(o) for o in self.outputs)
        if have < self.keep:  # (test.py --samples, one process)
            self.outputs.append(pix2pix.to_uint8(out[:self.keep - have]).cpu())

    def compute(self):
        """``psnr`` (dB), ``ssim``, ``l1``, ``count`` (pairs) and ``examples``."""
        empty = torch.zeros(0, 3, 1, 1)
        return {"psnr": float(self.psnr.compute()), "ssim": float(self.ssim.compute()),
                "l1": float(self.l1_sum) / max(int(self.elements), 1),
                "count": int(self.pairs),
                "examples": self.kept if self.kept is not None else (empty, empty, empty),
                **({"outputs": torch.cat(self.outputs)} if self.outputs else {})}


# ------------------------------------------------------------- test.py's generator

def described(config):
    """What an exported generator's metadata says (``export.generator_metadata``): the
    config keys that rebuild it, its input and its output."""
    c_in, c_out, side = config["in_channels"], config["out_channels"], config["image_size"]
    return (("image_size", "in_channels", "out_channels", "pix2pix_width", "pix2pix_norm",
             "pix2pix_dropout"),
            f"inputs: float32 (batch, {c_in}, {side}, {side}) in [-1, 1] (pixels / 127.5 - 1)",
            f"outputs: float32 (batch, {c_out}, {side}, {side}) in [-1, 1]; (x + 1) * 127.5, "
            f"rounded, gives 0..255 pixels")


def output_names(val_set, n):
    """The names of the first ``n`` outputs: each validation pair's input's, as a PNG
    (``000000.png`` on for the synthetic set)."""
    base = val_set.base
    if isinstance(base, pair_data.FolderPairs):
        return [os.path.splitext(os.path.basename(a))[0] + ".png" for a, _ in base.pairs[:n]]
    return [f"{i:06d}.png" for i in range(n)]


def write_outputs(outputs, val_set, out_dir):
    """The outputs as PNGs in ``out_dir``, each named for its validation pair
    (``output_names``), written atomically; a file of that name that held another image
    (test.py's own: ``refuse_replacing`` refused any other before) is replaced with one
    warning. Returns the names.

    Raises:
        UserError: a file of those names is there that test.py did not write.
        files.OutputError: a write failed (a full disk); files written before are whole.
    """
    names = output_names(val_set, len(outputs))
    refuse_replacing(out_dir, names)
    replaced, path = [], out_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
        for image, name in zip(outputs, names):
            path = os.path.join(out_dir, name)
            png = encode_png(image)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    if f.read() != png:
                        replaced.append(name)
            files.atomic_write(path, lambda f, png=png: f.write(png), "wb")
    except OSError as e:
        raise files.output_failed("--out", path, e,
                                  names[:names.index(os.path.basename(path))]
                                  if path != out_dir else ()) from None
    if replaced:  # a file of that name held another image (a user's, another checkpoint's)
        say(f"warning: {len(replaced)} file(s) in {out_dir} held other images and were "
            f"replaced ({replaced[0]}{' ...' if len(replaced) > 1 else ''})", file=sys.stderr)
    return names


TASK = Pix2Pix
