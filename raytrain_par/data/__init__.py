"""Data sets, prepared once into Parquet shards in a cache directory and read by workers.

| name            | kind  | source                                             | validation            |
|-----------------|-------|----------------------------------------------------|-----------------------|
| kjv             | text  | Debian package bible-kjv (the `bible` program)     | held-out rows         |
| wikitext-103    | text  | data.path: wiki.train.tokens / wiki.valid.tokens   | wiki.valid            |
| fashion-mnist   | image | Debian package dataset-fashion-mnist (IDX files)   | the 10k test images   |
| digits          | image | scikit-learn's load_digits (inside the wheel)      | held-out rows         |
| imagenet-folder | image | data.path: train/<class>/*, val/<class>/*          | val/                  |

Every split and order is a function of `data.seed`, so the same experiment sees the same rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..errors import DataUnavailable
from . import images, text
from .shards import DatasetInfo, atomic_dir, load_info, save_info, write_split

TEXT = ("kjv", "wikitext-103")
IMAGE = ("fashion-mnist", "digits", "imagenet-folder")
NAMES = TEXT + IMAGE
NEEDS_PATH = ("wikitext-103", "imagenet-folder")
# Default validation fraction for sets with no validation split of their own.
DEFAULT_VAL_FRACTION = 0.05

__all__ = ["DatasetInfo", "NAMES", "TEXT", "IMAGE", "NEEDS_PATH", "kind_of", "check_available", "prepare",
           "default_cache_dir", "shape_of"]

# Stored image shapes [C, H, W] and classes of the built-in image sets.
IMAGE_SHAPES = {"digits": ([1, 8, 8], 10), "fashion-mnist": ([1, 28, 28], 10)}


def kind_of(name: str) -> str:
    return "text" if name in TEXT else "image"


def default_cache_dir() -> Path:
    return Path(os.environ.get("RAYTRAIN_PAR_CACHE", Path.home() / ".cache" / "raytrain-par"))


def check_available(spec) -> None:
    """Raise DataUnavailable, naming the package or path to fix, if the data set is not here."""
    if spec.name == "kjv":
        text.kjv_available()
    elif spec.name == "fashion-mnist":
        images.fashion_available()
    elif spec.name == "wikitext-103":
        text.wikitext_files(spec.path)
    elif spec.name == "imagenet-folder":
        for split in ("train", "val"):
            root = Path(spec.path or "").expanduser() / split
            if not spec.path or not root.is_dir():
                images.image_folder(spec.path, split)  # raises with the fix


def shape_of(spec) -> DatasetInfo:
    """What a model built for this data set needs to know (vocabulary and row length, or image shape
    and classes), without preparing it: for sizing models before anything runs. The vocabulary is the
    one asked for (a tokenizer trained on a small corpus may end up with fewer tokens)."""
    common = dict(name=spec.name, train_path="", val_path="", num_train=0, num_val=0)
    if spec.name in TEXT:
        return DatasetInfo(kind="text", seq_len=spec.seq_len, vocab_size=spec.vocab_size, **common)
    if spec.name == "imagenet-folder":
        train = Path(spec.path or "").expanduser() / "train"
        classes = sum(1 for d in train.iterdir() if d.is_dir()) if spec.path and train.is_dir() else 1000
        size = spec.image_size or 224
        return DatasetInfo(kind="image", image_shape=[3, size, size], num_classes=classes, **common)
    shape, classes = IMAGE_SHAPES[spec.name]
    return DatasetInfo(kind="image", image_shape=list(shape), num_classes=classes, **common)


def _key(spec) -> str:
    fields = {k: getattr(spec, k) for k in ("name", "seq_len", "vocab_size", "val_fraction", "seed", "image_size")}
    if spec.path:
        fields["path"] = str(Path(spec.path).expanduser().resolve())
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return f"{spec.name}-{digest}"


def prepare(spec, cache_dir: str | Path | None = None, log=print) -> DatasetInfo:
    """Prepare (or find in the cache) the Parquet shards of a data set; returns where they are."""
    check_available(spec)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    final = cache / "datasets" / _key(spec)
    info = load_info(final)
    if info is not None:
        return info
    log(f"preparing data set {spec.name} into {final} (once; later runs reuse it)")
    with atomic_dir(final) as tmp:
        info = _build(spec, cache, tmp, final)
        save_info(tmp, info)
    return load_info(final)


def _split_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * fraction)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _build(spec, cache: Path, tmp: Path, final: Path) -> DatasetInfo:
    common = dict(name=spec.name, train_path=str(final / "train"), val_path=str(final / "val"))
    if spec.name in TEXT:
        if spec.name == "kjv":
            docs = text.kjv_documents()
            tok = text.train_tokenizer(docs, spec.vocab_size, cache / "tokenizers" / f"kjv-{spec.vocab_size}.json")
            all_rows = text.rows(text.token_stream(tok, docs), spec.seq_len)
            tr, va = _split_rows(len(all_rows), spec.val_fraction or DEFAULT_VAL_FRACTION, spec.seed)
            train_rows, val_rows = all_rows[tr], all_rows[va]
            tok_path = cache / "tokenizers" / f"kjv-{spec.vocab_size}.json"
        else:
            files = text.wikitext_files(spec.path)
            train_docs = text.wikitext_documents(files["train"])
            tok_path = cache / "tokenizers" / f"wikitext-{_key(spec)}.json"
            tok = text.train_tokenizer(train_docs, spec.vocab_size, tok_path)
            train_rows = text.rows(text.token_stream(tok, train_docs), spec.seq_len)
            if spec.val_fraction:
                tr, va = _split_rows(len(train_rows), spec.val_fraction, spec.seed)
                train_rows, val_rows = train_rows[tr], train_rows[va]
            else:
                val_rows = text.rows(text.token_stream(tok, text.wikitext_documents(files["val"])), spec.seq_len)
        if len(train_rows) == 0 or len(val_rows) == 0:
            raise DataUnavailable(f"data.seq_len = {spec.seq_len}: the corpus is too short for one row.\n"
                                  "  fix: use a shorter data.seq_len")
        write_split(tmp / "train", {"tokens": train_rows})
        write_split(tmp / "val", {"tokens": val_rows})
        return DatasetInfo(kind="text", num_train=len(train_rows), num_val=len(val_rows), seq_len=spec.seq_len,
                           vocab_size=tok.get_vocab_size(), tokenizer_path=str(tok_path), **common)

    if spec.name == "imagenet-folder":
        size = spec.image_size or 224
        counts, classes = {}, None
        for split, out in (("train", "train"), ("val", "val")):
            paths, labels, classes = images.image_folder(spec.path, split)
            counts[out] = write_split(tmp / out, {"path": paths, "label": labels})
        return DatasetInfo(kind="image", num_train=counts["train"], num_val=counts["val"], image_shape=[3, size, size],
                           num_classes=len(classes), mean=0.449, std=0.226, encoded_images=True,
                           extra={"classes": classes}, **common)

    if spec.name == "fashion-mnist":
        x, y = images.fashion_mnist("train")
        if spec.val_fraction:
            tr, va = _split_rows(len(x), spec.val_fraction, spec.seed)
            (x, y), (vx, vy) = (x[tr], y[tr]), (x[va], y[va])
        else:
            vx, vy = images.fashion_mnist("test")
    else:  # digits
        x, y = images.digits()
        tr, va = _split_rows(len(x), spec.val_fraction or DEFAULT_VAL_FRACTION, spec.seed)
        (x, y), (vx, vy) = (x[tr], y[tr]), (x[va], y[va])
    write_split(tmp / "train", {"image": x, "label": y})
    write_split(tmp / "val", {"image": vx, "label": vy})
    mean, std = float(x.mean() / 255.0), float(x.std() / 255.0)
    return DatasetInfo(kind="image", num_train=len(x), num_val=len(vx), image_shape=list(x.shape[1:]),
                       num_classes=int(max(y.max(), vy.max()) + 1), mean=mean, std=std, **common)

