"""Small functions on tensors and modules.

Freezing, parameter counts, the LR schedule, one-hot labels, weight initialisation.
Also ``UserError``, the exception for mistakes a user can fix (a typo, a missing
directory); train.py and test.py print its message as one line and exit with code 2.
"""

import fnmatch
import math
import re
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class UserError(Exception):
    """A mistake in the user's input, reported as one line without a traceback."""


class TooFewImages(UserError):
    """An evaluation's figures need more images than it was given (an FID on
    --fid-samples): --preflight's one validation batch then takes the whole set; any other
    error of that batch is the preflight's one line (review 6's F12)."""


class Interrupted(Exception):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) came before training began, while something
    long was built (a decoded cache): it stops at once, leaving nothing half-written; the
    exit code is 128 + the signal's number."""

    def __init__(self, signum, what):
        super().__init__(what)
        self.signum, self.what = int(signum), what


class RunFailed(Exception):
    """The run cannot go on: a non-finite loss or weights, a failed write; train.py
    prints its message as one line and exits with code 1."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def first_sentence(error, width=200):
    """The first sentence of an error's message, without the source location gloo puts
    in front ("[.../pair.cc:545] Read error ...")."""
    text = " ".join(str(error).split())
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text.split(". ", 1)[0]
    return text if len(text) <= width else text[:width - 3] + "..."


class OutOfMemory(RunFailed):
    """The device (or the host) ran out of memory during ``phase`` of a step.

    Args:
        phase: where: "the forward pass", "the backward pass", "the optimizer step",
            "loading a batch" or "evaluation".
        batch_size: the samples of the batch that did not fit.
        detail: the allocator's own words (``memory_error``).
    """

    def __init__(self, phase, batch_size, detail):
        super().__init__(f"out of memory in {phase} at batch size {batch_size} ({detail})")
        self.phase, self.batch_size, self.detail = phase, batch_size, detail


_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory",
                  "not enough memory", "status_alloc_failed")  # cuBLAS's and cuDNN's own


def memory_error(error):
    """The allocator's message, shortened, when ``error`` says that memory ran out (CUDA's
    OutOfMemoryError, the CPU allocator's RuntimeError, Python's MemoryError, cuBLAS's and
    cuDNN's ``*_STATUS_ALLOC_FAILED``); else None. Of a message of several lines (the
    error DataParallel raises again for a replica's: "Caught OutOfMemoryError in replica
    1 ..." then the replica's traceback) the allocator's line is kept."""
    text = str(error)
    if not (isinstance(error, (MemoryError, torch.OutOfMemoryError))
            or any(words in text.lower() for words in _OUT_OF_MEMORY)):
        return None
    lines = [line.strip() for line in text.strip().splitlines()]
    said = [line for line in lines if any(words in line.lower() for words in _OUT_OF_MEMORY)]
    text = said[0] if said else lines[0] if lines else type(error).__name__
    text = re.sub(r"^(torch\.(cuda\.)?)?OutOfMemoryError: ", "", text)
    replica = re.match(r"Caught \w+ (in replica \d+ on device \d+)", lines[0] if lines else "")
    text = re.sub(r"^\[enforce fail at [^\]]*\] *(err == 0\. *)?", "", text)
    match = re.search(r"[Tt]ried to allocate ([0-9]+) bytes", text)
    if match:  # the CPU allocator counts in bytes
        return f"it tried to allocate {int(match[1]) / 2**30:.2f} GiB more"
    match = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", text)  # CUDA's words
    first = text.split(". ")[0].rstrip(".") + (f" ({replica[1]})" if replica else "")
    return f"{first}: it tried to allocate {match[1]} more" if match else first


def out_of_memory_message(error, config=None, net=None, last_saved=None, snapshot=None):
    """One line for an out-of-memory error: where it happened, the batch, that the
    checkpoints are intact, and what to try (each only where it is not on already).

    Args:
        error: an ``OutOfMemory`` from a step or a validation, or the allocator's
            words (``memory_error``) for one elsewhere (set-up, a checkpoint).
        config, net: the run's config and plain network, when it got that far.
        last_saved: the path of the last checkpoint written, or None.
        snapshot: the path of the --memory-snapshot file written, or None.
    """
    if not isinstance(error, OutOfMemory):
        return (f"out of memory ({error}) before or between training steps; every file "
                f"written before is intact: lower --batch-size, or free memory")
    batch = config["batch_size"]
    effective = config["virtual_batch_size"] or batch
    smaller = max(d for d in range(1, max(batch // 2, 1) + 1) if effective % d == 0)
    tries = []
    if smaller < batch:
        tries.append(f"--batch-size {smaller} --virtual-batch-size {effective} (the same "
                     f"{effective} samples an optimizer step)")
    if not config["grad_checkpointing"] and hasattr(net, "set_grad_checkpointing"):
        tries.append("--grad-checkpointing")
    if config["amp"] == "none":
        tries.append("--amp bf16")
    if not config["channels_last"]:
        tries.append("--channels-last")
    saved = last_saved
    return (f"{error}; the checkpoints are intact ("
            f"{'the last: ' + saved if saved else 'none was written yet'})"
            f"{'; the allocator history is in ' + snapshot if snapshot else ''}"
            f"{'; try ' + ', '.join(tries) if tries else ''}")


def _matching(names, patterns):
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def freeze(module, patterns):
    """Freezes the parameters whose names match any of the fnmatch patterns.

    Frozen parameters get ``requires_grad=False``. Call ``keep_frozen_norms_eval`` after
    every ``module.train()`` so that fully frozen BatchNorm layers keep their running
    statistics.

    Args:
        module: the network.
        patterns: fnmatch patterns over ``named_parameters()`` names, e.g. ``features.*``.

    Returns:
        The names of the parameters that were frozen by this call (those trainable
        before it), in order.

    Raises:
        UserError: a pattern matches no parameter; the message lists the top-level modules.
    """
    names = [n for n, _ in module.named_parameters()]
    for pattern in patterns:
        if not _matching(names, [pattern]):
            top = sorted({n.split(".")[0] for n in names})
            raise UserError(f"freeze pattern {pattern!r} matches no parameter; the network's "
                            f"top-level modules are: {', '.join(top)} (try e.g. '{top[0]}.*')")
    params = dict(module.named_parameters())
    frozen = [n for n in _matching(names, patterns) if params[n].requires_grad]
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


def unfreeze(module, patterns=("*",)):
    """Makes the frozen parameters that match ``patterns`` trainable again.

    Args:
        module: the network.
        patterns: fnmatch patterns; the default unfreezes everything.

    Returns:
        The names of the parameters that were unfrozen (those frozen before the call).
    """
    changed = []
    for name, p in module.named_parameters():
        if not p.requires_grad and _matching([name], patterns):
            p.requires_grad_(True)
            changed.append(name)
    return changed


def keep_frozen_norms_eval(module):
    """Puts every normalisation layer whose parameters are all frozen into eval mode.

    A frozen BatchNorm must not move its running statistics; ``model.train()`` would
    switch it back to batch statistics, so call this after every ``train()``.

    Args:
        module: the network, usually just switched to training mode.

    Returns:
        The number of layers put into eval mode.
    """
    count = 0
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            params = list(m.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                m.eval()
                count += 1
    return count


def count_parameters(module):
    """Counts trainable and frozen parameters.

    Args:
        module: any nn.Module.

    Returns:
        ``(trainable, frozen)`` numbers of scalar parameters.
    """
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return trainable, frozen


POLY_POWER = 0.9  # --scheduler poly: the power of torchvision's segmentation reference


_SAID = set()  # the warnings said once a process (checked_loss, checked_batch)


def _once(key, message):
    if key not in _SAID:
        _SAID.add(key)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(message, file=sys.stderr, flush=True)


def _kind(value):
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def checked_loss(loss, what="loss"):
    """A task's ``loss`` (or ``phase_loss``'s) as the loop takes it: a 0-d float tensor
    with a gradient. A tensor that no parameter computed (a leaf: the network is not in
    it) trains nothing: said once; anything else is a user's mistake (round 7's F4, F11).

    Raises:
        UserError: one line naming what it returned.
    """
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise UserError(f"the task's {what} returned {_kind(loss)}, not the micro-batch's "
                        f"mean loss (a 0-d float tensor: reduce it with .mean())")
    if not loss.requires_grad:
        raise UserError(f"the task's {what} returned a tensor without a gradient (computed "
                        f"under torch.no_grad(), detached, or from no parameter): nothing "
                        f"would train")
    if loss.grad_fn is None:
        _once("leaf", f"warning: the task's {what} is a tensor of its own "
                      f"(requires_grad=True, no graph): no parameter of the network gets a "
                      f"gradient from it, so nothing trains")
    return loss


def checked_batch(got, n):
    """A task's ``prepare`` result: ``(inputs, targets)``; fewer samples than the batch's
    ``n`` (a slice) are said once: the ledger and the loss weights count ``n``.

    Raises:
        UserError: not a pair.
    """
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise UserError(f"the task's prepare returned {_kind(got)}, not (inputs, targets)")
    if hasattr(got[0], "__len__") and len(got[0]) != n:
        _once("prepare", f"warning: the task's prepare returned {len(got[0])} samples of "
                         f"the batch's {n}: each step trains those, while the sample ledger "
                         f"and the loss's weight count {n}")
    return got


def lr_factor(step, total_steps, schedule="cosine", warmup_steps=0):
    """The learning rate at an optimizer step, as a fraction of the base rate.

    A pure function of the step, so a resumed run continues the same curve exactly.

    Args:
        step: optimizer steps taken so far (0 before the first).
        total_steps: optimizer steps of the whole run.
        schedule: ``none`` (constant), ``step`` (x0.1 at 50% and again at 75% of the
            run), ``cosine`` (cosine from 1 to 0), ``onecycle`` (linear up over the
            warmup, 30% of the run if no warmup is given, then linear down to 0),
            ``poly`` (``(1 - progress) ** 0.9`` after the warmup: torchvision's
            segmentation reference, its ``PolynomialLR(power=0.9)`` step by step).
        warmup_steps: steps of linear warmup from 0 to 1 (all schedules).

    Returns:
        A float in [0, 1].
    """
    total_steps = max(total_steps, 1)
    if schedule == "onecycle" and warmup_steps == 0:
        warmup_steps = int(0.3 * total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "none":
        return 1.0
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "onecycle":
        return 1.0 - progress
    if schedule == "poly":
        return (1.0 - progress) ** POLY_POWER
    raise ValueError(f"unknown schedule {schedule!r}")


def from_host(tensor, device):
    """A CPU ``tensor`` on ``device`` without waiting: on CUDA from pinned memory (a
    pageable copy waits for the kernels queued before it: the CUDA review's M1, M2, L3)."""
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def one_hot(labels, num_classes):
    """One-hot encodes integer class labels as a float tensor.

    The conditioning input of a class-conditional GAN (Mirza & Osindero, 2014) and the
    target of a soft-label loss. Unlike ``F.one_hot`` it returns floats, ready to be
    concatenated with activations, and it always checks the range, so a bad label fails
    here with its value rather than later inside a CUDA kernel.

    Args:
        labels: integer tensor of any shape, values in ``[0, num_classes)``.
        num_classes: number of classes, the size of the new last dimension.

    Returns:
        A float32 tensor of shape ``labels.shape + (num_classes,)``, equal to
        ``F.one_hot(labels, num_classes).float()``.

    Raises:
        ValueError: ``labels`` is not an integer tensor or holds a value out of range.
    """
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"one_hot needs integer labels, got dtype {labels.dtype}")
    if labels.numel() > 0:
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise ValueError(f"label {bad} is out of range for {num_classes} classes "
                             f"(labels must be in [0, {num_classes - 1}])")
    return F.one_hot(labels.long(), num_classes).float()


_INIT_TYPES = ("normal", "xavier", "kaiming", "orthogonal")


def _weight_for_init(module):
    # A spectral-normed layer exposes a computed weight; initialise the stored original.
    if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original
    return module.weight


def init_weights(module, init_type="normal", gain=0.02):
    """Initialises weights as pix2pix and CycleGAN do (Isola et al. 2017, Zhu et al. 2017).

    Applied through ``module.apply`` to every convolution (any dimension, transposed too)
    and linear layer: weights by ``init_type``, biases to 0. BatchNorm layers get weights
    from N(1, gain) and biases 0. Other modules are left as they are. The default N(0, 0.02)
    is DCGAN's (Radford et al., 2016). A spectral-normed layer has its stored weight
    initialised; call this before ``layers.spectral_norm`` so that the power iteration
    starts from the final weights.

    Args:
        module: the network (or any module) to initialise in place.
        init_type: ``"normal"`` (N(0, gain)), ``"xavier"`` (Glorot normal with ``gain``),
            ``"kaiming"`` (He normal, fan-in, for ReLU; ``gain`` is not used) or
            ``"orthogonal"`` (orthogonal matrix times ``gain``).
        gain: standard deviation for ``normal``, scale for ``xavier`` and ``orthogonal``.

    Returns:
        ``module``, so the call can wrap a constructor.

    Raises:
        ValueError: unknown ``init_type``.
    """
    if init_type not in _INIT_TYPES:
        raise ValueError(f"unknown init_type {init_type!r}; choose one of "
                         f"{', '.join(_INIT_TYPES)}")

    @torch.no_grad()
    def init_one(m):
        if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear)):
            weight = _weight_for_init(m)
            if init_type == "normal":
                nn.init.normal_(weight, 0.0, gain)
            elif init_type == "xavier":
                nn.init.xavier_normal_(weight, gain=gain)
            elif init_type == "kaiming":
                nn.init.kaiming_normal_(weight, a=0, mode="fan_in")
            else:
                nn.init.orthogonal_(weight, gain=gain)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            nn.init.normal_(m.weight, 1.0, gain)
            nn.init.zeros_(m.bias)

    return module.apply(init_one)


def train_flops_per_sample(module, sample_shape, device, kinds=False):
    """FLOPs of one training step's forward and backward pass, per sample.

    Counted once with ``torch.utils.flop_counter.FlopCounterMode`` on a copy of the
    module (a batch of 2), so the network's weights, BatchNorm statistics and the RNG
    are untouched. Activation checkpointing is off in the copy: these are model FLOPs
    (as in MFU), without the recomputation.

    Args:
        module: the network.
        sample_shape: shape of one input sample, e.g. ``(3, 32, 32)``.
        device: where to run the count.
        kinds: also return the FLOPs that are not convolutions (matrix products: cuBLAS,
            whose TF32 switch is not cuDNN's).

    Returns:
        The FLOP count per sample (an int; a multiply-add counts as 2 FLOPs); with
        ``kinds``, ``(flops, matmul_flops)``.
    """
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    clone = copy.deepcopy(module).train()
    if hasattr(clone, "set_grad_checkpointing"):
        clone.set_grad_checkpointing(False)  # model FLOPs: recomputation is not counted
    # The input is drawn inside the fork too: after a resume the global RNG already holds
    # the checkpoint's state, and dropout in the first step must see exactly that state.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        x = torch.randn(2, *sample_shape, device=device)
        counter = FlopCounterMode(display=False)
        with counter:
            out = clone(x)  # (a dict for torchvision's segmentation networks: "out", "aux")
            sum(o.float().sum() for o in (out.values() if isinstance(out, dict)
                                          else [out])).backward()
    if not kinds:
        return counter.get_total_flops() // 2
    convolutions = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                       if "convolution" in str(op))
    return counter.get_total_flops() // 2, (counter.get_total_flops() - convolutions) // 2


def saved_tensor_bytes(module, x):
    """Bytes one forward of ``module`` keeps for backward (activation memory).

    Counts the tensors autograd packs (``torch.autograd.graph.saved_tensors_hooks``) and
    the inputs that activation-checkpointed blocks keep to recompute from; parameters are
    left out and a storage shared by several tensors counts once. Runs one backward so
    nothing is left over, then clears the gradients.

    Args:
        module: the network, in the mode to measure (train mode for training memory).
        x: an input batch.

    Returns:
        The number of bytes.
    """
    import torch
    import torch.utils.checkpoint

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        keep(t)
        return t

    real_checkpoint = torch.utils.checkpoint.checkpoint

    def checkpoint(fn, *args, **kwargs):  # a checkpointed block keeps its inputs
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a)
        return real_checkpoint(fn, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
    finally:
        torch.utils.checkpoint.checkpoint = real_checkpoint
    out.float().sum().backward()
    module.zero_grad(set_to_none=True)
    return sum(seen.values())


# Dense (no sparsity) peaks in TFLOP/s from NVIDIA's datasheets, by the exact name
# torch.cuda.get_device_name gives (a pattern matched in full: "A100" must not match
# "RTX A1000", nor the SXM H100's figures a PCIe or NVL one). bf16 and fp16 are the tensor
# cores with fp32 accumulation; tf32 is what convolutions get with --amp none (cuDNN
# allows TF32 by default); a GPU without TF32 or bf16 has no such entry.
GPU_PEAKS = (
    (r"NVIDIA H(100|200)( \d+GB HBM3e?)?|NVIDIA H100 SXM.*|NVIDIA GH200.*",
     {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"NVIDIA H(100|200) NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"NVIDIA H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"NVIDIA A100[- ].*", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"NVIDIA L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"NVIDIA A10G?", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"NVIDIA GeForce RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"NVIDIA GeForce RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"Tesla V100-SXM2-(16|32)GB", {"fp16": 125.0, "fp32": 15.7}),
    (r"Tesla V100-PCIE-(16|32)GB", {"fp16": 112.0, "fp32": 14.0}),
    (r"Tesla T4", {"fp16": 65.0, "fp32": 8.1}),
)


def peak_tflops(device_name, precision):
    """A known GPU's datasheet peak, or None (an unknown GPU, or a precision it lacks).

    Args:
        device_name: ``torch.cuda.get_device_name``, matched in full.
        precision: ``bf16``, ``fp16``, ``tf32`` or ``fp32`` (a GPU without TF32 gives its
            fp32 peak for ``tf32``).

    Returns:
        TFLOP/s of one GPU, or None.
    """
    for pattern, peaks in GPU_PEAKS:
        if re.fullmatch(pattern, device_name.strip()):
            if precision == "tf32" and "tf32" not in peaks:
                precision = "fp32"
            return peaks.get(precision)
    return None


class Optimizers:
    """Named optimizers, one per network of a model with several (a GAN's generator and
    discriminator), each stepped by its own phase (``engine._phase_steps``). What every
    optimizer of a run gets, the schedule (``param_groups``), its state and its
    hyper-parameters, reaches each; ``state_dict`` is by name.

    Args:
        named: ``{network name: optimizer}``.
        lr_flags: ``{network name: the config key of its own learning rate}`` (the task's
            ``network_lr``, a GAN's ``{"discriminator": "lr_d"}``); a network without one,
            or whose flag is None, takes ``lr``.
    """

    def __init__(self, named, lr_flags=None):
        self.named = dict(named)
        self.lr_flags = dict(lr_flags or {})

    def __getitem__(self, name):
        return self.named[name]

    def items(self):
        return self.named.items()

    @property
    def param_groups(self):
        """Every optimizer's param groups, in order (the first is the first network's)."""
        return [g for optimizer in self.named.values() for g in optimizer.param_groups]

    def state_dict(self):
        return {name: optimizer.state_dict() for name, optimizer in self.named.items()}

    def load_state_dict(self, saved):
        """Loads each optimizer's state by name (a name missing: ``KeyError``)."""
        for name, optimizer in self.named.items():
            optimizer.load_state_dict(saved[name])

    def zero_grad(self, set_to_none=True):
        for optimizer in self.named.values():
            optimizer.zero_grad(set_to_none=set_to_none)


def each_optimizer(optimizer, config):
    """``(optimizer, config)`` for each optimizer of a run: the one, or each of an
    ``Optimizers`` with its network's learning rate (``Optimizers.lr_flags``) as ``lr``."""
    if not isinstance(optimizer, Optimizers):
        return [(optimizer, config)]
    flags = optimizer.lr_flags
    return [(o, {**config, "lr": config[flags[name]]}
             if config.get(flags.get(name)) is not None else config)
            for name, o in optimizer.items()]


def build_optimizer(net, config, device, network_lr=None, groups=None):
    """The optimizer over the trainable parameters; each group keeps its ``base_lr``.
    A model of several networks (an ``nn.ModuleDict``: a GAN's) gets an ``Optimizers``,
    one optimizer per network, with its own learning rate where ``network_lr`` (the task's:
    ``{network name: config key}``) names one.

    On CUDA, and wherever fp16's GradScaler runs, the fused implementation: with any
    other, ``GradScaler.step`` reads whether the gradients were finite back to the host at
    every step (a device sync); a fused optimizer takes that flag on the device.
    ``groups(net, params, config)``: the param groups (``param_groups.split``); None: one.
    """
    if isinstance(net, torch.nn.ModuleDict):
        optimizers = Optimizers({name: build_optimizer(module, config, device, groups=groups)
                                 for name, module in net.items()}, network_lr)
        set_hyperparameters(optimizers, config)
        return optimizers
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise UserError("every parameter is frozen: nothing to train")
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
           "adamw": torch.optim.AdamW}[config["optimizer"]]
    fused = {"fused": True} if device.type == "cuda" or config["amp"] == "fp16" else {}
    split = [{"params": params}] if groups is None else groups(net, params, config)
    optimizer = cls(split, lr=config["lr"], **fused)
    set_hyperparameters(optimizer, config)
    return optimizer


def unfreeze_point(config):
    """The position ``(epoch index, samples into it)`` at which --unfreeze-at unfreezes,
    or None."""
    return (config["unfreeze_at"] - 1, 0) if config["unfreeze_at"] else None


def unfrozen_at_resume(config, state):
    """Whether --unfreeze-at happened before the point ``state`` resumes from."""
    point = unfreeze_point(config)
    return point is not None and (state.epoch, state.epoch_samples) > point


def set_hyperparameters(optimizer, config):
    """Puts the config's hyper-parameters into every param group (also after a resume:
    the config may override the checkpoint's). A second group holds the parameters
    unfrozen by --unfreeze-at; its learning rate is scaled by --unfreeze-lr-scale. Each
    of an ``Optimizers`` gets its network's own learning rate."""
    if isinstance(optimizer, Optimizers):
        for one, its_config in each_optimizer(optimizer, config):
            set_hyperparameters(one, its_config)
        return
    for i, group in enumerate(optimizer.param_groups):  # (machinery/param_groups.py's keys)
        unfrozen = group.get("unfrozen", i > 0)
        group["base_lr"] = config["lr"] * (config["unfreeze_lr_scale"] if unfrozen else 1.0) \
            * group.get("lr_scale", 1.0)
        group["fused"] = optimizer.defaults["fused"]  # as built here, not as saved
        decay = group.get("decay", "weight_decay")  # "none": a no_weight_decay() name
        group["weight_decay"] = 0.0 if decay == "none" else config["weight_decay"] \
            if config.get(decay) is None else config[decay]
        if config["optimizer"] == "sgd":
            group["momentum"] = config["momentum"]
            group["nesterov"] = config["nesterov"] and config["momentum"] > 0
        else:
            group["betas"] = tuple(config["betas"])  # --betas
    if config["optimizer"] == "sgd":
        zero_momentum_buffers(optimizer)


def zero_momentum_buffers(optimizer):
    """Gives each SGD parameter with momentum that has no momentum buffer yet a zero one.

    A fused SGD makes its first step's buffers with ``torch.empty_like`` and fills them in
    the kernel, which returns at once when the GradScaler found inf gradients: a skipped
    first step (fp16's initial scale overflows often) would keep whatever the allocator
    left there (NaN under --deterministic) and the next step would add 0.9 times it. With a
    zero buffer the first step that is taken computes ``momentum * 0 + g``, which is the
    first-step rule (``buf = g``) bit for bit, for the fused and the plain SGD alike.

    Args:
        optimizer: a ``torch.optim.SGD`` (other optimizers are left as they are).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format)


def place_fused_steps(optimizer):
    """Moves each fused group's ``step`` tensors to their parameter's device, as float32.

    ``Optimizer.load_state_dict`` moves them only when the saved group says fused; a
    checkpoint of a CPU run without fp16 (or of a version before fused optimizers) says
    not, and a fused Adam on CUDA then fails at its first step ("Expected all tensors to be
    on the same device ... state_steps").

    Args:
        optimizer: any ``torch.optim.Optimizer`` (or an ``Optimizers``), after
            ``load_state_dict``.
    """
    if isinstance(optimizer, Optimizers):
        for _, one in optimizer.items():
            place_fused_steps(one)
        return
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and (step.device != p.device
                                                   or step.dtype != torch.float32):
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)


def sum_over_processes(values, device, world_size=1):
    """Sums a few numbers over the processes of a torch.distributed run.

    Args:
        values: numbers (this process's).
        device: where the collective runs (the process's training device).
        world_size: number of processes; with 1, the numbers come back as they are.

    Returns:
        A list of floats: the sums over all processes.
    """
    if world_size == 1:
        return [float(v) for v in values]
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
