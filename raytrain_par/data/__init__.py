"""Data sets, prepared once into Parquet shards in a cache directory and read by workers.

| name            | kind  | source                                             | validation            |
|-----------------|-------|----------------------------------------------------|-----------------------|
| kjv             | text  | Debian package bible-kjv (the `bible` program)     | held-out rows         |
| wikitext-103    | text  | data.path: wiki.train.tokens / wiki.valid.tokens   | wiki.valid            |
| text            | text  | data.path: a glob of the user's txt/jsonl/parquet  | held-out rows         |
| fashion-mnist   | image | Debian package dataset-fashion-mnist (IDX files)   | the 10k test images   |
| digits          | image | scikit-learn's load_digits (inside the wheel)      | held-out rows         |
| imagenet-folder | image | data.path: train/<class>/*, val/<class>/*          | val/                  |

Each set is one `DataSet` entry in `SETS`: its kind, what `data.path` names, which optional keys it
reads, how to check it is here, its shape for sizing models, and how to build its shards. Text sets
differ only in where their documents come from (a `text.Corpus`); one code path tokenizes them all.
Every split and order is a function of `data.seed`, so the same experiment sees the same rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import DataUnavailable
from . import documents, images, text
from .shards import DEFAULT_VAL_FRACTION, DatasetInfo, atomic_dir, load_info, save_info, split_rows, write_split

__all__ = ["DatasetInfo", "DataSet", "SETS", "NAMES", "TEXT", "IMAGE", "NEEDS_PATH", "OPTIONAL_KEYS", "kind_of", "loader_of",
           "check_available", "prepare", "default_cache_dir", "shape_of", "tokenizer_vocab_size",
           "DEFAULT_VAL_FRACTION"]

# data.* keys that only some sets read (each set lists those it takes in DataSet.takes).
OPTIONAL_KEYS = ("format", "field", "tokenizer")


@dataclass(frozen=True)
class DataSet:
    """One data set: all the rest of the code asks of it. `spec` below is the experiment's DataSpec."""

    name: str
    kind: str  # "text" | "image"
    build: Callable[[Any, Path, Path, dict], DatasetInfo]  # (spec, cache dir, output dir, path fields) -> info
    shape: Callable[[Any], DatasetInfo]  # what a model needs to know, without preparing (see shape_of)
    check: Callable[[Any], None] = lambda spec: None  # raises DataUnavailable, naming the fix, if not here
    path: str = ""  # what data.path names, for messages; "" for sets that take no path
    takes: tuple[str, ...] = ()  # which OPTIONAL_KEYS the set reads
    sources: Callable[[Any], list[Path]] = lambda spec: []  # files whose sizes and times key the cache

    @property
    def loader(self) -> str:
        """The default data.loader: sets read from the user's storage may be larger than memory."""
        return "stream" if self.path else "memory"


def default_cache_dir() -> Path:
    return Path(os.environ.get("RAYTRAIN_PAR_CACHE", Path.home() / ".cache" / "raytrain-par"))


def _key(spec) -> str:
    """The cache directory's name: everything that changes the prepared rows, the input files' sizes and
    modification times included (an edited corpus is prepared again)."""
    ds = SETS[spec.name]
    fields = {k: getattr(spec, k) for k in ("name", "seq_len", "vocab_size", "val_fraction", "seed", "image_size")}
    if spec.path:
        fields["path"] = str(Path(spec.path).expanduser().resolve())
    fields.update({k: getattr(spec, k) for k in ds.takes})
    sources = ds.sources(spec) + ([text.user_tokenizer_file(spec.tokenizer)] if "tokenizer" in ds.takes
                                  and spec.tokenizer else [])
    if sources:
        fields["files"] = [[str(f.resolve()), st.st_size, st.st_mtime_ns] for f in sources for st in [f.stat()]]
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
        common = dict(name=spec.name, train_path=str(final / "train"), val_path=str(final / "val"))
        info = SETS[spec.name].build(spec, cache, tmp, common)
        save_info(tmp, info)
    return load_info(final)


def cached(spec, cache_dir: str | Path | None = None) -> DatasetInfo | None:
    """The prepared data set if it is in the cache already (nothing is prepared), else None."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return load_info(cache / "datasets" / _key(spec))


def check_available(spec) -> None:
    """Raise DataUnavailable, naming the package or path to fix, if the data set is not here."""
    ds = SETS[spec.name]
    ds.check(spec)
    if "tokenizer" in ds.takes and spec.tokenizer:
        text.load_user_tokenizer(spec.tokenizer)


def shape_of(spec) -> DatasetInfo:
    """What a model built for this data set needs to know (vocabulary and row length, or image shape
    and classes), without preparing it: for sizing models before anything runs. The vocabulary is the
    user's tokenizer's, or the one asked for (a tokenizer trained on a small corpus may end up with
    fewer tokens)."""
    return SETS[spec.name].shape(spec)


def tokenizer_vocab_size(spec) -> int | None:
    """The vocabulary size of the user's tokenizer (`data.tokenizer`); None when a BPE of
    `data.vocab_size` tokens is trained on the corpus (or the set is not text)."""
    if not getattr(spec, "tokenizer", None):
        return None
    return text.load_user_tokenizer(spec.tokenizer).get_vocab_size()


def _no_rows(spec) -> dict:
    return dict(name=spec.name, train_path="", val_path="", num_train=0, num_val=0)


# -- text ----------------------------------------------------------------------------------------

def _text_shape(spec) -> DatasetInfo:
    vocab = tokenizer_vocab_size(spec) or spec.vocab_size
    return DatasetInfo(kind="text", seq_len=spec.seq_len, vocab_size=vocab, **_no_rows(spec))


def _build_text(corpus: Callable[[Any, Path, str], text.Corpus], spec, cache: Path, out: Path,
                common: dict) -> DatasetInfo:
    return text.write_rows(corpus(spec, cache / "tokenizers", _key(spec)), spec, out, common)


def _text_set(name: str, corpus, **kw) -> DataSet:
    return DataSet(name, "text", build=partial(_build_text, corpus), shape=_text_shape, **kw)


# -- images --------------------------------------------------------------------------------------

def _image_arrays(out: Path, common: dict, train, val) -> DatasetInfo:
    (x, y), (vx, vy) = train, val
    write_split(out / "train", {"image": x, "label": y})
    write_split(out / "val", {"image": vx, "label": vy})
    mean, std = float(x.mean() / 255.0), float(x.std() / 255.0)
    return DatasetInfo(kind="image", num_train=len(x), num_val=len(vx), image_shape=list(x.shape[1:]),
                       num_classes=int(max(y.max(), vy.max()) + 1), mean=mean, std=std, **common)


def _held_out(x, y, fraction: float, seed: int):
    tr, va = split_rows(len(x), fraction, seed)
    return (x[tr], y[tr]), (x[va], y[va])


def _build_fashion(spec, cache: Path, out: Path, common: dict) -> DatasetInfo:
    train = images.fashion_mnist("train")
    if spec.val_fraction:
        return _image_arrays(out, common, *_held_out(*train, spec.val_fraction, spec.seed))
    return _image_arrays(out, common, train, images.fashion_mnist("test"))


def _build_digits(spec, cache: Path, out: Path, common: dict) -> DatasetInfo:
    return _image_arrays(out, common,
                         *_held_out(*images.digits(), spec.val_fraction or DEFAULT_VAL_FRACTION, spec.seed))


def _fixed_shape(shape: list[int], classes: int, spec) -> DatasetInfo:
    return DatasetInfo(kind="image", image_shape=list(shape), num_classes=classes, **_no_rows(spec))


def _check_image_folder(spec) -> None:
    for split in ("train", "val"):
        root = Path(spec.path or "").expanduser() / split
        if not spec.path or not root.is_dir():
            images.image_folder(spec.path, split)  # raises with the fix


def _image_folder_shape(spec) -> DatasetInfo:
    train = Path(spec.path or "").expanduser() / "train"
    classes = sum(1 for d in train.iterdir() if d.is_dir()) if spec.path and train.is_dir() else 1000
    size = spec.image_size or 224
    return DatasetInfo(kind="image", image_shape=[3, size, size], num_classes=classes, **_no_rows(spec))


def _build_image_folder(spec, cache: Path, out: Path, common: dict) -> DatasetInfo:
    size = spec.image_size or 224
    counts, classes = {}, None
    for split in ("train", "val"):
        paths, labels, classes = images.image_folder(spec.path, split)
        if split == "train":  # listed class by class: stored in a seeded order, so that each of the
            # stream loader's windows of shards holds every class (data/loader.py)
            order = np.random.default_rng(spec.seed).permutation(len(paths))
            paths, labels = paths[order], labels[order]
        counts[split] = write_split(out / split, {"path": paths, "label": labels})
    return DatasetInfo(kind="image", num_train=counts["train"], num_val=counts["val"], image_shape=[3, size, size],
                       num_classes=len(classes), mean=0.449, std=0.226, encoded_images=True,
                       extra={"classes": classes}, **common)


# -- the registry --------------------------------------------------------------------------------

SETS: dict[str, DataSet] = {ds.name: ds for ds in (
    _text_set("kjv", text.kjv_corpus, check=text.kjv_available),
    _text_set("wikitext-103", text.wikitext_corpus, check=text.wikitext_check, takes=("tokenizer",),
              path="a directory you provide (holding wiki.train.tokens and wiki.valid.tokens)",
              sources=lambda spec: list(text.wikitext_files(spec.path).values())),
    _text_set("text", documents.corpus, check=documents.check, takes=("format", "field", "tokenizer"),
              path="files you provide (data.path: a glob such as ~/corpus/**/*.jsonl)",
              sources=lambda spec: documents.files(spec.path)),
    DataSet("fashion-mnist", "image", _build_fashion, partial(_fixed_shape, [1, 28, 28], 10),
            check=lambda spec: images.fashion_available()),
    DataSet("digits", "image", _build_digits, partial(_fixed_shape, [1, 8, 8], 10)),
    DataSet("imagenet-folder", "image", _build_image_folder, _image_folder_shape, check=_check_image_folder,
            path="a directory you provide (train/<class>/*, val/<class>/*)"),
)}

NAMES = tuple(SETS)
TEXT = tuple(n for n, ds in SETS.items() if ds.kind == "text")
IMAGE = tuple(n for n, ds in SETS.items() if ds.kind == "image")
NEEDS_PATH = tuple(n for n, ds in SETS.items() if ds.path)


def kind_of(name: str) -> str:
    return SETS[name].kind


def loader_of(name: str, loader: str | None) -> str:
    """The loader a `data:` section trains with: its `loader`, else its set's default (memory for a
    name that is not a set: config.py rejects it, and a checkpoint's may predate a set)."""
    return loader or (SETS[name].loader if name in SETS else "memory")
