"""Image sets -> uint8 [N, C, H, W] arrays with integer labels."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np

from ..errors import DataUnavailable

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


def fashion_available(root: Path = FASHION_DIR) -> None:
    missing = [n for pair in FASHION_FILES.values() for n in pair if not (root / n).is_file()]
    if missing:
        raise DataUnavailable(
            f"data.name = 'fashion-mnist': {', '.join(missing)} not found under {root}.\n"
            "  fix: install the Debian package dataset-fashion-mnist "
            "(`sudo apt-get install -y dataset-fashion-mnist`, or `make setup`)"
        )


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): big-endian dims after a 4-byte magic number."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise DataUnavailable(f"{path} is truncated ({arr.size} values for shape {dims}); reinstall its package")
    return arr.reshape(dims)


def fashion_mnist(split: str, root: Path = FASHION_DIR) -> tuple[np.ndarray, np.ndarray]:
    fashion_available(root)
    images, labels = FASHION_FILES[split]
    x = read_idx(root / images)[:, None, :, :]  # [N, 1, 28, 28]
    y = read_idx(root / labels).astype(np.int64)
    return x, y


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 handwritten digits (shipped inside the wheel), scaled from 0..16 to 0..255."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.clip(d.images * 16.0, 0, 255).astype(np.uint8)[:, None, :, :]
    return x, d.target.astype(np.int64)


def image_folder(path: str | None, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """An ImageNet-style folder: <path>/<split>/<class>/<image>. Returns (file paths, labels, classes)."""
    if not path:
        raise DataUnavailable(
            "data.name = 'imagenet-folder' needs data.path: a directory with train/<class>/*.JPEG and "
            "val/<class>/*.JPEG.\n  fix: set data.path to the ImageNet directory on your cluster's shared storage"
        )
    root = Path(path).expanduser() / split
    if not root.is_dir():
        raise DataUnavailable(f"data.path = {path!r}: no '{split}' directory inside.\n"
                              f"  fix: lay the images out as {path}/{split}/<class>/<image>")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files, labels = [], []
    for label, cls in enumerate(classes):
        for f in sorted((root / cls).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                files.append(str(f))
                labels.append(label)
    if not files:
        raise DataUnavailable(f"data.path = {path!r}: no images under {root}.\n"
                              f"  fix: lay the images out as {path}/{split}/<class>/<image> ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return np.asarray(files, dtype=object), np.asarray(labels, dtype=np.int64), classes


def decode_images(paths, size: int) -> np.ndarray:
    """Image files -> uint8 [N, 3, size, size]: shorter side resized to size, centre crop (the usual
    ImageNet evaluation transform)."""
    from PIL import Image

    out = np.empty((len(paths), 3, size, size), dtype=np.uint8)
    for i, p in enumerate(paths):
        with Image.open(io.BytesIO(Path(p).read_bytes()) if isinstance(p, str) else p) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = size / min(w, h)
            im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - size) // 2, (h - size) // 2
            im = im.crop((left, top, left + size, top + size))
            out[i] = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
    return out
