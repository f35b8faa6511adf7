"""Reading a PyTorch DCP `.metadata` without torch: which storage files a checkpoint needs.

A DCP checkpoint directory is complete when every storage file named by its `.metadata` is
there. The multi-node commit (cachemgr.engine) waits for exactly that list, whichever node
wrote each file. `.metadata` is a pickle of `torch.distributed.checkpoint.metadata.Metadata`
whose `storage_data` maps each item to a `_StorageInfo(relative_path, offset, length, ...)`.

The daemon must not import torch (seconds of start-up, GBs of address space) nor unpickle
untrusted bytes with real classes, so `_StubUnpickler` resolves every global to an inert stub
class: nothing is imported and nothing from the file is executed. Reconstructed objects only
carry their state dicts, from which the relative paths are read.
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import IO, Any

log = logging.getLogger(__name__)


class _Stub:
    """Stands for any class named in the pickle. Accepts any construction and any state."""

    _name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        # dataclasses with slots pickle as (None | dict, {slot: value}); plain ones as a dict.
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        # a stub "function" (e.g. torch.serialization helpers)
        return _Stub()


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes]) -> None:
        super().__init__(f)
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = type(name, (_Stub,), {"_name": f"{module}.{name}"})
        return cls

    def persistent_load(self, pid: object) -> _Stub:
        return _Stub()


def storage_files(data: bytes) -> set[str] | None:
    """Relative paths of the storage files a DCP `.metadata` names, or None if the bytes are not
    a DCP metadata pickle this code understands (the caller then falls back to the files the
    nodes announced)."""
    try:
        md = _StubUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any malformed pickle: not a DCP metadata we read
        log.warning("cannot read DCP .metadata (%d bytes): %s", len(data), e)
        return None
    storage = getattr(md, "__dict__", {}).get("storage_data")
    if not isinstance(storage, dict):
        log.warning("DCP .metadata has no storage_data (%s)", type(md).__name__)
        return None
    out: set[str] = set()
    for info in storage.values():
        rel = getattr(info, "__dict__", {}).get("relative_path")
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            log.warning("DCP .metadata names an unusable storage path %r", rel)
            return None
        out.add(rel)
    return out
