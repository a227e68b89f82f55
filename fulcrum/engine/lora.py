"""Multi-LoRA serving in the engine core: the adapters it knows (by name), their host copies (least recently used
dropped beyond `max_cpu_loras`, read again from their folder when needed) and the `max_loras` slots of the model's
layers. Before each step the adapters the step's requests name are put in slots (an adapter no running request
uses gives its slot up) and the layers are told which slot each token uses (layers/lora.py)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fulcrum.layers import lora as lora_layers
from fulcrum.models.lora import LoRAAdapter, LoRAError, attach_slots, read_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by its name (what requests and /v1/models call it), an id, and its PEFT folder."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, device: torch.device,
                 dtype: torch.dtype):  # fmt: skip
        self.layers = attach_slots(model, max_loras, max_rank, dtype)
        if not self.layers:
            raise LoRAError(f"{type(model).__name__} has no layers fulcrum applies LoRA adapters to")
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max(max_cpu_loras, max_loras)
        self.device = device
        self.paths: dict[str, Path] = {}  # every adapter known, by name
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # host copies, least recently used first
        self.slots: list[str | None] = [None] * max_loras
        self.slot_order: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))  # LRU of slots
        self.loads = 0  # adapters put in a slot
        self.evictions = 0  # adapters taken out of a slot for another

    # -- the registry ---------------------------------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> None:
        """Register an adapter (read and checked now: a bad one is refused before anything uses it)."""
        if name in self.paths:
            raise LoRAError(f"an adapter named {name!r} is already loaded", "lora_name")
        adapter = read_adapter(name, path, self.layers, self.max_rank)
        self.paths[name] = Path(path)
        self._keep(adapter)
        log.info("LoRA adapter %s: rank %d, %d layers, %.1f MiB (%s)", name, adapter.rank, len(adapter.layers),
                 adapter.nbytes / 2**20, path)  # fmt: skip

    def remove(self, name: str) -> None:
        if name not in self.paths:
            raise LoRAError(f"no adapter named {name!r} is loaded", "lora_name")
        del self.paths[name]
        self.host.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.lora.clear_slot(slot)

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        return list(self.paths)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # dropped from host memory: read again
            adapter = read_adapter(name, self.paths[name], self.layers, self.max_rank)
        self._keep(adapter)
        return adapter

    # -- each step ------------------------------------------------------------------------------------------------

    def prepare(self, names: list[str | None], tokens: list[int]) -> None:
        """The step's requests in order, each's adapter (None: the base model) and token count: put the adapters in
        slots and tell the layers each token's slot."""
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step names {len(wanted)} adapters, above max_loras {self.max_loras}")
        for name in wanted:
            if name not in self.slots:
                self._load(name, wanted)
            self.slot_order.move_to_end(self.slots.index(name))
        token_slots: list[int] = []
        for name, n in zip(names, tokens):
            token_slots.extend([self.slots.index(name) if name is not None else -1] * n)
        lora_layers.set_step(token_slots if wanted else None, self.device)

    def _load(self, name: str, keep: set[str]) -> None:
        slot = next((s for s in self.slot_order if self.slots[s] is None), None)
        if slot is None:  # the least recently used slot whose adapter this step does not need
            slot = next(s for s in self.slot_order if self.slots[s] not in keep)
            self.evictions += 1
        adapter = self._host_copy(name)
        for layer_name, layer in self.layers.items():
            shards, scaling = adapter.layers.get(layer_name, (None, 0.0))
            if shards is None:
                layer.lora.clear_slot(slot)
            else:
                layer.lora.set_slot(slot, shards, scaling)
        self.slots[slot] = name
        self.loads += 1

    def finish_step(self) -> None:
        lora_layers.set_step(None, self.device)

    def stats(self) -> dict[str, int]:
        return {"lora_loads": self.loads, "lora_evictions": self.evictions, "lora_adapters": len(self.paths)}
