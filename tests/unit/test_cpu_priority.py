"""Bucket models yield the cores: every thread of the process takes the nice value, later ones inherit it."""

import subprocess
import sys
import textwrap

import pytest

from python_backends.common.cpu_priority import lower_priority

CHILD = textwrap.dedent("""
    import os, threading
    from python_backends.common.cpu_priority import lower_priority

    started, done = threading.Event(), threading.Event()
    ids = {}

    def worker(name):
        ids[name] = threading.get_native_id()
        started.set()
        done.wait()

    early = threading.Thread(target=worker, args=("early",)); early.start(); started.wait()
    changed = lower_priority(7)
    started.clear()
    late = threading.Thread(target=worker, args=("late",)); late.start(); started.wait()
    again = lower_priority(7)
    nice = {name: os.getpriority(os.PRIO_PROCESS, tid) for name, tid in ids.items()}
    nice["main"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    done.set(); early.join(); late.join()
    print(changed, again, nice["main"], nice["early"], nice["late"])
""")


def test_every_thread_takes_the_nice_value_and_later_threads_inherit_it(tmp_path):
    from tests.unit.test_gen_config import REPO

    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    changed, again, main, early, late = map(int, done.stdout.split())
    assert changed >= 2  # the main thread and the one started before
    assert again == 0  # already there: nothing to change
    assert main == early == late == 7


def test_zero_leaves_the_threads_and_out_of_range_is_refused():
    assert lower_priority(0) == 0
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=r"\[0, 19\]"):
            lower_priority(bad)
