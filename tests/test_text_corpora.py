"""`data: {name: text}`: the user's txt / JSONL / Parquet files, a BPE trained on them or the user's own
tokenizer, batch-wise preparation, the cache, every bad input refused with field and fix, and a
WikiText-103 directory streamed through Ray."""

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_par import config, data
from raytrain_par.config import DataSpec
from raytrain_par.data import documents, shards, text
from raytrain_par.data.shards import read_split
from raytrain_par.errors import DataUnavailable

QUIET = dict(log=lambda *_: None)
WORDS = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(5, 30))) for _ in range(n)]


def write_corpus(root, fmt: str, docs: list[str], files: int = 2, field: str = "text") -> str:
    """`docs` split over `files` files of format `fmt` under root/corpus; returns the glob of them."""
    (root / "corpus" / "sub").mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(np.array(docs, dtype=object), files)):
        f = root / "corpus" / ("sub" if i % 2 else "") / f"part{i}.{fmt}"
        if fmt == "txt":
            f.write_text("\n\n".join(part) + "\n")  # blank lines between documents are skipped
        elif fmt == "jsonl":
            f.write_text("".join(json.dumps({"id": j, field: d}) + "\n" for j, d in enumerate(part)))
        else:
            pq.write_table(pa.table({"id": list(range(len(part))), field: list(part)}), f)
    return str(root / "corpus" / "**" / f"*.{fmt}")


def rows_in_one_piece(info, docs: list[str]) -> np.ndarray:
    """The rows of the documents tokenized all at once with the set's tokenizer, <|endoftext|> (0) after each."""
    from tokenizers import Tokenizer

    encoded = Tokenizer.from_file(info.tokenizer_path).encode_batch(docs)
    return text.rows(np.concatenate([np.array(e.ids + [0], dtype=np.int32) for e in encoded]), info.seq_len)


def prepare(tmp_path, **keys):
    return data.prepare(DataSpec(name="text", **{"seq_len": 16, "vocab_size": 300, **keys}), tmp_path / "cache", **QUIET)


@pytest.mark.parametrize("fmt,field", [("txt", "text"), ("jsonl", "body"), ("parquet", "content")])
def test_corpus_of_each_format_is_prepared_once(tmp_path, fmt, field):
    path = write_corpus(tmp_path, fmt, sentences(300), field=field)
    keys = dict(path=path) if fmt == "txt" else dict(path=path, field=field)
    info = prepare(tmp_path, **keys)
    train, val = read_split(info, info.train_path)["tokens"], read_split(info, info.val_path)["tokens"]
    assert train.shape == (info.num_train, 17) and val.shape == (info.num_val, 17)
    assert info.num_val == round(0.05 * (info.num_train + info.num_val))  # the default 5% held out
    assert 256 < info.vocab_size <= 300 and int(train.max()) < info.vocab_size
    assert info.tokenizer_path.endswith(".json") and data.tokenizer_vocab_size(DataSpec(name="text", path=path)) is None
    from tokenizers import Tokenizer

    first = Tokenizer.from_file(info.tokenizer_path).decode(train[0].tolist(), skip_special_tokens=False)
    assert set(first.replace(text.EOT, " ").split()[:-1]) <= set(WORDS)  # the last word may go on in the next row
    assert prepare(tmp_path, **keys) == info  # the cache is used: same directory, no new preparation
    assert len(list((tmp_path / "cache" / "datasets").iterdir())) == 1


def test_edited_corpus_is_prepared_again(tmp_path):
    path = write_corpus(tmp_path, "txt", sentences(200), files=1)
    first = prepare(tmp_path, path=path)
    write_corpus(tmp_path, "txt", sentences(400), files=1)
    second = prepare(tmp_path, path=path)
    assert second.train_path != first.train_path and second.num_train > first.num_train


def test_batches_and_shards_give_the_rows_of_the_corpus_in_one_piece(tmp_path, monkeypatch):
    """Tokenized 7 documents at a time into shards of 5 rows: the same rows, the same held-out split, as
    tokenizing the whole corpus at once and splitting its rows."""
    monkeypatch.setattr(text, "ENCODE_BATCH", 7)
    monkeypatch.setattr(shards, "ROWS_PER_SHARD", 5)
    path = write_corpus(tmp_path, "jsonl", sentences(120), files=3)
    info = prepare(tmp_path, path=path, val_fraction=0.2, seed=3)
    assert len(list((tmp_path / "cache").glob("datasets/*/train/*.parquet"))) > 10
    found = documents.files(path)  # sorted: corpus/part0, corpus/part2, corpus/sub/part1
    assert [f.name for f in found] == ["part0.jsonl", "part2.jsonl", "part1.jsonl"]
    rows = rows_in_one_piece(info, list(documents.documents(found, "jsonl", "text")))
    tr, va = shards.split_rows(len(rows), 0.2, 3)
    assert torch.equal(read_split(info, info.train_path)["tokens"], torch.from_numpy(rows[tr]))
    assert torch.equal(read_split(info, info.val_path)["tokens"], torch.from_numpy(rows[va]))


def test_users_tokenizer_is_used_and_its_size_recorded(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    docs = sentences(300)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=280, special_tokens=["<s>", "</s>"], show_progress=False)
    (tmp_path / "tok").mkdir()
    bpe.save(str(tmp_path / "tok" / "tokenizer.json"))
    spec = DataSpec(name="text", path=write_corpus(tmp_path, "parquet", docs), tokenizer=str(tmp_path / "tok"),
                    seq_len=16)
    size = bpe.get_vocab_size()
    assert data.tokenizer_vocab_size(spec) == size and data.shape_of(spec).vocab_size == size
    info = data.prepare(spec, tmp_path / "cache", **QUIET)
    assert info.vocab_size == size and info.tokenizer_path == str((tmp_path / "tok" / "tokenizer.json").resolve())
    tokens = read_split(info, info.train_path)["tokens"]
    eos = bpe.token_to_id("</s>")
    assert (tokens == eos).any() and not (tokens == bpe.token_to_id("<s>")).any()  # documents end with </s>


def test_tokenizer_without_end_of_document_token_joins_documents():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["a b c"], vocab_size=260, show_progress=False)
    assert text.eos_id(bpe) is None
    assert next(text.token_chunks(bpe, ["a", "b"])).tolist() == bpe.encode("a").ids + bpe.encode("b").ids


def test_wikitext_is_a_preset_of_the_same_path(tmp_path):
    """Articles split at title lines, validated on wiki.valid; a user tokenizer works there too."""
    article = " = Title {i} = \n\n The quick brown fox jumps over the lazy dog {i} times .\n"
    (tmp_path / "wiki.train.tokens").write_text("".join(article.format(i=i) for i in range(100)))
    (tmp_path / "wiki.valid.tokens").write_text("".join(article.format(i=i) for i in range(10)))
    docs = list(text.wikitext_documents(tmp_path / "wiki.train.tokens"))
    assert len(docs) == 100 and docs[0].startswith(" = Title 0 =")
    info = data.prepare(DataSpec(name="wikitext-103", path=str(tmp_path), seq_len=8, vocab_size=300),
                        tmp_path / "cache", **QUIET)
    val = list(text.wikitext_documents(tmp_path / "wiki.valid.tokens"))
    assert torch.equal(read_split(info, info.val_path)["tokens"], torch.from_numpy(rows_in_one_piece(info, val)))


# -- one global order under every layout ---------------------------------------------------------

def test_a_streamed_corpus_trains_one_processs_losses_under_every_layout(tmp_path, monkeypatch):
    """A JSONL corpus with the default loader (stream, from several shards): one process, zero-3 on 2
    workers, megatron T=2 and a 2-stage pipeline train the same rows, so the same losses. (Reading rows
    per worker, the 2-worker zero-3 run's losses were 4e-3 apart from one process's.)"""
    from engines import experiment, train_cases

    from raytrain_par.local_group import run_ranks

    monkeypatch.setattr(shards, "ROWS_PER_SHARD", 64)  # several shards, in two windows an epoch
    keys = {"name": "text", "path": write_corpus(tmp_path, "jsonl", sentences(600), files=3, field="body"),
            "field": "body", "seq_len": 16, "vocab_size": 300, "cache_dir": str(tmp_path / "cache")}
    one = experiment(data=keys, steps=3, batch=16)
    assert config.from_dict(one).data.effective_loader == "stream"
    info = data.prepare(config.from_dict(one).data, tmp_path / "cache", **QUIET)
    assert len(list(Path(info.train_path).glob("*.parquet"))) > 2
    layouts = {"zero-3": "zero-3", "megatron T=2": {"name": "megatron", "tensor_parallel": 2},
               "pipeline 2 stages": {"name": "pipeline", "stages": 2, "microbatches": 2}}
    cases = [(experiment(data=keys, strategy=s, workers=2, steps=3, batch=16), info.to_json(), 3)
             for s in layouts.values()]
    (reference,), = run_ranks(1, train_cases, [(one, info.to_json(), 3)])
    ranks = run_ranks(2, train_cases, cases)
    assert reference["losses"][-1] < reference["losses"][0]
    for name, got in zip(layouts, ranks[0]):
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5), name


# -- bad inputs ---------------------------------------------------------------------------------

def _jsonl(tmp_path, lines):
    (tmp_path / "c.jsonl").write_text("".join(lines))
    return str(tmp_path / "c.jsonl")


def _tree(tmp_path, files: dict) -> str:
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    return str(tmp_path / "*")


BAD_FILES = [
    # (data keys given the tmp_path, field named, words of the problem, words of the fix)
    (lambda p: dict(path=str(p / "nothing" / "*.txt")), "data.path", "matches no files", "give a glob"),
    (lambda p: dict(path=_jsonl(p, ['{"body": "hello"}\n'])), "data.field = 'text'", "has no key 'text' (its keys: 'body')",
     "data.field: body"),
    (lambda p: dict(path=_jsonl(p, ['{"text": 3}\n'])), "data.field", "holds a value of type int under 'text'", "set data.field"),
    (lambda p: dict(path=_jsonl(p, ['{"text": "a"}\n', "not json\n"])), "data.format = 'jsonl'", "line 2", "data.format: txt"),
    (lambda p: dict(path=_jsonl(p, ['["a list"]\n'])), "data.format = 'jsonl'", "not an object", "one object per line"),
    (lambda p: dict(path=_jsonl(p, ['{"text": "  "}\n', "\n"])), "data.path", "holds no text", "one JSON object per line"),
    (lambda p: dict(path=_tree(p, {"a.txt": "\n\n", "b.txt": " \n"})), "data.path", "holds no text", "one document per line"),
    (lambda p: dict(path=_tree(p, {"a.txt": "x\n", "b.jsonl": "{}\n"})), "data.path", "several formats (1 jsonl, 1 txt)",
     "narrow data.path"),
    (lambda p: dict(path=_tree(p, {"a.md": "x\n"})), "data.format", "does not say its format",
     "set data.format to one of txt, jsonl, parquet"),
    (lambda p: dict(path=_tree(p, {"a.txt": "x\n"}), tokenizer=str(p)), "data.tokenizer", "no tokenizer.json there",
     "remove it to train a byte-level BPE"),
    (lambda p: dict(path=_tree(p, {"a.txt": "x\n", "tokenizer.json": "{"}), format="txt", tokenizer=str(p)),
     "data.tokenizer", "cannot be read as a tokenizer", "save it again"),
    (lambda p: dict(path=_tree(p, {"a.parquet": "x"})), "data.format = 'parquet'", "is not a Parquet file", "leave it out"),
]


@pytest.mark.parametrize("keys,field,problem,fix", BAD_FILES, ids=[b[2] for b in BAD_FILES])
def test_bad_corpus_is_refused_before_preparing(tmp_path, keys, field, problem, fix):
    with pytest.raises(DataUnavailable) as err:
        data.prepare(DataSpec(name="text", **keys(tmp_path)), tmp_path / "cache", **QUIET)
    message = str(err.value)
    assert message.startswith(field) or f" {field}" in message, message
    assert problem in message and "fix: " in message and fix in message.split("fix: ")[1], message
    assert not (tmp_path / "cache" / "datasets").exists()  # found by the checks, before anything is written


def test_parquet_without_the_column_names_the_columns_it_has(tmp_path):
    pq.write_table(pa.table({"id": [1], "body": ["hello"]}), tmp_path / "c.parquet")
    for field, words in (("text", "has no column 'text' (its columns: id, body)"), ("id", "holds int64, not strings")):
        with pytest.raises(DataUnavailable, match=r"data.field = '\w+'") as err:
            data.check_available(DataSpec(name="text", path=str(tmp_path / "*.parquet"), field=field))
        assert words in str(err.value) and "fix: set data.field" in str(err.value)


def test_corpus_too_short_for_one_row_names_seq_len(tmp_path):
    with pytest.raises(DataUnavailable, match="data.seq_len = 512: the corpus is too short"):
        prepare(tmp_path, path=_tree(tmp_path, {"a.txt": "one short line\n"}), seq_len=512)


def test_experiment_with_a_bad_corpus_fails_on_load(tmp_path):
    """load_experiment checks the files, before any Ray worker exists."""
    f = tmp_path / "e.yaml"
    f.write_text(json.dumps({"name": "t", "model": "gpt2-tiny", "data": {"name": "text", "path": str(tmp_path / "*.jsonl")},
                             "train": {"max_steps": 1}}))
    with pytest.raises(DataUnavailable, match="matches no files"):
        config.load_experiment(f)
    assert config.load_experiment(f, check_data=False).data.effective_loader == "stream"


# -- through Ray --------------------------------------------------------------------------------

@pytest.mark.ray
def test_wikitext_directory_streams_through_ray_joining_a_running_cluster(ray_cluster, tmp_path):
    """A WikiText-103-format directory (articles under title lines, wiki.train / wiki.valid), streamed
    to the workers by Ray Data (the preset's loader), trained by `raytrain-par run --address HOST:PORT`
    joining the suite's running cluster as the README's command joins a head: it says so, starts no
    cluster of its own, and the run learns."""
    import subprocess
    import sys

    import yaml

    from raytrain_par.metrics.records import read_records

    article = " = {title} = \n\n {body} \n"
    for split, docs in (("train", sentences(1500)), ("valid", sentences(100, seed=1))):
        (tmp_path / f"wiki.{split}.tokens").write_text(
            "".join(article.format(title=f"Article {i}", body=d) for i, d in enumerate(docs)))
    experiment = tmp_path / "wikitext.yaml"
    experiment.write_text(yaml.safe_dump({
        "name": "wikitext", "output_dir": str(tmp_path / "results"), "model": {"name": "gpt2-tiny"},
        "scaling": {"num_workers": 2},
        "data": {"name": "wikitext-103", "path": str(tmp_path), "seq_len": 16, "vocab_size": 300,
                 "cache_dir": str(tmp_path / "cache"), "max_val_samples": 64},
        "train": {"global_batch_size": 16, "max_steps": 4, "eval_every_steps": 4, "lr": 3e-3}}))
    assert config.load_experiment(experiment).data.effective_loader == "stream"
    head = ray_cluster.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "raytrain-par"), "run", str(experiment),
                           "--address", head], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[:1500] + "\n[...]\n" + out[-1500:]
    assert f"joining the Ray cluster at {head}" in out and "starting an embedded Ray cluster" not in out
    records = read_records(tmp_path / "results" / "wikitext" / "metrics.parquet")
    assert [r["step"] for r in records] == [0, 4]
    assert records[-1]["val_loss"] < records[0]["val_loss"]
