"""Each kernel's entry points are declared once (csrc/exports.h): the Python bindings are checked against that
declaration at load, so a binding with the wrong argument count or types fails there, naming the kernel and the
function, instead of corrupting memory on its first call; the C definitions are checked against it by the compiler."""

import shutil

import pytest

from fulcrum.errors import KernelBindingError
from fulcrum.kernels import (
    cpu_act,
    cpu_argmax,
    cpu_attention,
    cpu_decode_stack,
    cpu_ext,
    cpu_gemv,
    cpu_mxfp4,
    cpu_norm,
    cpu_prepack,
    cpu_qgemv,
    cpu_qgemv_vnni,
    cpu_rope,
)
from fulcrum.kernels.cpu_ext import F32, I64, PTR
from fulcrum.runtime import cpu_threads

LOADERS = [cpu_act, cpu_argmax, cpu_attention, cpu_decode_stack, cpu_gemv, cpu_norm, cpu_qgemv, cpu_qgemv_vnni,
           cpu_rope, cpu_threads, cpu_mxfp4, cpu_prepack]  # fmt: skip


def test_every_binding_matches_its_declaration_and_every_declaration_is_bound():
    bound = set()
    for loader in LOADERS:
        for source, bindings in loader.BINDINGS.items():
            cpu_ext.check_bindings(cpu_ext.CSRC / source, bindings)
            bound |= set(bindings)
    assert bound == set(cpu_ext.exports())
    for enum, fields in cpu_decode_stack.ENUMS.items():
        cpu_ext.check_enum("decode_stack.cpp", enum, fields)


@pytest.fixture
def load_with(monkeypatch):
    """Load a kernel afresh with the test's binding table; the kernels off, since the check comes before the build."""
    monkeypatch.setenv("FULCRUM_CPU_KERNELS", "0")

    def load(loader, caches, available, **patch):
        for name, value in patch.items():
            monkeypatch.setattr(loader, name, value)
        for cache in caches:
            cache.cache_clear()
        try:
            return available()
        finally:
            for cache in caches:
                cache.cache_clear()

    return load


def test_a_binding_with_one_argument_too_few_fails_at_load(load_with):
    wrong = {"act.cpp": {"fulcrum_silu_and_mul": (None, I64, PTR, PTR, I64, I64)}}
    with pytest.raises(KernelBindingError, match=r"kernel act \(act.cpp\): the binding of fulcrum_silu_and_mul passes 5 "
                       r"arguments; exports.h:\d+ declares void fulcrum_silu_and_mul\(int64_t bf16, const void\* x"):  # fmt: skip
        load_with(cpu_act, [cpu_act._module], cpu_act.available, BINDINGS=wrong)


def test_a_binding_with_a_wrong_argument_type_fails_at_load(load_with):
    eps_as_int = {"norm.cpp": {"fulcrum_rms_norm": (None, I64, PTR, PTR, PTR, I64, I64, I64)}}
    with pytest.raises(
        KernelBindingError, match=r"kernel norm .*fulcrum_rms_norm passes int64_t as argument 7, `float eps`"
    ):
        load_with(cpu_norm, [cpu_norm._module], cpu_norm.available, BINDINGS=eps_as_int)
    count_as_pointer = {"rope.cpp": {"fulcrum_rope_cache": (None, *[PTR] * 11, *[I64] * 8)}}
    with pytest.raises(KernelBindingError, match=r"kernel rope .*fulcrum_rope_cache passes a pointer as argument 1"):
        load_with(cpu_rope, [cpu_rope._module], cpu_rope.available, BINDINGS=count_as_pointer)


def test_a_binding_with_a_wrong_result_or_name_fails_at_load(load_with):
    no_result = dict(cpu_attention.BINDINGS)
    no_result["decode_attention.cpp"] = {
        "fulcrum_decode_attention": (None, I64, I64, *[PTR] * 8, *[I64] * 6, F32, I64, F32, PTR)
    }
    caches = [cpu_attention._decode, cpu_attention._prefill_lib]
    with pytest.raises(KernelBindingError, match=r"kernel decode_attention .*fulcrum_decode_attention returns void"):
        load_with(cpu_attention, caches, cpu_attention.available, BINDINGS=no_result)
    elsewhere = {
        "gemv.cpp": {
            **cpu_gemv.BINDINGS["gemv.cpp"],
            "fulcrum_argmax": cpu_argmax.BINDINGS["argmax.cpp"]["fulcrum_argmax"],
        }
    }
    with pytest.raises(
        KernelBindingError, match=r"kernel gemv .*fulcrum_argmax is bound in Python but not defined in gemv.cpp"
    ):
        load_with(cpu_gemv, [cpu_gemv._module], cpu_gemv.available, BINDINGS=elsewhere)


def test_the_decode_stacks_arrays_are_checked_against_its_enums(load_with):
    """The driver reads three int64 arrays by the positions of its C++ enums: Python fills them by the same names,
    in the same order, or the stack does not load."""
    enums = cpu_decode_stack.ENUMS  # as loaded: each check below patches one enum of these
    fields = tuple(f for f in cpu_decode_stack.LAYER_FIELDS if f != "WINDOW")
    with pytest.raises(KernelBindingError, match=r"kernel decode_stack: enum LayerField is IN_NORM, .*WINDOW"):
        load_with(cpu_decode_stack, [cpu_decode_stack._lib], cpu_decode_stack.available,
                  ENUMS={**enums, "LayerField": fields})  # fmt: skip
    swapped = ("NORM", "GEMV", *cpu_decode_stack.FNS[2:])
    with pytest.raises(KernelBindingError, match=r"kernel decode_stack: enum Fn"):
        load_with(cpu_decode_stack, [cpu_decode_stack._lib], cpu_decode_stack.available,
                  ENUMS={**enums, "Fn": swapped})  # fmt: skip
    # the clocks' names too: phase_times would otherwise label one kind of call's seconds with another's name
    phases = ("T_QKV", "T_NORM", *enums["Phase"][2:])
    with pytest.raises(KernelBindingError, match=r"kernel decode_stack: enum Phase"):
        load_with(cpu_decode_stack, [cpu_decode_stack._lib], cpu_decode_stack.available,
                  ENUMS={**enums, "Phase": phases})  # fmt: skip


def test_the_declarations_are_read_strictly(tmp_path):
    header = tmp_path / "exports.h"
    header.write_text('#include <cstdint>\nextern "C" {\n// fine\nvoid fulcrum_a(int64_t n, const float* x);\n\n'
                      "void fulcrum_b(int n);\n}\n")  # fmt: skip
    with pytest.raises(KernelBindingError, match=r"exports.h:6: not a declaration .*void fulcrum_b\(int n\)"):
        cpu_ext.exports(header)
    header.write_text('extern "C" {\nint64_t fulcrum_a(int64_t n,\n                  const float* x);\n}\n')
    (a,) = cpu_ext.exports(header).values()
    assert (a.restype, a.argtypes, a.line) == (I64, (I64, PTR), 2)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_a_definition_that_differs_from_its_declaration_does_not_compile(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "act.cpp"
    source.write_text('#include "exports.h"\nextern "C" void fulcrum_silu_and_mul(int64_t bf16, void* x) {}\n')
    assert cpu_ext.load(source, "none", {}) is None
    assert f"{source}:2" in caplog.text  # g++: "conflicting declaration of C function"
