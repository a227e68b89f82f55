"""A decode step's whole decoder stack in one call into C++ (csrc/decode_stack.cpp): the layers' own kernels, layer
after layer, without Python between them (on a small model most of a batch-1 step was module calls and views).
`models/llama.py` uses it where its layers fit (dense or quantized weights the qgemv kernels read, one TP rank,
Llama's layer shape) and keeps its modules elsewhere; FULCRUM_FUSED_DECODE=0 turns it off (A/B runs, tests of the
module path)."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from fulcrum.kernels import (
    cpu_act,
    cpu_attention,
    cpu_ext,
    cpu_gemv,
    cpu_norm,
    cpu_prepack,
    cpu_qgemv,
    cpu_qgemv_vnni,
    cpu_rope,
)
from fulcrum.kernels.cpu_ext import F32, I64, PTR

# The int64 arrays the driver reads, by the names of its enums in decode_stack.cpp (checked at load): the kernels'
# addresses, the model's dimensions, one row of LAYER_FIELDS per layer
FNS = ("GEMV", "NORM", "ROPE", "ATTN", "ACT", "SGEMM", "Q4", "Q8G", "Q8", "Q4V", "Q8GV", "Q8V", "Q5", "Q5V", "PACKED",
       "SMALL")  # fmt: skip
DIMS = ("HIDDEN", "HEADS", "KV_HEADS", "HEAD_DIM", "INTER", "BLOCK_SIZE", "CACHE_KIND", "GEMV_ROWS", "QUANT",
        "VNNI_ROWS", "LORA_RANK", "PACKED_ROWS", "SMALL_MIN_ROWS", "SMALL_ROWS")  # fmt: skip
PART_FIELDS = ("KIND", "ROWS", "W", "SCALE", "OFFSET", "GROUP", "HIGH")
KINDS = ("DENSE", "INT4", "INT8G", "INT8", "FP8", "INT5")
LAYER_FIELDS = ("IN_NORM", "QKV_W", "QKV_B", "O_W", "O_B", "POST_NORM", "GU_W", "GU_B", "DOWN_W", "DOWN_B", "K_CACHE",
                "V_CACHE", "K_SCALES", "V_SCALES", "WINDOW", "QKV_LA", "QKV_LB", "O_LA", "O_LB", "GU_LA", "GU_LB",
                "DOWN_LA", "DOWN_LB", "QKV_P", "O_P", "GU_P", "DOWN_P", "QKV_S", "O_S", "GU_S", "DOWN_S")  # fmt: skip
LORA_LINEARS = ("QKV", "O", "GU", "DOWN")
PHASES = ("NORM", "QKV", "ROPE", "ATTN", "O", "GATE_UP", "ACT", "DOWN", "OTHER")  # the stack's clocks, "T_" + name
ENUMS = {"Fn": FNS, "Dim": DIMS, "LayerField": LAYER_FIELDS, "PartField": PART_FIELDS, "Kind": KINDS,
         "Phase": tuple(f"T_{p}" for p in PHASES)}  # fmt: skip
BINDINGS = {
    "decode_stack.cpp": {
        "fulcrum_decode_stack": (I64, I64, PTR, PTR, PTR, I64, PTR, F32, F32, *[PTR] * 6, I64, I64, PTR, PTR),
        "fulcrum_decode_stack_timers": (I64, I64, PTR),
    }
}
MAX_ROWS = 4096  # decode rows of one fused step at most, where sgemm takes the GEMV's place


def enabled() -> bool:
    return os.environ.get("FULCRUM_FUSED_DECODE", "1") != "0"


@functools.cache
def _lib():
    for enum, fields in ENUMS.items():
        cpu_ext.check_enum("decode_stack.cpp", enum, fields)
    # the driver needs no vector ISA of its own (its loops are the residual adds): built where the kernels it calls are
    level = cpu_ext.best("avx512_bf16", "avx512", "avx2")
    return cpu_ext.load("decode_stack.cpp", level, BINDINGS["decode_stack.cpp"])


def _module():
    lib = _lib()
    return None if lib is None else lib.fulcrum_decode_stack


def phase_times(on: bool) -> dict[str, float]:
    """Seconds the fused stack spent in each kind of call (PHASES: the norms, each linear with its LoRA, RoPE with the
    cache write, attention, the activation, and OTHER: the residual adds and the queries' copy) since the last call,
    summed over layers and steps, its clocks then left on or off (`on`; off at start). Empty where there is no stack."""
    lib = _lib()
    if lib is None:
        return {}
    out = (ctypes.c_double * len(PHASES))()
    lib.fulcrum_decode_stack_timers(int(on), ctypes.addressof(out))
    return dict(zip((p.lower() for p in PHASES), out))


def available() -> bool:
    return _module() is not None


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def blas_sgemm() -> int:
    """The address of the sgemm_ torch's CPU library exports (MKL's, the one its fp32 F.linear calls), or 0."""
    try:
        return _address(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).sgemm_)
    except (OSError, AttributeError):
        return 0


@dataclass
class Part:
    """Rows of a linear's weight in one layout: DENSE (w in the activations' dtype), INT4 / INT8G / INT5
    (cpu_qgemv's grouped formats: scale, offset or None, group; INT5's fifth bits in `high`), INT8 / FP8
    (per-channel scale)."""

    kind: str
    w: torch.Tensor
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    group: int = 0
    high: torch.Tensor | None = None


class QuantWeight:
    """A linear's weight in quantized parts, as the driver reads it: a descriptor of int64s (see decode_stack.cpp)."""

    def __init__(self, parts: list[Part], in_features: int, dtype: torch.dtype):
        self.parts, self.dtype = parts, dtype
        rows = [p.w.shape[0] for p in parts]
        self.shape = (sum(rows), in_features)
        desc = [len(parts)]
        for p, r in zip(parts, rows):
            desc += [KINDS.index(p.kind), r, p.w.data_ptr(), _ptr(p.scale), _ptr(p.offset), p.group, _ptr(p.high)]
        self.descriptor = torch.tensor(desc, dtype=torch.int64)

    def data_ptr(self) -> int:
        return self.descriptor.data_ptr()

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in (p.w, p.scale, p.offset, p.high) if t is not None]

    def fits(self, dtype: torch.dtype) -> bool:
        """CPU, contiguous, dense parts in the activations' dtype, I a multiple of the kernels' 32 (int4's nibbles)."""
        return all(t.device.type == "cpu" and t.is_contiguous() for t in self.tensors()) and all(
            p.w.dtype == dtype
            if p.kind == "DENSE"
            else (p.kind != "INT4" or self.shape[1] % 32 == 0) and (p.kind != "INT5" or self.shape[1] % 64 == 0)
            for p in self.parts
        )


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@dataclass
class LayerTensors:
    """One Llama-shaped decoder layer's tensors, as the driver walks them."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    scale: float
    sliding_window: int | None
    # LoRA slots of qkv, o, gate_up and down (layers/lora.py): (A, B transposed) each, or None without LoRA
    lora: tuple | None = None
    # the packed weights of qkv, o, gate_up and down (cpu_prepack.pack: fulcrum's blocked layout or oneDNN's), or None
    packed: tuple | None = None
    # their copies in fulcrum's layout for few rows (cpu_prepack.pack_small, at the amx level), or None
    small: tuple | None = None

    def weights(self) -> list:
        return [self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight]


def _one_layout(copies: list[tuple | None], dtype: torch.dtype) -> bool:
    """Every layer holds this copy of its linears (packed or small), all of the model's dtype and of one layout, and
    the C entry point for it is built."""
    if any(c is None for c in copies):
        return False
    every = [w for c in copies for w in c]
    return (cpu_prepack.c_linear(every[0]) is not None and all(w.dtype == dtype for w in every)
            and len({cpu_prepack.is_blocked(w) for w in every}) == 1)  # fmt: skip


class DecodeStack:
    """The plan of one model's local decoder layers for decode-only steps of up to `max_rows` sequences."""

    def __init__(self, layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 softcap: float | None):  # fmt: skip
        first = layers[0]
        self.dtype = first.qkv_weight.dtype
        self.hidden = first.qkv_weight.shape[1]
        self.inter = first.down_weight.shape[1]
        quant = isinstance(first.qkv_weight, QuantWeight)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.softcap = eps, softcap or 0.0
        self.kind = cpu_ext.KV_CACHE_KINDS.get(first.k_cache.dtype, 0)
        self.gemv_rows = cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(self.dtype, 0)
        # past the GEMV's rows fp32 takes BLAS's sgemm; bf16 keeps the modules there (their oneDNN matmul)
        self.max_rows = MAX_ROWS if self.dtype == torch.float32 and blas_sgemm() else self.gemv_rows
        # the packed weights' matmul from the rows the modules take it at, called by the driver itself (no Python
        # between the layers' kernels at any batch): the stack takes every decode step. Without the C entry point
        # the modules keep the steps past stack_rows.
        self.packed_rows = 0
        if all(x.packed is not None for x in layers):
            if _one_layout([x.packed for x in layers], self.dtype):
                self.packed_rows, self.max_rows = cpu_prepack.min_rows(self.dtype), MAX_ROWS
            else:
                self.max_rows = min(self.max_rows, cpu_prepack.stack_rows(self.dtype))
        # the small copies from BLOCKED_MIN_ROWS to SMALL_ROWS rows, ahead of the packed weights (the same entry
        # point's arguments as fulcrum's layout takes them)
        small = self.packed_rows and _one_layout([x.small for x in layers], self.dtype)
        self.small_rows = cpu_prepack.SMALL_ROWS if small else 0
        # quantized parts: up to the rows their kernels take (the integer-dot kernel's for bf16 where every input
        # width suits it, else the widening GEMV's), and the dense parts' GEMV rows
        vnni_rows = 0
        if quant:
            kinds = {p.kind for x in layers for w in x.weights() for p in w.parts}
            widths = (self.hidden, num_heads * head_dim, self.inter)
            # all formats up to MAX_ROWS here, past the modules' FORMAT_ROWS: a step the stack leaves runs every
            # layer's modules and dequantizes every weight (measured: Q4_0/Q8_0 0.5B decode at 16-32 rows)
            if (self.dtype == torch.bfloat16 and cpu_qgemv_vnni.available() and all(w % 64 == 0 for w in widths)
                    and kinds - {"DENSE", "FP8"}):  # fmt: skip
                vnni_rows = cpu_qgemv_vnni.MAX_ROWS
            self.max_rows = max(vnni_rows, cpu_qgemv.max_rows(self.dtype))
            if "DENSE" in kinds:
                self.max_rows = min(self.max_rows, self.gemv_rows)
        self._layers = layers  # keeps every pointer below alive
        self.cache_ptr = first.k_cache.data_ptr()

        def ptr(t):
            return 0 if t is None else t.data_ptr()

        self.lora_rank = first.lora[0][0].shape[1] // 3 if first.lora else 0  # qkv's A holds 3 shards of R rows

        def lora_ptrs(x) -> dict:
            if not x.lora:
                return {}
            return {f"{n}_L{k}": ptr(t) for n, ab in zip(LORA_LINEARS, x.lora) for k, t in zip("AB", ab)}

        rows = [
            {**lora_ptrs(x), "IN_NORM": ptr(x.input_norm), "QKV_W": ptr(x.qkv_weight), "QKV_B": ptr(x.qkv_bias),
             "O_W": ptr(x.o_weight), "O_B": ptr(x.o_bias), "POST_NORM": ptr(x.post_norm),
             "GU_W": ptr(x.gate_up_weight), "GU_B": ptr(x.gate_up_bias), "DOWN_W": ptr(x.down_weight),
             "DOWN_B": ptr(x.down_bias), "K_CACHE": ptr(x.k_cache), "V_CACHE": ptr(x.v_cache),
             "K_SCALES": ptr(x.k_scales), "V_SCALES": ptr(x.v_scales), "WINDOW": x.sliding_window or 0,
             **({f"{n}_P": cpu_prepack.handle(t) for n, t in zip(("QKV", "O", "GU", "DOWN"), x.packed)}
                if self.packed_rows else {}),
             **({f"{n}_S": cpu_prepack.handle(t) for n, t in zip(("QKV", "O", "GU", "DOWN"), x.small)}
                if self.small_rows else {})}
            for x in layers
        ]  # fmt: skip
        self.table = torch.tensor([[r.get(f, 0) for f in LAYER_FIELDS] for r in rows], dtype=torch.int64)
        self.scales = torch.tensor([x.scale for x in layers], dtype=torch.float32)
        dims = {"HIDDEN": self.hidden, "HEADS": num_heads, "KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
                "INTER": self.inter, "BLOCK_SIZE": first.k_cache.shape[1], "CACHE_KIND": self.kind,
                "GEMV_ROWS": self.gemv_rows, "QUANT": int(quant), "VNNI_ROWS": vnni_rows,
                "LORA_RANK": self.lora_rank, "PACKED_ROWS": self.packed_rows, "SMALL_ROWS": self.small_rows,
                "SMALL_MIN_ROWS": cpu_prepack.BLOCKED_MIN_ROWS if self.small_rows else 0}  # fmt: skip
        self.dims = torch.tensor([dims[f] for f in DIMS], dtype=torch.int64)
        fns = {"GEMV": _address(cpu_gemv._module()[self.dtype]), "NORM": _address(cpu_norm._module()),
               "ROPE": _address(cpu_rope._module()), "ATTN": _address(cpu_attention._decode(bool(self.kind))),
               "ACT": _address(cpu_act._module()), "SGEMM": blas_sgemm(),
               "PACKED": _address(cpu_prepack.c_linear(first.packed[0])) if self.packed_rows else 0,
               "SMALL": _address(cpu_prepack.c_linear(first.small[0])) if self.small_rows else 0}  # fmt: skip
        q, qv = (cpu_qgemv._module() or {}) if quant else {}, (cpu_qgemv_vnni._module() or {}) if vnni_rows else {}
        for name, lib, key in (("Q4", q, "int4"), ("Q8G", q, "int8g"), ("Q8", q, "int8"), ("Q4V", qv, "int4"),
                               ("Q8GV", qv, "int8g"), ("Q8V", qv, "int8"), ("Q5", q, "int5"),
                               ("Q5V", qv, "int5")):  # fmt: skip
            fns[name] = _address(lib[key]) if key in lib else 0
        self.fns = torch.tensor([fns[f] for f in FNS], dtype=torch.int64)
        qkv = (num_heads + 2 * num_kv_heads) * head_dim
        self.per_row = 2 * self.hidden + qkv + 2 * num_heads * head_dim + 3 * self.inter
        if quant:  # a part's output before it is copied into its columns
            self.per_row += max(qkv, 2 * self.inter, self.hidden)
        # LoRA's buffers, once per call: one row's xa and one shard's delta
        self.lora_extra = 3 * self.lora_rank + max(qkv, 2 * self.inter, self.hidden) if self.lora_rank else 0
        self.scratch = torch.empty(max(self.gemv_rows, 1) * self.per_row + self.lora_extra, dtype=self.dtype)

    @staticmethod
    def supported(layers: list[LayerTensors], head_dim: int, group: int) -> bool:
        """Whether every kernel the driver calls exists here and takes these layers' tensors."""
        if not (layers and available()):
            return False
        first = layers[0]
        dtype = first.qkv_weight.dtype
        kind = cpu_ext.KV_CACHE_KINDS.get(first.k_cache.dtype, 0)
        quant = [w for x in layers for w in x.weights() if isinstance(w, QuantWeight)]
        if quant and (len(quant) != 4 * len(layers) or not cpu_qgemv.available()):
            return False  # every linear a descriptor, or none
        tensors = [t for x in layers for t in (x.input_norm, x.qkv_weight, x.qkv_bias, x.o_weight, x.o_bias,
                                              x.post_norm, x.gate_up_weight, x.gate_up_bias, x.down_weight,
                                              x.down_bias) if t is not None and not isinstance(t, QuantWeight)]  # fmt: skip
        return (
            dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
            and all(w.dtype == dtype and w.fits(dtype) for w in quant)
            and all(x.k_cache.dtype == first.k_cache.dtype and x.k_cache.is_contiguous() for x in layers)
            and (kind == 0 and first.k_cache.dtype == dtype or kind != 0 and first.k_scales is not None)
            and head_dim in cpu_attention.HEAD_DIMS
            and head_dim % 2 == 0
            and group <= cpu_attention.MAX_GROUP
            and cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(dtype, 0) > 0
            and all(k.available() for k in (cpu_gemv, cpu_norm, cpu_rope, cpu_act))
            and cpu_attention.available(bool(kind))
        )

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The residual stream after every layer, for x [M, hidden] (M <= max_rows, one decode token per row):
        a new tensor; the cache gets each row's k and v at its slot. `lora_slots` [M]: each row's LoRA slot (-1:
        none), for a stack built with the layers' LoRA slots."""
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place: the caller's tensor stays as it was
        if self.scratch.numel() < x.shape[0] * self.per_row + self.lora_extra:
            self.scratch = torch.empty(x.shape[0] * self.per_row + self.lora_extra, dtype=self.dtype)
        if lora_slots is not None:
            if not self.lora_rank:
                raise ValueError("decode stack: LoRA slots given to a stack built without them")
            lora_slots = lora_slots.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables, lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = _module()(
            self.dtype == torch.bfloat16, self.fns.data_ptr(), self.table.data_ptr(), self.scales.data_ptr(),
            self.table.shape[0], self.dims.data_ptr(), self.eps, self.softcap, x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1], x.shape[0],
            self.scratch.data_ptr(), 0 if lora_slots is None else lora_slots.data_ptr(),
        )  # fmt: skip
        if rc == -2:
            raise RuntimeError("decode stack: the packed weights' matmul failed")
        if rc != 0:
            raise ValueError(f"decode stack: unsupported head_dim {self.head_dim}")
        return x
