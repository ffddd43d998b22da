"""The model side of multi-LoRA: adapter slots in every target Linear, and one step's rows per slot.

As vLLM's Punica path: `--max-loras` slots hold the adapters a step may use; a step's rows are grouped by slot and
each group gets `y += (x @ A.T) @ B.T` (shrink, then expand) on top of the base GEMM, which runs once for every row
whatever its adapter. Rows of the base model, and any Linear an adapter does not target, cost nothing. On a GPU
the groups are contiguous segments for the Triton kernels (pagekube/kernels/triton_lora.py); on the CPU each group
is one pair of small GEMMs in torch (rows of one adapter gathered where the batch interleaves adapters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagekube.engine.lora.adapter import LoRAAdapter

TARGET_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRAStep:
    """This step's rows, by slot: (slot, a slice of contiguous rows or an index tensor), and the segments
    (start, length, slot) the GPU kernels take. Empty: no adapter row in the step."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    segments: torch.Tensor | None = None  # [n, 3] int32 on the device (GPU only)
    max_segment: int = 0  # rows in the longest segment (the kernels' grid)

    @classmethod
    def of(cls, starts: list[int], item_slots: list[int], device: torch.device) -> LoRAStep:
        rows: dict[int, list[tuple[int, int]]] = {}
        for i, slot in enumerate(item_slots):
            if slot >= 0 and starts[i + 1] > starts[i]:
                rows.setdefault(slot, []).append((starts[i], starts[i + 1]))
        step = cls()
        for slot, spans in rows.items():
            if all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:])):  # one contiguous run
                step.groups.append((slot, slice(spans[0][0], spans[-1][1])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
                step.groups.append((slot, idx))
        if step.groups and device.type == "cuda":
            segs = [(a, b - a, s) for s, spans in rows.items() for a, b in spans]
            step.segments = torch.tensor(segs, dtype=torch.int32).to(device)
            step.max_segment = max(n for _, n, _ in segs)
        return step


class LoRALayer:
    """One Linear's adapter slots: `a` [slots, width, in], `b` [slots, out, width]; `width[s]` columns are used
    by the adapter in slot s (0: it does not target this Linear)."""

    def __init__(self, linear: torch.nn.Linear, slots: LoRASlots, width: int, dtype: torch.dtype,
                 device: torch.device):
        self.a = torch.zeros(slots.max_loras, width, linear.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots.max_loras, linear.out_features, width, dtype=dtype, device=device)
        self.width = [0] * slots.max_loras
        self.slots = slots

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base Linear's output for x) plus each adapter row's LoRA term."""
        step = self.slots.step
        if not step.groups:
            return y
        if step.segments is not None:
            from pagekube.kernels.triton_lora import lora_shrink_expand

            return lora_shrink_expand(x, y, self.a, self.b, step.segments, step.max_segment)
        for slot, rows in step.groups:
            w = self.width[slot]
            if w == 0:
                continue
            a, b = self.a[slot, :w], self.b[slot, :, :w]
            if isinstance(rows, slice):
                y[rows] += F.linear(F.linear(x[rows], a), b)
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))
        return y

    def load(self, slot: int, weights) -> None:
        """Put an adapter's weights for this Linear in `slot`, or none; the rest of the slot is zeroed, since the
        GPU kernels read the whole slot (a previous adapter's weights must not stay behind)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            self.width[slot] = 0
            return
        w = weights.a.shape[0]
        self.a[slot, :w] = weights.a
        self.b[slot, :, :w] = weights.b
        self.width[slot] = w


class LoRASlots:
    """`max_loras` slots in every target Linear of `model` (Linear.lora), which adapter each holds, and the step."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        from pagekube.engine.model.model import Linear

        self.max_loras = max_loras
        self.step = LoRAStep()
        self.layers: dict[str, LoRALayer] = {}
        embedding = model.model.embed_tokens.weight  # the model's dtype and device (a quantized Linear has no weight)
        for name, mod in model.named_modules():
            if isinstance(mod, Linear) and name.rsplit(".", 1)[-1] in TARGET_LINEARS:
                parts = len(getattr(mod, "output_sizes", [0]))
                mod.lora = self.layers[name] = LoRALayer(mod, self, parts * max_rank, embedding.dtype,
                                                         embedding.device)
        self.resident: list[int | None] = [None] * max_loras  # adapter id in each slot
        self._last_used = [0] * max_loras
        self._clock = 0

    def assign(self, adapters: dict[int, LoRAAdapter], on_load=None) -> dict[int, int]:
        """Slots for this step's adapters (at most max_loras: the scheduler's promise), loading the ones not
        resident into the least recently used slots that this step does not need; `on_load(slot, adapter)` is told
        of each (tensor parallelism: the other ranks load their slices into the same slot)."""
        self._clock += 1
        slot_of = {aid: s for s, aid in enumerate(self.resident) if aid in adapters}
        missing = [a for aid, a in adapters.items() if aid not in slot_of]
        free = sorted((s for s in range(self.max_loras) if self.resident[s] not in adapters),
                      key=lambda s: (self.resident[s] is not None, self._last_used[s]))
        if len(missing) > len(free):
            raise RuntimeError(f"{len(adapters)} adapters in one step exceed --max-loras {self.max_loras}")
        for adapter, slot in zip(missing, free, strict=False):
            if on_load is not None:
                on_load(slot, adapter)
            self.load(slot, adapter)
            slot_of[adapter.id] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            layer.load(slot, adapter.weights.get(name))
        self.resident[slot] = adapter.id
