"""Reading tensors out of a model checkpoint as it is shipped: one safetensors file, a sharded checkpoint's index
(``model.safetensors.index.json``, whose ``weight_map`` names the shard of each key, as Hugging Face writes
them), or a directory that holds either. Only the tensors asked for are read (safetensors maps each shard and
copies out one tensor at a time); every other key is only listed.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Union

INDEX_NAME = "model.safetensors.index.json"
#: a shard's name as Hugging Face writes it: ``model-00001-of-00004.safetensors``
SHARD_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")
SINGLE_NAME = "model.safetensors"


class Checkpoint:
    """The keys of a checkpoint and their tensors (:meth:`get`). A context manager: the shards opened are closed
    at its end. Raises ``ValueError`` naming the path and what is wrong with it (the CLI prints it as one line)."""

    def __init__(self, path: Union[str, Path]):
        self.path = path = Path(path)
        if path.is_dir():
            path = self._in_dir(path)
        elif not path.is_file():
            raise ValueError(f"weights: {path} is not a file or a directory")
        shard = SHARD_NAME.search(path.name)
        if shard and int(shard.group(2)) > 1:      # the other shards' conv layers would be missing, silently
            raise ValueError(f"weights: {path} is shard {int(shard.group(1))} of {int(shard.group(2))} of a "
                             f"checkpoint (its name says so): give its directory, or the {INDEX_NAME} beside it")
        self.source = path
        self._stack = ExitStack()
        self._open: dict = {}               # shard path -> its open safetensors handle
        if path.name.endswith(".json"):
            self._shard_of = self._read_index(path)
        else:
            self._shard_of = {key: path for key in self._handle(path).keys()}

    @staticmethod
    def _in_dir(d: Path) -> Path:
        for name in (INDEX_NAME, SINGLE_NAME):
            if (d / name).is_file():
                return d / name
        files = sorted(p.name for p in d.glob("*.safetensors"))
        hint = (f" (it holds {', '.join(files[:4])}{' ...' if len(files) > 4 else ''}: give the one file, or "
                "the shards' index)") if files else ""
        raise ValueError(f"weights: the directory {d} holds neither {INDEX_NAME} nor {SINGLE_NAME}{hint}")

    @staticmethod
    def _read_index(path: Path) -> dict:
        try:
            index = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"weights: {path} is not a readable safetensors index ({type(e).__name__}: "
                             f"{str(e)[:120]})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"weights: {path} has no 'weight_map' of key -> shard file name (a sharded "
                             "checkpoint's index, as Hugging Face writes it)")
        out = {}
        for key, name in weight_map.items():
            shard = path.parent / name
            if Path(name).name != name:
                raise ValueError(f"weights: {path}: the shard of {key!r} is {name!r}, not a file name beside the "
                                 "index")
            out[key] = shard
        return out

    def _handle(self, shard: Path):
        h = self._open.get(shard)
        if h is None:
            from safetensors import SafetensorError, safe_open

            if not shard.is_file():
                raise ValueError(f"weights: the shard {shard} named by {self.source} is missing")
            try:
                h = self._stack.enter_context(safe_open(str(shard), framework="pt"))
            except SafetensorError as e:     # not a safetensors file, or a torn one: say so, not a traceback
                raise ValueError(f"weights: {shard} is not a readable safetensors file ({e})") from None
            self._open[shard] = h
        return h

    def keys(self) -> list:
        return list(self._shard_of)

    def get(self, key: str):
        """The tensor ``key`` (a torch tensor), read from its shard; ``ValueError`` when the shard lacks it."""
        h = self._handle(self._shard_of[key])
        if key not in h.keys():
            raise ValueError(f"weights: {self.source} says {key!r} is in {self._shard_of[key].name}, which has "
                             "no such tensor")
        return h.get_tensor(key)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
