"""A DeepSpeed checkpoint engine that never pickles: safetensors + JSON.

DeepSpeed's default engine writes ``torch.save`` pickles and loads them with
``weights_only=False``: whoever can write the run directory could then run code
in the trainer. This engine stores the same nested state dicts DeepSpeed hands
it (model, ZeRO partitions, optimizer, our cursor in ``client_state``) as one
safetensors file: tensors under path-like keys, and the tree of everything else
as tagged JSON in the file's metadata. Anything that is neither a tensor nor
plain data is refused when saving, so loading can never need pickle.
"""
from __future__ import annotations

import enum
import json
import os
import re
from collections import OrderedDict

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hpcrl.rundir.fsio import fsync_path
from hpcrl.rundir.disk import guarded

_TREE_KEY = "hpcrl_tree"

# DeepSpeed puts a few small objects into ZeRO optimizer state (found by saving
# checkpoints of ZeRO 0-3, fp32 and bf16, with DeepSpeed 0.19.8). They
# hold plain data only, so they are stored as their attribute dict and rebuilt
# with ``cls.__new__`` + ``__dict__.update``: no constructor runs, nothing is
# imported by name from the file. Only the classes listed here are accepted.
_PLAIN_OBJECTS = {
    "LossScaler": "deepspeed.runtime.fp16.loss_scaler",
    "DynamicLossScaler": "deepspeed.runtime.fp16.loss_scaler",
    "fragment_address": "deepspeed.utils.tensor_fragment",  # ZeRO 1-3 param_slice_mappings
}


def _plain_object_class(name: str):
    import importlib

    if name not in _PLAIN_OBJECTS:
        raise ValueError(f"checkpoint names class {name!r}, which is not on the allowlist {sorted(_PLAIN_OBJECTS)}")
    return getattr(importlib.import_module(_PLAIN_OBJECTS[name]), name)


class UnsupportedCheckpointValue(TypeError):
    """DeepSpeed put a value in its state that the safe format does not allow (named by its path)."""

    pass


def _encode(obj, path: str, tensors: dict):
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, torch.Size):
        return {"__size__": list(obj)}
    if isinstance(obj, enum.Enum):
        return _encode(obj.value, path, tensors)
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, float) and obj != obj:
            return {"__float__": "nan"}
        if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
            return {"__float__": "inf" if obj > 0 else "-inf"}
        return obj
    if isinstance(obj, dict):
        items = [[_encode(k, f"{path}.<key>", tensors), _encode(v, f"{path}.{k}", tensors)] for k, v in obj.items()]
        return {"__dict__": items, "ordered": isinstance(obj, OrderedDict)}
    if isinstance(obj, (list, tuple, set)):
        tag = "__tuple__" if isinstance(obj, tuple) else "__set__" if isinstance(obj, set) else "__list__"
        return {tag: [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]}
    cls_name = type(obj).__name__
    if cls_name in _PLAIN_OBJECTS and type(obj) is _plain_object_class(cls_name):
        return {"__object__": cls_name, "attrs": _encode(dict(vars(obj)), f"{path}.<attrs>", tensors)}
    raise UnsupportedCheckpointValue(f"checkpoint value at {path} has type {type(obj).__name__}; "
                                     "only tensors and plain data can be stored without pickle")


def _decode(obj, tensors, map_location):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            t = tensors(obj["__tensor__"])
            return t.to(map_location) if map_location is not None and not callable(map_location) else t
        if "__size__" in obj:
            return torch.Size(obj["__size__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
        if "__object__" in obj:
            cls = _plain_object_class(obj["__object__"])
            inst = cls.__new__(cls)
            inst.__dict__.update(_decode(obj["attrs"], tensors, map_location))
            return inst
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__dict__" in obj:
            pairs = [(_decode(k, tensors, map_location), _decode(v, tensors, map_location)) for k, v in obj["__dict__"]]
            return OrderedDict(pairs) if obj.get("ordered") else dict(pairs)
        if "__list__" in obj:
            return [_decode(v, tensors, map_location) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors, map_location) for v in obj["__tuple__"])
        if "__set__" in obj:
            return {_decode(v, tensors, map_location) for v in obj["__set__"]}
        raise ValueError(f"unknown tagged value in checkpoint: {sorted(obj)}")
    return obj


def save_tree(state, path: str) -> None:
    """``state`` as a safetensors file at ``path`` (tmp -> fsync -> replace), waiting out a full disk
    (``disk.guarded``: a failed try's tmp is removed)."""
    tensors: dict = {}
    tree = _encode(state, "<root>", tensors)
    tmp = f"{path}.tmp"

    def write() -> None:
        try:
            save_file(tensors, tmp, metadata={_TREE_KEY: json.dumps(tree)})
        except SafetensorError as e:  # a full disk comes back as "I/O error: ... (os error 28)": an OSError for guarded
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), str(e)) from e
        fsync_path(tmp)
        os.replace(tmp, path)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    guarded(f"checkpoint file {os.path.basename(path)}", path, nbytes, write,
            undo=lambda: os.path.exists(tmp) and os.unlink(tmp))


def load_tree(path: str, map_location=None):
    with safe_open(path, framework="pt", device="cpu") as f:
        tree = json.loads(f.metadata()[_TREE_KEY])
        return _decode(tree, f.get_tensor, map_location)


class SafeCheckpointEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine that writes safetensors + JSON trees, never pickle."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = "HpcrlSafeCheckpointEngine"

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        save_tree(state_dict, path)

    def load(self, path: str, map_location=None):
        return load_tree(path, map_location)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False
