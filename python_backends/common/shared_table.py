"""A table of fixed-size rows in one memory-mapped file, shared by every process that opens it.

A model's instances are separate processes (Triton starts a stub per instance); what must
hold across all of them (tenant quotas, admission's work in flight and its adaptive bound)
lives in such a table, in a file named for the server run (`shared_files`). Rows are numpy
structured records (`fields`, e.g. `[("key", "<u8"), ("tokens", "<f8")]`), optionally
followed by one record of table-wide values (`extra_fields`). A new file is zero-filled:
every row starts empty.

`locked()` makes a read-modify-write one step: a thread lock first (an `flock` does not
exclude the threads of one process, which share the descriptor), then an exclusive `flock`
on the file against the other processes: a few microseconds uncontended. Hand-written on
purpose: `multiprocessing.shared_memory` needs a creator that outlives the users and a name
handed to each, and a process killed mid-way leaks its segment, where a run-named file is
swept at the next start.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

_Held = AbstractContextManager  # what `locked` returns: the table itself, or its thread lock


class SharedTable:
    """`num_rows` records of `fields`, then one record of `extra_fields`, in the file at `path`."""

    def __init__(self, path: Path, num_rows: int, fields: Sequence[tuple], extra_fields: Sequence[tuple] = ()):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.path = Path(path)
        self.num_rows = num_rows
        row_dtype = np.dtype(list(fields))
        extra_dtype = np.dtype(list(extra_fields)) if extra_fields else None
        rows_size = num_rows * row_dtype.itemsize
        size = rows_size + (extra_dtype.itemsize if extra_dtype is not None else 0)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process grows a new file; the others wait and map it
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._lock = threading.Lock()
        self._held = self  # `with table.locked():` enters the table itself: no generator per call
        self.rows = np.ndarray((num_rows,), dtype=row_dtype, buffer=self._map)  # views the file
        self.extra = (np.ndarray((), dtype=extra_dtype, buffer=self._map, offset=rows_size)
                      if extra_dtype is not None else None)

    def locked(self, across_processes: bool = True) -> _Held:
        """Hold the table for a read-modify-write: against this process's other threads, and
        (`across_processes`) against every other process that has it open."""
        return self._held if across_processes else self._lock

    def __enter__(self) -> SharedTable:
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def close(self) -> None:
        del self.rows, self.extra  # the arrays view the map: drop them before the map closes
        self._map.close()
        os.close(self._fd)
