"""metrics.parquet read while a run writes it (a report, a benchmark or a sweep's scheduler polling)."""

import threading
import time

from raytrain_par.metrics.records import read_records, write_table


def test_records_read_while_the_file_is_replaced_are_always_whole(tmp_path):
    path = tmp_path / "metrics.parquet"
    rows = [{"step": 0, "val_loss": 9.0, "trial": "t"}]
    write_table(path, rows)
    stop = threading.Event()

    def writer():
        step = 1
        while not stop.is_set():  # a run appending an evaluation, the file replaced each time
            rows.append({"step": step, "val_loss": 9.0 / (step + 1), "trial": "t" * (step % 5 + 1)})
            write_table(path, rows[-40:])
            step += 1

    thread = threading.Thread(target=writer)
    thread.start()
    failures, reads, started = [], 0, time.monotonic()
    try:
        while time.monotonic() - started < 2:
            try:
                records = read_records(path)
            except OSError as e:  # a footer of one file read with the pages of another
                failures.append(str(e))
                continue
            reads += 1
            steps = [r["step"] for r in records]
            assert steps == sorted(steps) and len(steps) == len(set(steps))
    finally:
        stop.set()
        thread.join()
    assert reads > 20
    assert not failures, f"{len(failures)} of {reads + len(failures)} reads failed, e.g. {failures[0]}"


def test_a_process_that_read_records_exits_cleanly(tmp_path):
    """`raytrain-par run` reads its records last, then exits: pyarrow's dataset reader of a Python file
    left thread-pool tasks that aborted 4 exits in 5 with SIGABRT, after the run had succeeded."""
    import subprocess
    import sys

    path = write_table(tmp_path / "metrics.parquet", [{"step": s, "val_loss": 1.0 / (s + 1)} for s in range(3)])
    code = ("import sys; from raytrain_par.metrics.records import read_records; "
            "assert [r['step'] for r in read_records(sys.argv[1])] == [0, 1, 2]")
    ends = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
            for _ in range(6)]
    assert [p.returncode for p in ends] == [0] * 6, [p.stderr[-500:] for p in ends if p.returncode]
