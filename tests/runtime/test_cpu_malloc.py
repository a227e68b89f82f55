"""The engine's malloc setting: a step-sized block freed and allocated again comes from the heap glibc keeps, not
from a fresh mapping of new pages; FULCRUM_CPU_MALLOC=0 leaves glibc's defaults."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

CODE = """
import ctypes, torch
from fulcrum.runtime import cpu_malloc

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
print(cpu_malloc.keep_freed_memory())
mapped = []
for _ in range(3):
    x = torch.empty(20 << 20, dtype=torch.uint8)  # a 64-row decode step's logits, about
    mapped.append(libc.mallinfo2().hblkhd)
    del x
print(max(mapped) - libc.mallinfo2().hblkhd >= 20 << 20)
"""


@pytest.mark.parametrize("env, want", [({}, ["True", "False"]), ({"FULCRUM_CPU_MALLOC": "0"}, ["False", "True"])])
def test_a_freed_step_sized_block_stays_in_the_heap(env, want):
    res = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == want  # set; and whether the block was a mapping of its own
