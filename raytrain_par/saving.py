"""Checkpoints off the training thread.

A save has two halves. Taking it runs on the training thread: each rank's own pieces (strategies/state.py;
nothing gathered) copied into host memory, every rank at the same point of training. Writing it (each
rank's file and its part of the index, the manifest, handing the directory to Ray Train, which copies it
to the run's storage) runs on a background thread while training goes on (`train.checkpoint_mode:
async`, the default), or on the training thread (`sync`). A save that finds the previous one still being
written waits for it: two are never written at once, and no more than one snapshot is held.

Atomic: a checkpoint is used only once every rank's manifest is in it and every file matches
(checkpoints.py); Ray Train registers it only once every rank's write and copy has ended. A worker killed
while writing leaves the checkpoint before it the newest one a restart takes.

The stall a save costs the training thread (`checkpoint_stall_s`: the snapshot, and any wait for the
previous write, `checkpoint_wait_s`) and the time its write took (`checkpoint_write_s`) travel in the
record of the evaluation that saved.

Why not torch DCP's `async_save`: its metadata is a pickle, which this project does not load, and its
planner re-shards DTensors only (strategies/state.py).
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Callable

class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: the run stops; the records and checkpoints written before it stay."""


class Save:
    """One checkpoint: `write(directory)` writes its files; `run` writes them and hands the directory
    over (once, on whichever thread calls it); `wait` until that has ended, or failed."""

    def __init__(self, directory: Path, step: int, write: Callable[[Path], None], background: bool):
        self.directory, self.step, self._write, self.background = Path(directory), step, write, background
        self.stall_s = 0.0  # the training thread's time for it before its write, set by the trainer
        self.wait_s = 0.0  # the part of it spent waiting for the previous checkpoint's write
        self.write_s: float | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self, hand_over: Callable[[], object] = lambda: None):
        """Write the checkpoint into its directory, then `hand_over()` (a copy to the run's storage); its
        result returned. An OSError (a full disk, a lost mount) is raised as a CheckpointWriteError
        naming the step, the file and the fix. Run once: a second call raises the first one's failure."""
        if self.error is not None:
            raise self.error
        assert self._write is not None, "a checkpoint is written once"
        t0 = time.perf_counter()
        try:
            self._write(self.directory)
            return hand_over()
        except OSError as e:
            self.error = CheckpointWriteError(write_problem(e, self.step, self.directory))
            raise self.error from e
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.write_s = time.perf_counter() - t0
            self._write = None  # lets the snapshot's memory go
            self._done.set()

    def fill(self, record: dict) -> None:
        """This save's times into the record of the evaluation that took it, before it is delivered:
        written on the training thread (sync), the write is part of the stall."""
        record["checkpoint_write_s"], record["checkpoint_wait_s"] = self.write_s, self.wait_s
        record["checkpoint_stall_s"] = self.stall_s if self.background else self.stall_s + (self.write_s or 0.0)
        if not self.background:
            record["checkpoint_time_s"] = (record.get("checkpoint_time_s") or 0.0) + (self.write_s or 0.0)

    def wait(self) -> None:
        """Until it is written and handed over; its failure raised here."""
        self._done.wait()
        if self.error is not None:
            raise self.error


def write_problem(e: OSError, step: int, directory: Path) -> str:
    where = e.filename or directory
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"free space on the disk of {where} (or give the workers a temporary directory on a larger disk: "
               "TMPDIR, or Ray's `--temp-dir`), or write fewer checkpoints: train.checkpoint_every_evals, "
               "train.keep_checkpoints")
    else:
        fix = f"check that {where} is writable and its disk is mounted"
    return (f"the checkpoint of step {step} could not be written: {e.strerror or e} ({where}). Training "
            "stopped; the records and the checkpoints written before it are kept, and `raytrain-par run "
            f"--resume` continues from the newest of them.\n  fix: {fix}")
