"""DDPM (Ho et al., 2020): a small U-Net that predicts the noise, its noise schedule, the
training draws and loss, and sampling with DDPM's ancestral steps or DDIM's (Song et al.,
2021), deterministic from a seed.

The styleguide's rule: a finished model lives in a file named after it, and the train
and test scripts import it from here (tasks/diffusion.py trains it, test.py samples it).

The network follows the DDPM paper's U-Net at a smaller size: a 3x3 stem, then at each
of three resolutions (the image's side, a half, a quarter) ``blocks`` residual blocks
(GroupNorm, SiLU, 3x3 convolutions; the timestep's embedding added between the two
convolutions), DDPM's self-attention block (``Attention``: GroupNorm, scaled dot-product
attention over every position, an output projection) at the lowest resolution and in the
middle, and the mirror path up with skip connections. GroupNorm,
not BatchNorm: each image is computed on its own, so gradient accumulation and any number
of processes give exactly the large batch's step. The timestep enters as a sinusoidal
embedding (the Transformer's) through a two-layer MLP. The last convolution starts at
zero (the paper's), so the first prediction is no noise at all.

Schedules: ``linear`` (the paper's 1e-4 to 0.02 over 1000 steps, scaled by 1000 / steps
as improved-diffusion does, so other step counts keep its shape; below 20 steps its last
betas are clipped at 0.999, as the cosine's are) and ``cosine`` (Nichol & Dhariwal,
2021). Sampling walks a subsequence of the timesteps (``--sample-steps``, evenly spaced,
the last and the first included) through the predicted clean image, clipped to [-1, 1]:
DDIM (eta 0: deterministic once the starting noise is drawn) or DDPM (the posterior of
the subsequence's steps: the paper's ancestral sampling when it is all of them). Image
sides: multiples of 4 from 8 to 256 (MNIST's 28: 28, 14, 7; CIFAR's 32: 32, 16, 8).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SCHEDULES = ("linear", "cosine")
SAMPLERS = ("ddim", "ddpm")
DDIM_STEPS = 50  # --sample-steps' default for DDIM (DDPM's: every timestep)
MULTIPLIERS = (1, 2, 2)  # channels at the three resolutions, times the width
CHUNK = 16  # sampling: the noise of images i // CHUNK comes from one generator
MIN_SIDE, MAX_SIDE = 8, 256
MAX_BETA = 0.999  # both schedules' betas are clipped here (Nichol & Dhariwal's)


def check_image_size(side):
    """Raises ValueError unless the U-Net takes images of side ``side``."""
    if not (MIN_SIDE <= side <= MAX_SIDE and side % 4 == 0):
        raise ValueError(f"the DDPM U-Net takes image sides that are multiples of 4 from "
                         f"{MIN_SIDE} to {MAX_SIDE} (got {side})")


def _norm(channels):
    return nn.GroupNorm(math.gcd(32, channels), channels)  # 32 groups where they divide


def timestep_embedding(t, dim):
    """The sinusoidal embedding of timesteps ``t`` (``(N,)``, integers or floats):
    ``(N, dim)``, cosines then sines of ``t`` at ``dim / 2`` frequencies from 1 to 1/10000
    (Vaswani et al.; the DDPM code's)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device,
                                                        dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]  # (N, half)
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)
    return F.pad(emb, (0, dim % 2))  # (N, dim)


class ResBlock(nn.Module):
    """GroupNorm, SiLU, conv 3x3; plus the timestep's embedding per channel; GroupNorm,
    SiLU, conv 3x3; added to the input (through a 1x1 convolution when the channels
    change)."""

    def __init__(self, in_channels, out_channels, emb_dim):
        super().__init__()
        self.first = nn.Sequential(_norm(in_channels), nn.SiLU(),
                                   nn.Conv2d(in_channels, out_channels, 3, padding=1))
        self.emb = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, out_channels))
        self.second = nn.Sequential(_norm(out_channels), nn.SiLU(),
                                    nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip = nn.Identity() if in_channels == out_channels else \
            nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x, emb):
        h = self.first(x)
        h = h + self.emb(emb)[:, :, None, None]
        return self.second(h) + self.skip(x)


class Attention(nn.Module):
    """DDPM's self-attention block (Ho et al.'s ``AttnBlock``): GroupNorm, 1x1 convolutions
    to a query, a key and a value of all the channels, every position attending to every
    position (``F.scaled_dot_product_attention``: softmax(q k^T / sqrt(C)) v), and a 1x1
    output projection, added to the input. The projection starts at zero (the paper's),
    so the block starts as the identity. Memory grows with ``(H * W) ** 2``: the U-Net
    uses it at its lowest resolution."""

    def __init__(self, channels):
        super().__init__()
        self.norm = _norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        n, c, h, w = x.shape
        qkv = self.qkv(self.norm(x))
        if qkv.is_cuda:  # the fused kernels (flash, memory-efficient) on any memory format
            return x + self.proj(rows_attention(qkv))
        qkv = qkv.reshape(n, 3, 1, c, h * w).transpose(3, 4)
        out = F.scaled_dot_product_attention(*qkv.unbind(1))  # (N, 1 head, HW, C): ONNX's
        return x + self.proj(out[:, 0].transpose(1, 2).reshape(n, c, h, w))  # 4-d form


def rows_attention(qkv):
    """``Attention``'s softmax(q k^T / sqrt(C)) v of ``qkv`` ``(N, 3C, H, W)``, with q, k and
    v taken from an NHWC copy: each position's channels contiguous (``stride(-1) == 1``),
    which torch's fused SDPA kernels need (on an NCHW view every call takes the math path,
    which upcasts and keeps (HW)^2 scores: CUDA review 7's N-L1). The result comes back in
    ``qkv``'s memory format, so the projection's gradient has its parameter's strides."""
    n, c3, h, w = qkv.shape
    rows = qkv.permute(0, 2, 3, 1).reshape(n, 1, h * w, c3).contiguous()  # (N, 1, HW, 3C)
    out = F.scaled_dot_product_attention(*rows.chunk(3, dim=-1))  # (N, 1, HW, C)
    out = out[:, 0].transpose(1, 2).reshape(n, c3 // 3, h, w)
    last = qkv.is_contiguous(memory_format=torch.channels_last) and not qkv.is_contiguous()
    return out.contiguous(memory_format=torch.channels_last if last else
                          torch.contiguous_format)


class UNet(nn.Module):
    """The noise predictor: ``(x_t, t) -> eps``, images and noise of the same shape.

    Args:
        channels: channels of the images (1 or 3).
        image_size: their side (``check_image_size``).
        width: channels at the full resolution (the paper's 128; MULTIPLIERS times it
            below).
        blocks: residual blocks per resolution on the way down (one more on the way up).

    Returns:
        A module mapping ``x`` ``(N, channels, side, side)`` and ``t`` ``(N,)`` (timesteps,
        integer or float) to the predicted noise ``(N, channels, side, side)``.
    """

    def __init__(self, channels, image_size, width=64, blocks=2):
        super().__init__()
        check_image_size(image_size)
        self.channels, self.image_size, self.width = channels, image_size, width
        emb = 4 * width
        self.embed = nn.Sequential(nn.Linear(width, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        levels = [width * m for m in MULTIPLIERS]
        self.down, skips, c = nn.ModuleList(), [width], width
        for i, out in enumerate(levels):
            for _ in range(blocks):
                self.down.append(ResBlock(c, out, emb))
                c = out
                skips.append(c)
                if i == len(levels) - 1:
                    self.down.append(Attention(c))
            if i < len(levels) - 1:
                self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))  # side / 2
                skips.append(c)
        self.middle = nn.ModuleList([ResBlock(c, c, emb), Attention(c),
                                     ResBlock(c, c, emb)])
        self.up = nn.ModuleList()
        for i, out in reversed(list(enumerate(levels))):
            for _ in range(blocks + 1):
                self.up.append(ResBlock(c + skips.pop(), out, emb))
                c = out
                if i == len(levels) - 1:
                    self.up.append(Attention(c))
            if i > 0:
                self.up.append(nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                             nn.Conv2d(c, c, 3, padding=1)))
        self.out = nn.Sequential(_norm(c), nn.SiLU(), nn.Conv2d(c, channels, 3, padding=1))
        nn.init.zeros_(self.out[-1].weight)  # the paper's: the first prediction is zero
        nn.init.zeros_(self.out[-1].bias)

    def forward(self, x, t):
        emb = self.embed(timestep_embedding(t, self.width))  # (N, 4 width)
        h = self.stem(x)
        hs = [h]
        for layer in self.down:
            if isinstance(layer, ResBlock):
                h = layer(h, emb)
            else:
                h = layer(h)
            if not isinstance(layer, Attention):  # its output replaces its block's
                hs.append(h)
            else:
                hs[-1] = h
        for layer in self.middle:
            h = layer(h, emb) if isinstance(layer, ResBlock) else layer(h)
        for layer in self.up:
            if isinstance(layer, ResBlock):
                h = layer(torch.cat([h, hs.pop()], dim=1), emb)
            else:
                h = layer(h)
        return self.out(h)  # (N, channels, side, side)


def build(config, channels):
    """The U-Net a run's config asks for (``image_size``, ``diffusion_width``,
    ``diffusion_blocks``), on the CPU."""
    return UNet(channels, config["image_size"], config.get("diffusion_width") or 64,
                config.get("diffusion_blocks") or 2)


class StepFlops(nn.Module):
    """One training step's work per sample as a forward pass of images alone (what
    ``ops.train_flops_per_sample`` and the summary take): the U-Net at timestep 0."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x):
        return self.unet(x, torch.zeros(len(x), device=x.device))


# ------------------------------------------------------------------ the noise schedule

def betas(kind, steps):
    """The noise schedule: ``(steps,)`` float64 betas.

    Args:
        kind: ``linear`` (Ho et al.: 1e-4 to 0.02 for 1000 steps, scaled by 1000 / steps;
            each beta at most 0.999, as the cosine's: below 20 steps the last ones would
            pass 1) or ``cosine`` (Nichol & Dhariwal: alpha-bar a squared cosine, offset
            0.008, each beta at most 0.999).
        steps: the number of diffusion steps T.
    """
    if kind == "linear":
        scale = 1000 / steps
        return torch.linspace(scale * 1e-4, scale * 0.02, steps,
                              dtype=torch.float64).clamp(max=MAX_BETA)
    if kind == "cosine":
        s = 0.008
        t = torch.arange(steps + 1, dtype=torch.float64) / steps
        alpha_bar = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=MAX_BETA)
    raise ValueError(f"unknown noise schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")


class Schedule:
    """A noise schedule's cumulative products and what the steps read of them.

    Args:
        kind: ``linear`` or ``cosine`` (``betas``).
        steps: T, the diffusion steps.
    """

    def __init__(self, kind, steps):
        self.kind, self.steps = kind, steps
        self.alpha_bar = torch.cumprod(1 - betas(kind, steps), 0)  # (T,) float64
        self._tables = {}  # device -> (sqrt(alpha_bar), sqrt(1 - alpha_bar)), float32

    def tables(self, device):
        """``sqrt(alpha_bar)`` and ``sqrt(1 - alpha_bar)`` as float32 on ``device``, made
        once per device."""
        key = str(device)
        if key not in self._tables:
            self._tables[key] = tuple(v.float().to(device) for v in
                                      (self.alpha_bar.sqrt(), (1 - self.alpha_bar).sqrt()))
        return self._tables[key]

    def q_sample(self, x0, t, noise):
        """``x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) noise``: the forward
        process at timesteps ``t`` (``(N,)`` long), in x0's shape, float32."""
        a, s = self.tables(x0.device)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        return a[t].view(shape) * x0.float() + s[t].view(shape) * noise

    def timesteps(self, sample_steps):
        """The subsequence sampling walks, from the last timestep down to 0:
        ``sample_steps`` evenly spaced timesteps (rounded), each once."""
        n = min(sample_steps, self.steps)
        picked = torch.linspace(0, self.steps - 1, n, dtype=torch.float64).round().long()
        return picked.unique().flip(0).tolist()


def training_draws(generator, n, image_shape, steps, device):
    """A step's draws, in this order from ``generator``: timesteps ``(n,)`` uniform in
    [0, steps), noise ``(n, *image_shape)`` from N(0, 1), and mirror flags ``(n,)``."""
    t = torch.randint(steps, (n,), generator=generator, device=device)
    noise = torch.randn(n, *image_shape, generator=generator, device=device)
    flips = torch.randint(2, (n,), generator=generator, device=device).bool()
    return t, noise, flips


def loss(model, schedule, x0, t, noise):
    """The noise-prediction loss (Ho et al.'s simple objective): the mean squared error
    of the predicted noise of ``x_t`` against ``noise``, float32 (under autocast too).

    Returns:
        ``(loss, per-sample losses (N,))``: the mean, and each image's own mean.
    """
    pred = model(schedule.q_sample(x0, t, noise), t)
    per_sample = F.mse_loss(pred.float(), noise, reduction="none").flatten(1).mean(1)
    return per_sample.mean(), per_sample


# ------------------------------------------------------------------------- sampling

def _chunk_key(seed, chunk):
    return (seed * 1_000_003 + chunk) % (2**63 - 1)


def _on(device, noise):
    """The CPU's ``noise`` on ``device``: from pinned memory on CUDA, so that the copy
    waits for no kernel (a pageable one would, at every step walked: the CUDA review's
    L2); the values are the CPU's draw."""
    if device.type == "cuda":
        noise = noise.pin_memory()
    return noise.to(device, non_blocking=True)


class Sampler(nn.Module):
    """The sampling loop as a module: image indices in, images out, so that an image is
    a function of (seed, its index) alone, whatever the batch it is made in.

    The noise of images ``CHUNK * c`` to ``CHUNK * c + CHUNK - 1`` comes from one CPU
    generator seeded with (seed, c): first the starting noise x_T, then DDPM's noise of
    each step (DDIM draws none after x_T), CHUNK images at a time, sliced to the images
    asked for.

    Args:
        unet: the noise predictor (sampled in eval mode by ``gan_metrics.generate``).
        schedule: its ``Schedule``.
        kind: ``ddim`` or ``ddpm``.
        steps: the timesteps walked (``--sample-steps``; None: DDIM_STEPS for DDIM, all
            of them for DDPM).
        seed: the seed of the noise.
    """

    def __init__(self, unet, schedule, kind="ddim", steps=None, seed=0):
        super().__init__()
        if kind not in SAMPLERS:
            raise ValueError(f"unknown sampler {kind!r}; choose one of {', '.join(SAMPLERS)}")
        self.unet, self.schedule, self.kind, self.seed = unet, schedule, kind, seed
        self.steps = steps or (DDIM_STEPS if kind == "ddim" else schedule.steps)
        self.shape = (unet.channels, unet.image_size, unet.image_size)

    def _noise(self, indices):
        """Generators for the chunks ``indices`` touch, and a function drawing the next
        noise of every index (``(len(indices), C, H, W)``, on the CPU)."""
        chunks = sorted({i // CHUNK for i in indices})
        gens = {c: torch.Generator().manual_seed(_chunk_key(self.seed, c)) for c in chunks}
        rows = torch.tensor([chunks.index(i // CHUNK) * CHUNK + i % CHUNK for i in indices])

        def draw():
            every = torch.cat([torch.randn(CHUNK, *self.shape, generator=gens[c])
                               for c in chunks])
            return every[rows]
        return draw

    @torch.no_grad()
    def forward(self, indices):
        device = next(self.unet.parameters()).device
        draw = self._noise([int(i) for i in indices.flatten().tolist()])
        x = _on(device, draw())  # x_T
        alpha_bar = self.schedule.alpha_bar.tolist()
        walk = self.schedule.timesteps(self.steps)
        for i, t in enumerate(walk):
            prev = walk[i + 1] if i + 1 < len(walk) else None
            a_t, a_prev = alpha_bar[t], 1.0 if prev is None else alpha_bar[prev]
            eps = self.unet(x, torch.full((len(x),), t, device=device, dtype=torch.long))
            eps = eps.float()
            x0 = ((x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)).clamp(-1, 1)
            if self.kind == "ddim":  # eta 0; the noise re-derived from the clipped x0
                eps = (x - math.sqrt(a_t) * x0) / math.sqrt(1 - a_t)
                x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
                continue
            beta = 1 - a_t / a_prev  # the subsequence's step
            mean = (math.sqrt(a_prev) * beta / (1 - a_t)) * x0 + \
                (math.sqrt(1 - beta) * (1 - a_prev) / (1 - a_t)) * x
            if prev is None:
                x = mean
            else:
                z = _on(device, draw())
                x = mean + math.sqrt(beta * (1 - a_prev) / (1 - a_t)) * z
        return x.clamp(-1, 1)  # (N, C, H, W)
