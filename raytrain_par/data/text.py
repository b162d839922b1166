"""Text corpora -> byte-level BPE token ids -> rows of seq_len + 1 tokens.

The tokenizer is trained on the corpus itself with `tokenizers` (seconds for the Bible), so
nothing is downloaded and the vocabulary size is a knob of the experiment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from ..errors import DataUnavailable

EOT = "<|endoftext|>"
BIBLE_DATA = Path("/usr/lib/bible.data")


def kjv_available() -> None:
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


WIKITEXT_FILES = {"train": ("wiki.train.tokens", "wiki.train.raw"), "val": ("wiki.valid.tokens", "wiki.valid.raw")}


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


def wikitext_documents(file: Path) -> list[str]:
    """Articles of a Wikitext file: a new article starts at a ' = Title = ' line."""
    docs, cur = [], []
    with open(file, encoding="utf-8") as f:
        for line in f:
            if re.match(r"^ = [^=].* = $", line.rstrip("\n")) and cur:
                docs.append("".join(cur))
                cur = []
            cur.append(line)
    if cur:
        docs.append("".join(cur))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataUnavailable(f"{file} holds no text; fix: check that the file is not empty or truncated")
    return docs


def train_tokenizer(documents: list[str], vocab_size: int, out: Path, max_chars: int = 50_000_000):
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


def token_stream(tokenizer, documents: list[str]) -> np.ndarray:
    """All documents as one int32 stream, each followed by <|endoftext|> (id 0)."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[np.ndarray] = []
    for enc in tokenizer.encode_batch(documents):
        ids.append(np.asarray(enc.ids, dtype=np.int32))
        ids.append(np.asarray([eot], dtype=np.int32))
    return np.concatenate(ids)


def rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len inputs; each row carries one extra token for the last label."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]
