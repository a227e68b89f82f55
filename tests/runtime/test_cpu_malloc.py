"""The engine's malloc setting: a step-sized block freed and allocated again comes from the heap glibc keeps, not
from a fresh mapping of new pages (a decode step's logits; a 2048-token prefill's gate and up projections of the 0.5B
shape in fp32, where glibc takes a threshold that high); FULCRUM_CPU_MALLOC=0 leaves glibc's defaults, which map the
larger block afresh every time."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

CODE = """
import ctypes, sys, torch
from fulcrum.runtime import cpu_malloc

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
print(cpu_malloc.keep_freed_memory())
size = int(sys.argv[1])
mapped = []
for _ in range(3):
    x = torch.empty(size, dtype=torch.uint8)
    mapped.append(libc.mallinfo2().hblkhd)
    del x
print(max(mapped) - libc.mallinfo2().hblkhd >= size)
"""

DECODE_LOGITS, PREFILL_GATE_UP = 20 << 20, 2048 * 9728 * 4  # a 64-row decode step's logits; 80 MiB


def glibc_takes_a_threshold_of(size: int) -> bool:
    code = f"import ctypes; print(ctypes.CDLL('libc.so.6').mallopt(-3, {size}))"  # M_MMAP_THRESHOLD
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "1"


@pytest.mark.parametrize("size", [DECODE_LOGITS, PREFILL_GATE_UP])
@pytest.mark.parametrize("env, want", [({}, ["True", "False"]), ({"FULCRUM_CPU_MALLOC": "0"}, ["False", "True"])])
def test_a_freed_step_sized_block_stays_in_the_heap(env, want, size):
    if size > 32 << 20 and not glibc_takes_a_threshold_of(1 << 30):
        pytest.skip("this glibc takes no threshold over 32 MiB")
    res = subprocess.run(
        [sys.executable, "-c", CODE, str(size)], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == want  # set; and whether the block was a mapping of its own
