"""Let a model's compute yield the cores to the processes that admit and refuse requests.

On a CPU node the bucket models' compute, the router's checks and admission, and Triton's
front end share the same few cores. When they are short, whatever runs first decides what
admission can see: a request that waits for a core in the front end or in the router's
queue waits where the router's clock has not started, while a request that waits for a core
in a bucket model waits inside it, where admission counts it. So the bucket models' threads
run at a higher nice value than the rest: the front end and the router get the cores first,
refuse early what will not fit, and the compute they admitted absorbs the shortage.

Linux keeps a nice value per thread, so `lower_priority` sets every thread the process has
(the stub's own and those ONNX Runtime started); threads made later inherit it from the
thread that makes them. It never lowers a nice value someone raised further.
"""

from __future__ import annotations

import os
from pathlib import Path

TASKS = Path("/proc/self/task")


def lower_priority(nice: int, tasks: Path = TASKS) -> int:
    """Raise every thread of this process to nice value `nice` (0 to 19; 0: leave them);
    the number of threads changed. Where threads cannot be listed (not Linux), the calling
    thread only."""
    if not 0 <= nice <= 19:
        raise ValueError(f"nice value must be in [0, 19], got {nice}")
    if nice == 0:
        return 0
    thread_ids = [int(entry.name) for entry in tasks.iterdir()] if tasks.is_dir() else [0]
    changed = 0
    for thread_id in thread_ids:
        try:
            if os.getpriority(os.PRIO_PROCESS, thread_id) < nice:
                os.setpriority(os.PRIO_PROCESS, thread_id, nice)
                changed += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return changed
