"""Reading one image file safely: only raster formats, decompression bombs and files too
long and thin to store refused, the whole image decoded at once (a truncated file fails
here), EXIF orientation applied, 16-bit and float grayscale scaled to 8 bits."""

import math
import warnings

from PIL import Image, ImageOps
from torchvision.transforms import functional as tv_functional
from torchvision.transforms import v2

# The raster formats an ImageFolder image may be in. Left free, PIL.Image.open tries about
# forty formats on any file, EPS among them (which runs Ghostscript on the file).
IMAGE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")


class UnreadableImage(OSError):
    """An image file that cannot be decoded: empty, truncated, not an image, too large."""


def _to_rgb(image):
    """An 8-bit RGB copy of a decoded image.

    16-bit (``I;16*``), 32-bit (``I``) and float (``F``) grayscale is scaled to 8 bits by
    its bit depth, not clipped at 255: 16 bits for ``I;16*``; for ``I`` and ``F`` the
    smallest of 8, 16 or 31 (signed 32) bits that holds the largest value, or [0, 1] for
    floats up to 1.
    """
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        top = image.getextrema()[1]
        if image.mode.startswith("I;16"):
            full = 2**16 - 1
        elif image.mode == "F" and top <= 1:
            full = 1
        else:
            full = next((2**b - 1 for b in (8, 16, 31) if top < 2**b), top)
        mode = "F" if image.mode == "F" else "I"
        image = image.convert(mode).point(lambda v: v * 255 / full).convert("L")
    return image.convert("RGB")  # palette, LA, RGBA, CMYK... (and always a copy)


def load_image(path, short_side=None, interpolation=None, oriented=True):
    """Reads an image file fully into an 8-bit RGB PIL image (ImageFolder's loader).

    Only ``IMAGE_FORMATS`` are tried (never EPS/PostScript or PDF). A decompression bomb
    (more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels) counts as unreadable. The whole image
    is decoded here, so a truncated file fails here and not later in a transform. An EXIF
    orientation (what a phone's camera writes) is applied, as users expect.

    Args:
        path: the image file.
        short_side: resize so that the short side is this (aspect kept; the long side
            truncated, as torchvision's ``Resize(int)``); a JPEG much larger than that is
            decoded at 1/2, 1/4 or 1/8 of its size first (PIL's draft mode: no smaller
            than needed), several times faster. None: the image as it is.
        interpolation: a ``v2.InterpolationMode`` for that resize (default bilinear).
        oriented: apply the EXIF orientation; False: the pixels as stored (what a COCO
            json's boxes and sizes describe, as torchvision's COCO reference reads them).

    Returns:
        The RGB image (see ``_to_rgb`` for 16-bit, 32-bit and float grayscale).

    Raises:
        UnreadableImage: the file cannot be read; the message says why.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=IMAGE_FORMATS) as image:
                if short_side is not None:  # before decoding: its size is in the header
                    check_stored_size(*image.size, short_side)
                if short_side is not None and image.format == "JPEG":
                    scale = short_side / min(image.size)
                    if scale < 0.5:  # only then can the decoder skip work
                        image.draft("RGB", tuple(math.ceil(s * scale) for s in image.size))
                image.load()
                image = _to_rgb(ImageOps.exif_transpose(image) if oriented else image)
    except UnreadableImage:
        raise
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, EOFError...
        reason = str(e).splitlines()[0] if str(e) else "no message"
        raise UnreadableImage(f"{type(e).__name__}: {reason}") from e
    if short_side is None:
        return image
    mode = interpolation or v2.InterpolationMode.BILINEAR
    stored = image.resize(stored_size(*image.size, short_side),
                          tv_functional.pil_modes_mapping[mode])
    stored.info["source_size"] = image.size  # upscaled ones: one line for a whole set
    return stored


# A photo is stored with its short side at --image-size / --crop-pct and its long side in
# proportion: a thin strip (a 113-byte 1x8000 PNG) would become hundreds of megabytes.
# Beyond this many squares of the short side (an aspect ratio of 32:1; a panorama is
# 2:1 to 8:1), it is skipped as unreadable: training sees a crop of aspect 3:4 to 4:3,
# so most of such an image is never used, and one file should not cost gigabytes.
MAX_STORED_SQUARES = 32


def check_stored_size(width, height, side):
    """Raises UnreadableImage when an image of ``width`` x ``height`` would be stored
    (its short side at ``side``) larger than ``MAX_STORED_SQUARES`` squares of ``side``:
    the size it is decoded to decides, not the file's own pixels."""
    w, h = stored_size(width, height, side) if min(width, height) > 0 else (0, 0)
    if w * h > MAX_STORED_SQUARES * side * side:
        raise UnreadableImage(
            f"{width}x{height} px, stored at {w}x{h} ({w * h * 3 / 2**20:.1f} MiB decoded): "
            f"more than {MAX_STORED_SQUARES} times a square {side} px image, too long and "
            f"thin to train on")


def stored_size(width, height, side):
    """``(width, height)`` with the short side at ``side``, the long one in proportion
    (truncated, as torchvision's ``Resize(int)``)."""
    if width <= height:
        return side, int(side * height / width)
    return int(side * width / height), side
