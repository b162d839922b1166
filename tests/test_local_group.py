"""The process groups the strategy tests run in: a rank that dies, or waits for another that never
sends, fails the call with the ranks named instead of leaving it waiting."""

import os

import pytest
import torch
import torch.distributed as dist

from raytrain_par.local_group import run_ranks


def _one_rank_exits(rank, world):
    if rank == 1:
        os._exit(3)
    return rank


def _both_ranks_receive(rank, world):
    dist.recv(torch.ones(1), src=1 - rank)  # neither sends
    return rank


def test_a_rank_that_dies_is_named():
    with pytest.raises(AssertionError, match="rank 1: exited with code 3 and no result"):
        run_ranks(2, _one_rank_exits)


def test_ranks_that_wait_for_good_are_named_after_the_timeout():
    with pytest.raises(AssertionError, match="rank 0: no result within 5 s\nrank 1: no result within 5 s"):
        run_ranks(2, _both_ranks_receive, timeout=5)
