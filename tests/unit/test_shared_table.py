"""The shared-memory table under the quotas and admission: rows every opener sees, the
table-wide record, and read-modify-writes that no thread or process interleaves."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from python_backends.common.shared_table import SharedTable

FIELDS = (("key", "<u8"), ("count", "<f8"))


def test_a_new_table_is_empty_and_every_opener_sees_the_rows_and_the_extra_record(tmp_path):
    first = SharedTable(tmp_path / "t.bin", 4, FIELDS, (("bound_ms", "<f8"),))
    second = SharedTable(tmp_path / "t.bin", 4, FIELDS, (("bound_ms", "<f8"),))
    try:
        assert first.rows["key"].tolist() == [0, 0, 0, 0] and float(first.extra["bound_ms"]) == 0.0
        with first.locked():
            first.rows[2] = (7, 1.5)
            first.extra["bound_ms"] = 40.0
        assert (int(second.rows[2]["key"]), float(second.rows[2]["count"])) == (7, 1.5)
        assert float(second.extra["bound_ms"]) == 40.0
        assert (tmp_path / "t.bin").stat().st_size == 4 * 16 + 8
    finally:
        first.close()
        second.close()


def test_a_table_needs_a_row(tmp_path):
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        SharedTable(tmp_path / "t.bin", 0, FIELDS)


def _add_many(path, times):
    table = SharedTable(path, 1, FIELDS)
    for _ in range(times):
        with table.locked():
            table.rows["count"][0] += 1.0
    table.close()


def test_read_modify_writes_of_threads_and_processes_never_interleave(tmp_path):
    path = tmp_path / "t.bin"
    table = SharedTable(path, 1, FIELDS)
    threads = [threading.Thread(target=_add_many, args=(path, 500)) for _ in range(2)]
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_add_many, args=(path, 500)) for _ in range(2)]
    for worker in [*threads, *processes]:
        worker.start()
    for worker in [*threads, *processes]:
        worker.join()
    assert float(table.rows["count"][0]) == 2000.0
    table.close()
