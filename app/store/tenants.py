"""A router's pool lookup keyed by tenant: the cache salt and the LoRA adapter, as vLLM keys them.

The proxy has no vLLM ``Request``; it knows the request's ``cache_salt`` and ``model`` (the base
model's served name, or an adapter's name). vLLM keys a block on ``("lora", name, path)`` (every
block) and ``("cache_salt", salt)`` (the first block), in that order, and on nothing else for a
prompt without multimodal inputs or embeddings. The adapter's path is known only to the engines,
so this sidecar learns each adapter's (name, path) from its own engines' pool calls; a lookup for
an adapter it has not seen answers no hit rather than score the prompt on another tenant's
(or the base model's) entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from app.store.hashing import KeyRun

MAX_ADAPTERS = 1024


class TenantKeys:
    """The served base-model names and the adapters seen, for router lookups."""

    def __init__(self) -> None:
        self.served: set[str] = set()
        self._adapters: OrderedDict[str, str] = OrderedDict()  # name -> path, most recent last

    def serve(self, names: Iterable[str]) -> None:
        """Names an engine answers for its base model (its registration)."""
        self.served.update(names)

    def learn(self, runs: Sequence[KeyRun]) -> None:
        """Remember the adapter an engine's extra keys name (vLLM puts it in every block)."""
        if not runs:
            return
        for key in runs[0][1]:
            if isinstance(key, list | tuple) and len(key) == 3 and key[0] == "lora":
                name, path = key[1], key[2]
                if isinstance(name, str) and isinstance(path, str):
                    self._adapters[name] = path
                    self._adapters.move_to_end(name)
                    while len(self._adapters) > MAX_ADAPTERS:
                        self._adapters.popitem(last=False)

    def runs(self, cache_salt: str | None, model: str | None) -> list[KeyRun] | None:
        """The extra-key runs of a plain prompt of this tenant; None: an adapter this sidecar
        has not seen (its keys cannot be named)."""
        lora: list[Any] = []
        if model is not None and model not in self.served:
            path = self._adapters.get(model)
            if path is None:
                return None
            lora = [("lora", model, path)]
        first = lora + ([("cache_salt", cache_salt)] if cache_salt else [])
        return [(1, first), (0, lora)] if first != lora else [(0, lora)]
