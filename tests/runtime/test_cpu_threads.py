"""--cpu-threads / --cpu-bind: how many compute threads the engine core runs and on which cores, leaving the
frontend a core under `fulcrum serve` on machines of 8 cores or more; pinning checked on real threads in a process of its own."""

import json
import os
import subprocess
import sys

import pytest

from fulcrum.config import EngineConfig
from fulcrum.errors import InvalidRequestError
from fulcrum.runtime import cpu_threads


def test_core_lists_parse_as_taskset_writes_them():
    assert cpu_threads.parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_threads.parse_cpus("5") == [5]
    for bad in ("", "a", "3-1", "1,1", "0-", "-1"):
        with pytest.raises(ValueError):
            cpu_threads.parse_cpus(bad)


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: [0, 1, 2, 3])


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: list(range(8)))


def test_auto_in_its_own_process_pins_one_thread_per_core_and_leaves_the_frontend_one(eight_cores):
    assert cpu_threads.plan(None, "auto", own_process=True) == cpu_threads.ThreadPlan(7, (1, 2, 3, 4, 5, 6, 7))
    assert cpu_threads.plan(2, "auto", own_process=True) == cpu_threads.ThreadPlan(2, (1, 2))
    # asked for more threads than the free cores: the reserved core computes too
    assert cpu_threads.plan(8, "auto", own_process=True) == cpu_threads.ThreadPlan(8, tuple(range(8)))
    with pytest.raises(ValueError, match="more than the 8 cores"):
        cpu_threads.plan(9, "auto", own_process=True)


def test_on_a_small_machine_every_core_computes_and_the_frontend_shares(four_cores):
    """Below FRONTEND_CORE_MIN_CPUS a core left to the frontend costs more compute than the frontend needs."""
    assert cpu_threads.FRONTEND_CORE_MIN_CPUS > 4
    assert cpu_threads.plan(None, "auto", own_process=True) == cpu_threads.ThreadPlan(4, (0, 1, 2, 3))
    assert cpu_threads.plan(2, "auto", own_process=True) == cpu_threads.ThreadPlan(2, (0, 1))
    with pytest.raises(ValueError, match="more than the 4 cores"):
        cpu_threads.plan(5, "auto", own_process=True)


def test_auto_inside_a_users_process_pins_nothing(four_cores):
    """LLM(...) runs in the caller's process: pinning would confine the caller's thread and all it starts later."""
    assert cpu_threads.plan(None, "auto") == cpu_threads.ThreadPlan(4, None)
    assert cpu_threads.plan(2, "auto") == cpu_threads.ThreadPlan(2, None)


def test_one_core_is_never_reserved_away(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: [7])
    assert cpu_threads.plan(None, "auto", own_process=True) == cpu_threads.ThreadPlan(1, (7,))


def test_explicit_lists_and_none(four_cores):
    assert cpu_threads.plan(None, "0,2") == cpu_threads.ThreadPlan(2, (0, 2))
    assert cpu_threads.plan(1, "2-3") == cpu_threads.ThreadPlan(1, (2,))
    with pytest.raises(ValueError, match=r"cores \[9\] are not available"):
        cpu_threads.plan(None, "3,9")
    assert cpu_threads.plan(None, "none", own_process=True) == cpu_threads.ThreadPlan(4, None)
    assert cpu_threads.plan(8, "none").describe() == "8 compute threads, unpinned"


def test_bad_settings_are_refused_by_the_config():
    for kwargs in ({"cpu_bind": "everywhere"}, {"cpu_bind": "1-"}, {"cpu_threads": 0}, {"cpu_nice": 20},
                   {"cpu_nice": -1}):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            EngineConfig(**kwargs)


PROBE = """
import json, torch
from fulcrum import LLM
llm = LLM(dtype="float32", kv_cache_memory=64 << 20, cpu_threads={threads}, cpu_bind={bind!r})
from fulcrum.runtime import cpu_threads
import os
print(json.dumps({{"threads": torch.get_num_threads(), "cpus": cpu_threads.thread_cpus(),
                   "affinity": sorted(os.sched_getaffinity(0))}}))
"""


ALLOWED = cpu_threads.allowed_cpus()


@pytest.mark.parametrize(
    "threads, bind, want_threads, want_cpus",
    [
        (None, "auto", len(ALLOWED), None),  # in the caller's process: sized, not pinned
        (1, "none", 1, None),
        (None, str(ALLOWED[-1]), 1, [ALLOWED[-1]]),  # an explicit list pins, here too
    ],
)
def test_the_engine_runs_its_threads_where_it_was_told(threads, bind, want_threads, want_cpus):
    code = PROBE.format(threads=threads, bind=bind)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["threads"] == want_threads
    if want_cpus:  # pinned: thread i sits on the i-th listed core
        assert got["cpus"] == want_cpus
    assert got["affinity"] == (want_cpus or ALLOWED)  # what the caller's thread (and all it starts) may use


RENICE = """
import json, os, threading
from fulcrum.runtime import cpu_threads
gate = threading.Event()
def nice_of(tid): return os.getpriority(os.PRIO_PROCESS, tid)
def wait(out): out.append(threading.get_native_id()); gate.wait()
before, after = [], []
t = threading.Thread(target=wait, args=(before,)); t.start()
while not before: pass
main = cpu_threads.lower_priority(7)
u = threading.Thread(target=wait, args=(after,)); u.start()
while not after: pass
again = cpu_threads.lower_priority(3)  # never back up: the threads keep 7
print(json.dumps([main, nice_of(before[0]), nice_of(after[0]), again, nice_of(before[0])]))
gate.set(); t.join(); u.join()
"""


def test_lowering_priority_reaches_every_thread_and_those_started_after():
    # a subprocess: an unprivileged process cannot take its priority back
    res = subprocess.run([sys.executable, "-c", RENICE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    base = os.getpriority(os.PRIO_PROCESS, 0)  # a suite run under `nice` starts there
    want = max(7, base)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [want, want, want, want, want]
