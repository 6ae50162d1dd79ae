"""The input pipeline: from files (or memory) to batches on the device.

    data.py               datasets, transforms, the seeded sampler, per-sample loaders
    segmentation_data.py  (image, mask) sets whose masks follow their images
    pair_transforms.py    the joint transforms of an image and its mask
    detection_data.py     images and their boxes: synthetic shapes, COCO-format folders
    device_data.py        the device path: whole batches gathered and augmented there
    decoded_cache.py      each image of a folder decoded once, memory-mapped
    sample_transforms.py  the (seed, epoch, index) hash and the per-sample crop and flip
    presets.py            the geometry of photos; torchvision's pretrained weights
    images.py             reading one image file safely
    sources.py            what hf_data.py and shards.py share: flags, encoded images
    hf_data.py            --dataset hf: Hugging Face datasets (saved, Parquet, cached)
    shards.py             --dataset shards: webdataset tars, local or over http(s)
    recipes.py            MixUp/CutMix, the AutoAugment family, random erasing; EMA

Imports the machinery below it (and networks.py, ops.py), never what reports or trains.
"""
