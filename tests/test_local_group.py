"""The process groups the strategy tests run in: a rank that dies, or waits for another that never
sends, fails the call with the ranks named instead of leaving it waiting."""

import os
import time

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


def _late_group(rank, world):
    """Rank 0 is done at once; the others make a group of their own a moment later."""
    if rank == 0:
        return 0.0
    time.sleep(1.0)
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group([1, 2], use_local_synchronization=True))
    return t.item()


def test_ranks_done_early_keep_the_store_for_the_others():
    """The group's store lives in rank 0's process: ranks still making groups after rank 0 returned
    get through (a gloo new_group returns at once on the ranks outside the group)."""
    assert run_ranks(3, _late_group, timeout=120) == [0.0, 2.0, 2.0]
