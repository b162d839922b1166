"""Text corpora -> token ids (a byte-level BPE trained on the corpus, or the user's tokenizer) -> rows
of seq_len + 1 tokens.

Every text set is a `Corpus`: a stream of training documents, the set's own validation documents
if it has them, and where its BPE is cached. `write_rows` turns one into Parquet shards without
holding the corpus or its token ids whole: documents are tokenized ENCODE_BATCH at a time, cut
into rows as they come and written shard by shard. Rows held out for validation are picked by a
seeded permutation of the row count once it is known (`shards.write_held_out`), so a corpus
that fits in memory splits exactly as it did when it was tokenized in one piece.

The tokenizer is trained on (the first 50M characters of) the corpus itself with `tokenizers`
(seconds for the Bible), so nothing is downloaded and the vocabulary size is a knob of the
experiment; `data.tokenizer: DIR` uses DIR/tokenizer.json instead.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import DataUnavailable
from .shards import DEFAULT_VAL_FRACTION, DatasetInfo, write_batches, write_held_out

EOT = "<|endoftext|>"
# End-of-document tokens looked for in a user's tokenizer, in this order.
EOS_TOKENS = (EOT, "</s>", "<|end_of_text|>", "<eos>")
ENCODE_BATCH = 1000
BIBLE_DATA = Path("/usr/lib/bible.data")


@dataclass
class Corpus:
    """Where a text set's documents come from. `train()` and `val()` return a fresh stream of
    non-blank documents each call; `val` is None when validation rows are held out of train."""

    train: Callable[[], Iterable[str]]
    bpe_file: Path  # where the BPE trained on the corpus is cached (unused with data.tokenizer)
    val: Callable[[], Iterable[str]] | None = None


def kjv_available(spec=None) -> None:
    if shutil.which("bible") is None or not BIBLE_DATA.exists():
        raise DataUnavailable(
            "data.name = 'kjv': the King James Bible is not installed on this machine.\n"
            "  fix: install the Debian package bible-kjv (`sudo apt-get install -y bible-kjv`, "
            "or `make setup`, which does it for you)"
        )


def kjv_documents() -> list[str]:
    """The King James Bible, one document per book, read with the `bible` program (bible-kjv)."""
    kjv_available()
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    books: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if m:
            books.setdefault(m.group(1), []).append(m.group(4))
    if len(books) < 60:
        raise DataUnavailable(f"the `bible` program returned {len(books)} books instead of 66; reinstall bible-kjv")
    return ["\n".join(verses) for verses in books.values()]


def kjv_corpus(spec, tokenizers: Path, key: str) -> Corpus:
    docs = kjv_documents()
    return Corpus(train=lambda: docs, bpe_file=tokenizers / f"kjv-{spec.vocab_size}.json")


WIKITEXT_FILES = {"train": ("wiki.train.tokens", "wiki.train.raw"), "val": ("wiki.valid.tokens", "wiki.valid.raw")}
WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_files(path: str | None) -> dict[str, Path]:
    """The train and validation files of a Wikitext-103 directory (tokens or raw flavour)."""
    if not path:
        raise DataUnavailable(
            "data.name = 'wikitext-103' needs data.path: the directory holding wiki.train.tokens and "
            "wiki.valid.tokens.\n  fix: set data.path to where Wikitext-103 lies on your cluster's shared storage"
        )
    root = Path(path).expanduser()
    found = {}
    for split, names in WIKITEXT_FILES.items():
        for name in names:
            if (root / name).is_file():
                found[split] = root / name
                break
        else:
            raise DataUnavailable(
                f"data.path = {path!r}: no {' or '.join(names)} there.\n"
                "  fix: point data.path at the unpacked wikitext-103 directory"
            )
    return found


def wikitext_documents(file: Path) -> Iterator[str]:
    """Articles of a Wikitext file, read line by line: a new article starts at a ' = Title = ' line."""
    cur: list[str] = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            if WIKITEXT_TITLE.match(line.rstrip("\n")) and cur:
                yield from _non_blank("".join(cur))
                cur = []
            cur.append(line)
    yield from _non_blank("".join(cur))


def _non_blank(doc: str) -> Iterator[str]:
    if doc.strip():
        yield doc


def wikitext_check(spec) -> None:
    files = wikitext_files(spec.path)
    require_text(wikitext_documents(files["train"]), f"data.path = {spec.path!r}", files["train"].name,
                 "check that the file is not empty or truncated")


def wikitext_corpus(spec, tokenizers: Path, key: str) -> Corpus:
    """Wikitext-103: articles of wiki.train, validated on wiki.valid (or on rows held out of wiki.train
    when data.val_fraction is set)."""
    files = wikitext_files(spec.path)
    val = None if spec.val_fraction else (lambda: wikitext_documents(files["val"]))
    return Corpus(train=lambda: wikitext_documents(files["train"]), val=val,
                  bpe_file=tokenizers / f"wikitext-{key}.json")


def require_text(documents: Iterable[str], field: str, what: str, fix: str) -> None:
    """Raise DataUnavailable unless the (non-blank) document stream holds at least one document."""
    if next(iter(documents), None) is None:
        raise DataUnavailable(f"{field}: {what} holds no text (not one non-blank document).\n  fix: {fix}")


# -- tokenizers ----------------------------------------------------------------------------------

def user_tokenizer_file(directory: str) -> Path:
    """DIR/tokenizer.json of `data.tokenizer: DIR` (the path of the file itself is taken too)."""
    given = Path(directory).expanduser()
    file = given if given.is_file() else given / "tokenizer.json"
    if not file.is_file():
        raise DataUnavailable(
            f"data.tokenizer = {directory!r}: no tokenizer.json there.\n"
            "  fix: point data.tokenizer at a directory holding a `tokenizers` tokenizer.json (what "
            "`Tokenizer.save` or a transformers fast tokenizer's `save_pretrained` writes), or remove it "
            "to train a byte-level BPE on the corpus")
    return file.resolve()


def load_user_tokenizer(directory: str):
    from tokenizers import Tokenizer

    file = user_tokenizer_file(directory)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise DataUnavailable(f"data.tokenizer = {directory!r}: {file} cannot be read as a tokenizer ({e}).\n"
                              "  fix: save it again with `tokenizers` (Tokenizer.save) or `save_pretrained`") from None


def train_tokenizer(documents: Iterable[str], vocab_size: int, out: Path, max_chars: int = 50_000_000):
    """Byte-level BPE trained on (up to max_chars of) the corpus; cached as a tokenizers JSON file."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    if out.exists():
        return Tokenizer.from_file(str(out))

    def texts():
        seen = 0
        for d in documents:
            yield d
            seen += len(d)
            if seen >= max_chars:
                return

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts(), vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.rename(out)
    return Tokenizer.from_file(str(out))


def eos_id(tokenizer) -> int | None:
    """The end-of-document id: the first of EOS_TOKENS the tokenizer knows (<|endoftext|>, id 0, in a
    BPE trained here). None for a user's tokenizer without any of them: documents then follow each
    other with nothing in between."""
    for token in EOS_TOKENS:
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    return None


# -- documents -> rows ---------------------------------------------------------------------------

def token_chunks(tokenizer, documents: Iterable[str], batch: int | None = None) -> Iterator[np.ndarray]:
    """The documents as one int32 token stream, in pieces of `batch` documents, each document followed
    by the end-of-document id (if the tokenizer has one). The tokenizer's own special tokens (a BOS a
    template may add) are left out."""
    eos = eos_id(tokenizer)
    tail = [np.asarray([eos], dtype=np.int32)] if eos is not None else []
    docs = iter(documents)
    while chunk := list(islice(docs, batch or ENCODE_BATCH)):
        parts = []
        for enc in tokenizer.encode_batch(chunk, add_special_tokens=False):
            parts += [np.asarray(enc.ids, dtype=np.int32), *tail]
        yield np.concatenate(parts)


def rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len inputs; each row carries one extra token for the last label."""
    n = max(0, (len(stream) - 1) // seq_len)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def row_chunks(chunks: Iterable[np.ndarray], seq_len: int) -> Iterator[dict[str, np.ndarray]]:
    """`rows` of a stream that arrives in pieces: the same rows as of the whole stream at once, with at
    most seq_len tokens carried from one piece to the next."""
    carry = np.zeros(0, dtype=np.int32)
    for chunk in chunks:
        stream = np.concatenate([carry, chunk])
        out = rows(stream, seq_len)
        carry = stream[len(out) * seq_len:]
        if len(out):
            yield {"tokens": out}


def write_rows(corpus: Corpus, spec, out: Path, common: dict) -> DatasetInfo:
    """Tokenize a corpus into out/train and out/val (see the module docstring); `spec` is the DataSpec."""
    if getattr(spec, "tokenizer", None):
        tok, tok_path = load_user_tokenizer(spec.tokenizer), user_tokenizer_file(spec.tokenizer)
    else:
        tok, tok_path = train_tokenizer(corpus.train(), spec.vocab_size, corpus.bpe_file), corpus.bpe_file

    def rows_of(documents: Callable[[], Iterable[str]]) -> Iterator[dict[str, np.ndarray]]:
        return row_chunks(token_chunks(tok, documents()), spec.seq_len)

    if corpus.val is None:
        num_train, num_val = write_held_out(rows_of(corpus.train), out, spec.val_fraction or DEFAULT_VAL_FRACTION,
                                            spec.seed)
    else:
        num_train, num_val = (write_batches(rows_of(docs), out / split)
                              for split, docs in (("train", corpus.train), ("val", corpus.val)))
    if num_train == 0 or num_val == 0:
        raise DataUnavailable(f"data.seq_len = {spec.seq_len}: the corpus is too short for one row "
                              f"({num_train} training, {num_val} validation rows).\n  fix: use a shorter data.seq_len")
    return DatasetInfo(kind="text", num_train=num_train, num_val=num_val, seq_len=spec.seq_len,
                       vocab_size=tok.get_vocab_size(), tokenizer_path=str(tok_path), **common)

