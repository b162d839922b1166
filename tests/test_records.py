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
