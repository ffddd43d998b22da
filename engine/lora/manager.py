"""LoRAManager: the adapters an engine serves by name, and their weights in host memory.

Any thread may look a name up or register an adapter (the server's handlers, the tokenizer thread that prepares
requests); a lock guards the two maps. An adapter's weights are read and checked once (engine/lora/adapter.py) and
kept in an LRU of `--max-cpu-loras`; one pushed out is read again when next used. A request holds its adapter's
weights while it runs, so unloading an adapter never breaks a request already accepted: new requests stop finding
the name at once, and the weights go when the last request using them ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict

import torch

from pagekube.engine.errors import AdapterError
from pagekube.engine.lora.adapter import LoRAAdapter, read_adapter
from pagekube.engine.lora.request import LoRARequest

log = logging.getLogger("pagekube.engine")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 base_model_name: str):
        self.model, self.max_rank, self.max_cpu_loras, self.dtype = model, max_rank, max_cpu_loras, dtype
        self.base_model_name = base_model_name
        self.registered: dict[str, LoRARequest] = {}
        self.failed: dict[str, str] = {}  # adapters of --lora-modules that could not be served, and why
        self._weights: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with a fresh id: every load is new KV to the prefix cache, even under an old name."""
        return LoRARequest(name, next(self._ids), path, self.base_model_name)

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter, then serve it under its name. Raises AdapterError (nothing registered)."""
        if request.lora_name == self.base_model_name:
            raise AdapterError(f"LoRA adapter {request.lora_name!r}: the base model is served under that name")
        adapter = self.weights(request)
        with self._lock:
            if request.lora_name in self.registered:
                raise AdapterError(f"The lora adapter '{request.lora_name}' has already been loaded.")
            self.registered[request.lora_name] = request
            self.failed.pop(request.lora_name, None)  # loaded at run time after all
        log.info({"msg": "LoRA adapter loaded", "adapter": request.lora_name, "path": request.lora_path,
                  "rank": adapter.rank, "linears": len(adapter.weights)})
        return adapter

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            request = self.registered.pop(name, None)
            if request is not None:
                self._weights.pop(request.lora_int_id, None)
        if request is not None:
            log.info({"msg": "LoRA adapter unloaded", "adapter": name})
        return request

    def resolve(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.registered.get(name)

    def names(self) -> list[LoRARequest]:
        with self._lock:
            return list(self.registered.values())

    def states(self) -> dict[str, str]:
        """Every adapter by name: '' for one served, the reason for one of --lora-modules that could not be."""
        with self._lock:
            return {**self.failed, **{name: "" for name in self.registered}}

    def weights(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's checked weights: from the LRU, or read now (a request's own LoRARequest, offline)."""
        with self._lock:
            adapter = self._weights.get(request.lora_int_id)
            if adapter is not None and adapter.request == request:
                self._weights.move_to_end(request.lora_int_id)
                return adapter
        adapter = read_adapter(request, self.model, self.max_rank, self.dtype)
        with self._lock:
            self._weights[request.lora_int_id] = adapter
            while len(self._weights) > self.max_cpu_loras:
                self._weights.popitem(last=False)
        return adapter
