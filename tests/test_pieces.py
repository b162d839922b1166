"""Pieces and the one re-sharding function (strategies/pieces.py), without a process group: a rank's piece of
a tensor, filled from whatever pieces a checkpoint stored, is exactly that part of the whole tensor; a
checkpoint that cannot give it is refused, naming the tensor and the file."""

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from raytrain_par.strategies import tensor_parallel as tp_ops
from raytrain_par.strategies.pieces import (PIECES_FILE, PIECES_INDEX, Piece, PieceError, PieceWriter, Source,
                                            Stored, read_pieces)
from raytrain_par.strategies.tensor_split import split_piece


def _filled(source: Source, name: str, piece: Piece, local_shape, fill=-1.0) -> torch.Tensor:
    return source.read_into(name, piece, torch.full(local_shape, fill))


def _stored_as(tmp_path, name: str, full: torch.Tensor, boxes: list[tuple[tuple, tuple]]) -> Source:
    """`full` stored as the given boxes (start, size), each in a file of its own."""
    source = Source()
    for i, (start, size) in enumerate(boxes):
        part = full[tuple(slice(a, a + n) for a, n in zip(start, size))].contiguous()
        path = tmp_path / f"rank{i}.safetensors"
        save_file({name: part}, str(path))
        source.add(name, full.shape, full.dtype, Stored(path, name, tuple(start), tuple(size)))
    return source


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (4, 1, 3, 2)])
def test_a_flat_range_is_the_row_major_elements_of_the_tensor(shape):
    """DeepSpeed's partitions: every range [lo, hi) of the flattened tensor, as the boxes it is made of
    (at most two per dimension), fills a 1-D tensor with exactly those elements."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    n = full.numel()
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            piece = Piece.flat(shape, lo, hi - lo)
            assert piece.numel == hi - lo and len(piece.regions) <= 2 * len(shape)
            out = torch.full((hi - lo,), -1.0)
            for r in piece.regions:
                r.view(out).copy_(full[tuple(slice(a, a + k) for a, k in zip(r.start, r.size))])
            assert torch.equal(out, full.reshape(-1)[lo:hi]), (shape, lo, hi)


@pytest.mark.parametrize("split,vocab,shape", [
    ((1, 3), False, (8, 24)),  # GPT-2's fused q, k, v (Conv1D [in, 3 x out]): each cut over the ranks
    ((1, 1), False, (8, 16)),  # column-parallel
    ((0, 1), False, (16, 8)),  # row-parallel (Conv1D [in, out]) / column-parallel nn.Linear
    ((0, 1), True, (11, 4)),  # the vocabulary, 11 rows: padded to a multiple of the ranks
])
@pytest.mark.parametrize("ranks", [2, 4])
def test_megatrons_cut_is_the_shard_megatron_holds(tmp_path, split, vocab, shape, ranks):
    """A tensor-parallel rank's piece, read from a whole stored tensor, is `tensor_parallel.shard` of it (the
    vocabulary padded with zero rows first, as the split model holds it)."""
    full = torch.randn(shape)
    source = _stored_as(tmp_path, "w", full, [((0,) * len(shape), shape)])
    padded = full
    if vocab:
        rows = -(-shape[0] // ranks) * ranks
        padded = torch.cat([full, full.new_zeros(rows - shape[0], *shape[1:])])
    for rank in range(ranks):
        expected = tp_ops.shard(padded, *split, rank, ranks)
        piece = split_piece(tuple(expected.shape), split, vocab, shape[0], rank, ranks)
        assert piece.shape == shape
        got = _filled(source, "w", piece, expected.shape, fill=0.0)
        assert torch.equal(got, expected), (rank, split)
        # FSDP's rows of that shard (megatron x fsdp): the same elements, cut again
        rows = expected.shape[0]
        for a, b in ((0, rows // 2), (rows // 2, rows)):
            inner = piece.within((a, 0), (b - a, expected.shape[1]))
            assert torch.equal(_filled(source, "w", inner, (b - a, expected.shape[1]), fill=0.0), expected[a:b])


def test_any_layout_reads_the_pieces_of_any_other(tmp_path):
    """Stored as row slices of three ranks (FSDP's uneven shards), read as column boxes, a flat range that
    crosses every file, and the whole: each equals that part of the tensor."""
    full = torch.randn(7, 6)
    source = _stored_as(tmp_path, "w", full, [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (1, 6))])
    assert torch.equal(_filled(source, "w", Piece.box((7, 6), (0, 2), (7, 3)), (7, 3)), full[:, 2:5])
    assert torch.equal(_filled(source, "w", Piece.flat((7, 6), 5, 33), (40,))[:33], full.reshape(-1)[5:38])
    assert torch.equal(source.read("w"), full)
    # into a tensor of another dtype: cast as it is copied
    assert torch.equal(source.read_into("w", Piece.whole((7, 6)), torch.empty(7, 6, dtype=torch.bfloat16)),
                       full.to(torch.bfloat16))


def test_a_checkpoint_that_cannot_give_a_piece_is_refused_naming_the_tensor_and_the_file(tmp_path):
    full = torch.randn(6, 4)
    gap = _stored_as(tmp_path, "h.0.w", full, [((0, 0), (2, 4)), ((4, 0), (2, 4))])  # rows 2:4 missing
    with pytest.raises(PieceError) as err:
        _filled(gap, "h.0.w", Piece.whole((6, 4)), (6, 4))
    assert "h.0.w" in str(err.value) and "rank0.safetensors, rank1.safetensors" in str(err.value) \
        and "cover 16 of the 24 elements of [0:6, 0:4]" in str(err.value)
    # a rank whose piece lies in the stored part reads it
    assert torch.equal(_filled(gap, "h.0.w", Piece.box((6, 4), (4, 0), (2, 4)), (2, 4)), full[4:])
    with pytest.raises(PieceError, match=r"h.0.w: the checkpoint's rank0.safetensors, rank1.safetensors holds it "
                                         r"at shape \[6, 4\], this model's is \[6, 5\]"):
        _filled(gap, "h.0.w", Piece.whole((6, 5)), (6, 5))
    with pytest.raises(PieceError, match="h.1.w: not in the checkpoint"):
        _filled(gap, "h.1.w", Piece.whole((6, 4)), (6, 4))


# -- every rank writes its own pieces (PieceWriter), any layout reads them (read_pieces) -------------------

def _written_by(directory, name: str, full: torch.Tensor, pieces: list[Piece], locals_: list[torch.Tensor]):
    """Each rank's piece of `full` written by that rank, as a process of its own would."""
    sums = []
    for rank, (piece, local) in enumerate(zip(pieces, locals_)):
        writer = PieceWriter(directory, rank, [(name, piece, full.dtype)])
        writer.add(name, piece, local)
        sums.append(writer.close())
    return sums


def test_pieces_written_by_every_rank_are_read_by_another_layout(tmp_path):
    """A fused q, k, v weight written by 2 tensor-parallel ranks (a box per part each), read back as 3 ZeRO
    partitions (flat ranges, the last padded) and whole: each equals that part of the tensor. Each file is
    safetensors, its hash the one computed while writing."""
    full = torch.randn(8, 24)
    cut = [split_piece((8, 12), (1, 3), False, 8, r, 2) for r in range(2)]
    sums = _written_by(tmp_path, "qkv", full, cut, [tp_ops.shard(full, 1, 3, r, 2) for r in range(2)])
    for rank, written in enumerate(sums):
        path = tmp_path / PIECES_FILE.format(rank=rank)
        assert written == {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        assert sorted(load_file(str(path))) == ["qkv#0", "qkv#1", "qkv#2"]  # safetensors' own reader
    source = read_pieces(tmp_path)
    per = -(-full.numel() // 3)
    for rank in range(3):
        start = rank * per
        count = min(per, full.numel() - start)
        got = _filled(source, "qkv", Piece.flat((8, 24), start, count), (per,), fill=0.0)
        assert torch.equal(got[:count], full.reshape(-1)[start:start + count])
    assert torch.equal(source.read("qkv"), full)


def test_pieces_that_do_not_make_the_tensor_are_refused_before_anything_is_read(tmp_path):
    full = torch.randn(6, 4)
    rows = [Piece.box((6, 4), (0, 0), (3, 4)), Piece.box((6, 4), (3, 0), (3, 4))]
    _written_by(tmp_path, "h.0.w", full, rows, [full[:3], full[3:]])
    assert torch.equal(read_pieces(tmp_path).read("h.0.w"), full)
    # a rank's part missing: its pieces do not cover the tensor
    (tmp_path / PIECES_INDEX.format(rank=1)).rename(tmp_path / "aside.json")
    with pytest.raises(PieceError, match=r"h.0.w: its pieces in pieces-rank0.safetensors cover 12 of its 24 elements"):
        read_pieces(tmp_path)
    (tmp_path / "aside.json").rename(tmp_path / PIECES_INDEX.format(rank=1))
    # a file the index names is gone
    (tmp_path / PIECES_FILE.format(rank=1)).unlink()
    with pytest.raises(PieceError, match=r"pieces-rank1.json names pieces-rank1.safetensors, which is not in"):
        read_pieces(tmp_path)
    # two ranks wrote the same rows (a replicated tensor written twice): overlapping pieces
    _written_by(tmp_path, "h.0.w", full, [rows[0], rows[0]], [full[:3], full[:3]])
    with pytest.raises(PieceError, match=r"h.0.w: the pieces h.0.w#0 of pieces-rank0.safetensors and h.0.w#0 of "
                                         r"pieces-rank1.safetensors overlap \(\[0:3, 0:4\] and \[0:3, 0:4\]\)"):
        read_pieces(tmp_path)
    # ranks that disagree on the tensor's shape
    _written_by(tmp_path, "h.0.w", full, [rows[0], Piece.box((6, 5), (3, 0), (3, 4))], [full[:3], full[3:]])
    with pytest.raises(PieceError, match=r"h.0.w: pieces-rank1.safetensors holds it at shape \[6, 5\] F32, "
                                         r"pieces-rank0.safetensors at \[6, 4\]"):
        read_pieces(tmp_path)
