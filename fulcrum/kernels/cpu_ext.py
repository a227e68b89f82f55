"""Build and load fulcrum's C++ CPU kernels (csrc/*.cpp) once per environment, at the ISA level this CPU has.

A kernel's .cpp is compiled in place by the system's C++ compiler into a cache folder keyed on its sources, and loaded
with ctypes after its binding is checked against csrc/exports.h. Below AVX2, with FULCRUM_CPU_KERNELS=0 or without a
compiler `load` returns None and callers stay on PyTorch ops; FULCRUM_CPU_ISA forces a lower level (utils/cpu_isa.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fulcrum.errors import KernelBindingError

# the kernels pick their level through these (re-exported: one home for the level, utils/cpu_isa.py)
from fulcrum.utils.cpu_isa import ISA_LEVELS, at_least, best, detected_isa, isa  # noqa: F401

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")

# -fopenmp: at::parallel_for runs its `omp parallel` region only in a library compiled with OpenMP (without it every
# kernel ran on one thread); libgomp.so.1 resolves to the one torch has loaded, so torch's ops and the kernels share
# one thread pool.
AVX512_BF16_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
ISA_FLAGS = {
    "none": ["-O2", "-fopenmp"],  # code that needs no vector ISA (thread placement)
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
    "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"],
    "avx512_bf16": AVX512_BF16_FLAGS,
    "amx": AVX512_BF16_FLAGS,  # AMX itself is oneDNN's, through torch's bf16 matmuls
}

PTR, I64, F32, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
# what a ctypes binding passes for each C type exports.h may use (pointers go as ints, None for NULL)
_CTYPES = {"void": None, "int64_t": I64, "float": F32, "double": F64}
_C_NAMES = {PTR: "a pointer", I64: "int64_t", F32: "float", F64: "double", None: "void"}


def _cname(t) -> str:
    return _C_NAMES.get(t) or getattr(t, "__name__", repr(t))


# A binding: the function's result type, then its argument types, as ctypes takes them
Signature = tuple


def vector_level() -> str:
    """The level a kernel written on vec.h is built for here: avx512 or avx2 (or below: none)."""
    return best("avx512", "avx2")


# -- the one declaration of every entry point, and the check of the Python bindings against it ----------------------


@dataclass(frozen=True)
class Export:
    name: str
    restype: type | None
    argtypes: tuple
    params: tuple[str, ...]  # as declared, for messages
    line: int


_DECL = re.compile(r"(void|int64_t|float|double) (fulcrum_\w+)\((.*)\)")
_PARAM = re.compile(r"(?:const )?(?:void|char|u?int(?:8|16|32|64)_t|float|double)\* \w+|(?:int64_t|float|double) \w+")


def _strip_comments(text: str) -> str:
    """`//` comments blanked out, line breaks and offsets kept."""
    return re.sub(r"//[^\n]*", lambda m: " " * len(m.group()), text)


@functools.cache
def exports(header: Path = CSRC / "exports.h") -> dict[str, Export]:
    """The entry points `header` declares inside its `extern "C" { }`, read strictly: `ret fulcrum_name(type name,
    ...);` with int64_t, float, double or pointer parameters. Anything else there is a KernelBindingError."""
    text = _strip_comments(header.read_text())
    start = text.index('extern "C" {') + len('extern "C" {')
    end = text.rindex("}")
    found, pos = {}, start
    for stmt in text[start:end].split(";"):
        at = pos + len(stmt) - len(stmt.lstrip())
        pos += len(stmt) + 1
        decl = " ".join(stmt.split())
        if not decl:
            continue
        line = text.count("\n", 0, at) + 1
        m = _DECL.fullmatch(decl)
        params = [p.strip() for p in m.group(3).split(",")] if m and m.group(3).strip() else []
        if not m or not all(_PARAM.fullmatch(p) for p in params):
            raise KernelBindingError(
                f"{header.name}:{line}: not a declaration `ret fulcrum_name(type name, ...);`: {decl}"
            )
        argtypes = tuple(PTR if "*" in p else _CTYPES[p.split()[0]] for p in params)
        found[m.group(2)] = Export(m.group(2), _CTYPES[m.group(1)], argtypes, tuple(params), line)
    return found


def defined(source: Path) -> set[str]:
    """The `extern "C"` functions `source` defines."""
    return set(re.findall(r'extern "C" [\w\s*]*?\b(fulcrum_\w+)\(', _strip_comments(source.read_text())))


def check_bindings(source: Path, bindings: Mapping[str, Signature]) -> None:
    """Raise KernelBindingError, naming the kernel and the function, unless every binding is the declaration in
    exports.h of a function `source` defines: same result type, as many arguments, each of the same type."""
    kernel, declared, here = f"kernel {source.stem} ({source.name})", exports(), defined(source)
    for fn, (restype, *argtypes) in bindings.items():
        if fn not in declared or fn not in here:
            where = "declared in exports.h" if fn not in declared else f"defined in {source.name}"
            raise KernelBindingError(f"{kernel}: {fn} is bound in Python but not {where}")
        d = declared[fn]
        decl = f"exports.h:{d.line} declares {_cname(d.restype)} {fn}({', '.join(d.params)})"
        if len(argtypes) != len(d.argtypes):
            raise KernelBindingError(f"{kernel}: the binding of {fn} passes {len(argtypes)} arguments; {decl}")
        for i, (got, want) in enumerate(zip(argtypes, d.argtypes)):
            if got is not want:
                raise KernelBindingError(
                    f"{kernel}: the binding of {fn} passes {_cname(got)} as argument {i + 1}, `{d.params[i]}`; {decl}"
                )
        if restype is not d.restype:
            raise KernelBindingError(f"{kernel}: the binding of {fn} returns {_cname(restype)}; {decl}")


def enum_members(source: str | Path, name: str) -> tuple[str, ...]:
    """The members of `enum name { A, B, ... };` in a kernel's source, in order (plain names, no values)."""
    path = _source_path(source)
    m = re.search(rf"\benum {name} \{{([^{{}}]*)\}};", _strip_comments(path.read_text()))
    members = tuple(x.strip() for x in m.group(1).split(",")) if m else ()
    if not members or not all(re.fullmatch(r"[A-Z][A-Z0-9_]*", x) for x in members):
        raise KernelBindingError(f"kernel {path.stem}: no `enum {name} {{ A, B, ... }};` of plain names in {path.name}")
    return members


def check_enum(source: str | Path, name: str, fields: tuple[str, ...]) -> None:
    """Raise KernelBindingError unless the C++ `enum name` lists `fields` in this order, then its count."""
    members = enum_members(source, name)
    if members[:-1] != fields:
        raise KernelBindingError(
            f"kernel {Path(source).stem}: enum {name} is {', '.join(members[:-1])} (then {members[-1]}), "
            f"the Python side fills {', '.join(fields)}"
        )


# -- the build ------------------------------------------------------------------------------------------------------

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _source_path(source: str | Path) -> Path:
    return Path(source) if os.path.isabs(source) else CSRC / source


def sources(source: Path) -> dict[str, str]:
    """`source` and every file it includes with `#include "..."` (beside the includer, else in csrc/), transitively,
    each file's name and contents: what the cache key hashes (a header's change rebuilds what includes it)."""
    found, todo = {}, [source]
    while todo:
        path = todo.pop()
        key = path.name if path.parent == CSRC else str(path)
        if key in found:
            continue
        found[key] = text = path.read_text()
        for inc in _INCLUDE.findall(text):
            nxt = next((d / inc for d in (path.parent, CSRC) if (d / inc).is_file()), None)
            if nxt is None:
                raise FileNotFoundError(f'{path}: #include "{inc}" is neither beside it nor in {CSRC}')
            todo.append(nxt)
    return found


def _build_dir(source: Path, flags: list[str]) -> str:
    parts = [f"{name}\0{text}" for name, text in sorted(sources(source).items())]
    key = hashlib.sha256("|".join([*parts, " ".join(flags), torch.__version__, sys.prefix]).encode()).hexdigest()
    root = os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum"))
    path = os.path.join(root, "kernels", key[:16])
    os.makedirs(path, exist_ok=True)
    return path


def compile_command(source_path: str, out_path: str, flags: list[str], link: bool = True) -> list[str]:
    """The compiler call for one kernel library, the source compiled where it lies (errors name its lines): csrc/ and
    torch's headers, and torch's libraries for at::parallel_for."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++").split()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *flags, f"-I{CSRC}"]
    cmd += [f"-I{p}" for p in include_paths()]
    if not link:
        return [*cmd, "-c", source_path, "-o", out_path]
    libs = library_paths()
    return [*cmd, "-shared", source_path, "-o", out_path, *(f"-L{p}" for p in libs),
            *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]  # fmt: skip


def build(name: str, source: Path, flags: list[str]) -> str:
    """The path of `name`'s library built from `source`, compiling it unless the cache holds it. Concurrent
    builders (two servers starting at once) each write a private file and rename it into place."""
    folder = _build_dir(source, flags)
    lib = os.path.join(folder, f"{name}.so")
    if os.path.exists(lib):
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = os.path.join(tmp, f"{name}.so")
        res = subprocess.run(compile_command(str(source), out, flags), capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {source} failed:\n{res.stderr[-4000:]}")
        os.replace(out, lib)
    return lib


def load(
    source: str | Path,
    level: str,
    bindings: Mapping[str, Signature],
    defines: Mapping[str, int] | None = None,
    extra_flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """The library built from `source` (a file in csrc/, or a path) for ISA `level`, each function of `bindings`
    (name -> (restype, *argtypes)) bound; None where the CPU (or FULCRUM_CPU_ISA) is below `level` or it cannot be
    built. The bindings are checked first, wherever it runs: KernelBindingError where one differs from exports.h.
    `defines`: -D macros; `extra_flags`: flags for an extension the caller has checked the CPU for (-mavx512vnni)."""
    path = _source_path(source)
    check_bindings(path, bindings)
    if not at_least(level):
        return None
    flags = [*ISA_FLAGS[level], *extra_flags, *(f"-D{k}={v}" for k, v in (defines or {}).items())]
    name = "_".join([path.stem, *(f"{k.lower()}{v}" for k, v in (defines or {}).items()), level])
    try:
        lib = ctypes.CDLL(build(name, path, flags))
    except Exception as e:  # no compiler, no headers: stay correct, just slower
        log.warning("CPU kernel %s unavailable, using PyTorch ops: %s", name, e)
        return None
    for fn, (restype, *argtypes) in bindings.items():
        bind(getattr(lib, fn), restype, *argtypes)
    return lib


def bind(fn, restype, *argtypes):
    """Give a ctypes function its signature (pointers are passed as ints, None for NULL) and return it."""
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


# A quantized KV cache's element type -> the `kind` the rope and attention kernels take (0: a cache in the
# activations' own dtype); fulcrum.quant.kv holds the format
KV_CACHE_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}


def rows_packed(x: torch.Tensor) -> bool:
    """[T, heads, D] with a token's heads side by side (tokens may be strided: views of the fused qkv output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
