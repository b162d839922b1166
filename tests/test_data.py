"""Data sets: preparation, decoding, the loaders' slicing, and bad data directories."""

import numpy as np
import pytest
import torch

from raytrain_par import data
from raytrain_par.config import DataSpec
from raytrain_par.data.loader import MemoryLoader, StreamLoader, eval_batches
from raytrain_par.data.shards import read_split
from raytrain_par.errors import DataUnavailable


def test_kjv_rows_are_shifted_windows_of_one_token_stream(info):
    meta = data.DatasetInfo.from_json(info("kjv"))
    rows = read_split(meta, meta.train_path)["tokens"]
    assert rows.shape[1] == meta.seq_len + 1 and meta.num_train == len(rows) > 5000
    assert int(rows.max()) < meta.vocab_size and meta.vocab_size == 8192
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(meta.tokenizer_path).decode(rows[0].tolist())
    assert "LORD" in text or "God" in text or len(text) > 100


def test_images_are_uint8_with_labels(info):
    meta = data.DatasetInfo.from_json(info("fashion-mnist"))
    assert (meta.num_train, meta.num_val, meta.image_shape, meta.num_classes) == (60000, 10000, [1, 28, 28], 10)
    val = read_split(meta, meta.val_path)
    assert val["image"].dtype == torch.uint8 and val["image"].shape == (10000, 1, 28, 28)
    assert sorted(val["label"].unique().tolist()) == list(range(10))


def test_memory_loader_slices_cover_each_global_batch_once():
    arrays = {"x": torch.arange(100)}
    one = list(MemoryLoader(arrays, 8, 0, 1, seed=3).epoch(1))
    parts = [list(MemoryLoader(arrays, 8, r, 4, seed=3).epoch(1)) for r in range(4)]
    assert len(one) == 12  # 100 // 8, the incomplete batch dropped
    for step, batch in enumerate(one):
        assert torch.equal(torch.cat([p[step]["x"] for p in parts]), batch["x"])
    assert not torch.equal(one[0]["x"], next(MemoryLoader(arrays, 8, 0, 1, seed=3).epoch(2))["x"])  # reshuffled
    resumed = list(MemoryLoader(arrays, 8, 0, 1, seed=3).epoch(1, start_step=5))
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(resumed, one[5:]))
    seen = torch.cat([b["x"] for r in range(3) for b in eval_batches(arrays, 7, r, 3)])
    assert sorted(seen.tolist()) == list(range(100))


def test_stream_loader_reads_one_global_order_for_every_layout(tmp_path, monkeypatch):
    """Shards read a window at a time: every data-parallel size trains the same global batches (rank r
    its r-th slice, decoding only that), each row at most once an epoch, a resumed epoch continues at
    the exact row without reading the windows before it, and the next epoch has another order."""
    from raytrain_par.data import shards

    monkeypatch.setattr(shards, "ROWS_PER_SHARD", 10)
    shards.write_split(tmp_path, {"x": np.arange(95, dtype=np.int64)})  # 10 shards, the last of 5 rows
    decoded, read = [], []

    def decode(batch):
        decoded.append(len(batch["x"]))
        return {"x": torch.as_tensor(np.array(batch["x"]))}

    def loader(rank, size, **kw):
        return StreamLoader(str(tmp_path), decode, 8, rank, size, seed=3, window_rows=25, **kw)

    one = list(loader(0, 1).epoch(1))
    assert len(one) == 11 == loader(0, 1).steps_per_epoch  # 95 // 8, the incomplete batch dropped
    rows = torch.cat([b["x"] for b in one]).tolist()
    assert len(set(rows)) == len(rows) == 88
    assert rows[:10] != sorted(rows[:10])  # shuffled within windows
    for size in (2, 4):
        decoded.clear()
        parts = [list(loader(r, size).epoch(1)) for r in range(size)]
        assert set(decoded) == {8 // size}  # only the rank's own rows are decoded
        for step, batch in enumerate(one):
            assert torch.equal(torch.cat([p[step]["x"] for p in parts]), batch["x"])
    resumed = loader(0, 1)
    real_window = resumed._window
    monkeypatch.setattr(resumed, "_window", lambda e, w, s: read.append(w) or real_window(e, w, s))
    again = list(resumed.epoch(1, start_step=7))
    assert [b["x"].tolist() for b in again] == [b["x"].tolist() for b in one[7:]]
    assert read and read[0] > 0  # windows wholly before step 7 were not read
    assert next(loader(0, 1).epoch(2))["x"].tolist() != one[0]["x"].tolist()


def test_wikitext_directory(tmp_path):
    article = " = Title {i} =\n\n The quick brown fox jumps over the lazy dog {i} times .\n" * 3
    (tmp_path / "wiki.train.tokens").write_text("".join(article.format(i=i) for i in range(200)))
    (tmp_path / "wiki.valid.tokens").write_text("".join(article.format(i=i) for i in range(20)))
    spec = DataSpec(name="wikitext-103", path=str(tmp_path), seq_len=16, vocab_size=300)
    meta = data.prepare(spec, tmp_path / "cache", log=lambda *_: None)
    assert meta.num_train > 10 and meta.num_val > 1 and meta.vocab_size <= 300
    assert read_split(meta, meta.train_path)["tokens"].shape[1] == 17


def test_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(tmp_path / split / cls / f"{i}.png")
    spec = DataSpec(name="imagenet-folder", path=str(tmp_path), image_size=16)
    meta = data.prepare(spec, tmp_path / "cache", log=lambda *_: None)
    assert (meta.num_train, meta.num_val, meta.num_classes, meta.image_shape) == (12, 4, 2, [3, 16, 16])
    train = read_split(meta, meta.train_path)  # decoded from the files: resized, centre-cropped
    labels = train["label"].tolist()  # stored in a seeded order, not class by class
    assert train["image"].shape == (12, 3, 16, 16) and sorted(labels) == [0] * 6 + [1] * 6 != labels
    assert read_split(meta, meta.val_path)["label"].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("name,layout,words", [
    ("wikitext-103", {}, "no wiki.train.tokens or wiki.train.raw there"),
    ("wikitext-103", {"wiki.train.tokens": "", "wiki.valid.tokens": "x"}, "holds no text"),
    ("imagenet-folder", {}, "no 'train' directory inside"),
    ("imagenet-folder", {"train/cat/readme.txt": "x", "val/cat/readme.txt": "x"}, "no images under"),
])
def test_bad_data_directory_is_refused(tmp_path, name, layout, words):
    for rel, text in layout.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    with pytest.raises(DataUnavailable) as err:
        data.prepare(DataSpec(name=name, path=str(tmp_path)), tmp_path / "cache", log=lambda *_: None)
    assert words in str(err.value) and "fix" in str(err.value)
    assert not list((tmp_path / "cache").glob("datasets/*/info.json"))  # nothing half-written left behind
