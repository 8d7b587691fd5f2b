"""Hugging Face sharded safetensors: shard sizes, file names and ``model.safetensors.index.json``.

A Hugging Face model folder holds ``model-00001-of-0000N.safetensors`` ... and an index
``{"metadata": {"total_size": ...}, "weight_map": {name: shard file}}``, or one ``model.safetensors``
and no index when everything fits one shard. MindSpore's unified layout (``part<j>.safetensors`` +
``param_name_map.json``) is the same idea with other names and packing, so reading goes through one
weight-map reader for both (``read_weight_map``); only the Hugging Face index is checked strictly,
because MindFormers' ``name_map`` legitimately lists names its part files store under other keys.

What we rely on, and from where (``huggingface_hub/serialization/_base.py`` and transformers'
``modeling_utils.save_pretrained``, read as public source; no dependency on either):

* **Sharding** (``split_state_dict_into_shards_factory``): tensors in the order given; a tensor
  larger than ``max_shard_size`` gets a shard of its own, appended at once (so it is numbered
  *before* the shard still being filled); otherwise the open shard is closed when adding the
  tensor would exceed the limit. One shard: ``model.safetensors`` and no index; several:
  ``model-{i:05d}-of-{n:05d}.safetensors`` numbered from 1. ``total_size`` is the sum of the
  tensors' byte sizes. String entries are skipped by the library; we never hand it any.
* **Sizes** (``parse_size_to_int``): ``KB/MB/GB/TB`` are decimal (``5GB`` = 5 * 10**9, the default),
  the value may be fractional and is truncated as ``int(value * unit)``. ``reshard.text.parse_size``
  reads them so, and also binary units (``KiB/MiB/GiB/TiB``, ``K/M/G/T``), ``B`` and a byte count.
* **Index text**: ``json.dumps(index, indent=2, sort_keys=True) + "\\n"`` as ``save_pretrained``
  writes it (``huggingface_hub.save_torch_state_dict`` writes the same without sorting).
* **Shard metadata** ``{"format": "pt"}``: transformers refuses a safetensors shard whose metadata
  ``format`` is not ``pt``/``tf``/``flax``/``mlx``, so MindSpore's ``"ms"`` would not load there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.errors import FormatError, UsageError

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's MAX_SHARD_SIZE = "5GB" (decimal)
INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"  # other libraries prefix it (diffusion_pytorch_model...)
SINGLE_NAME = "model.safetensors"
SHARD_METADATA = (("format", "pt"),)  # what transformers accepts; see the module docstring
INDEX_INDENT = 2


def shard_groups(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """The names of each shard, in order, by ``split_state_dict_into_shards_factory``'s rule."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:  # its own shard, appended now: before the open one
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` ..."""
    if count <= 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_text(total_size: int, weight_map: Mapping[str, str]) -> str:
    """The index file's text, byte for byte as ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return json.dumps(index, indent=INDEX_INDENT, sort_keys=True) + "\n"


def is_index_file(path: str) -> bool:
    return path.endswith(INDEX_SUFFIX) and os.path.isfile(path)


def find_index(path: str) -> str | None:
    """The Hugging Face index ``path`` is, or the one its folder holds; None when there is none."""
    if is_index_file(path):
        return path
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return os.path.join(path, INDEX_NAME)
    found = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
    if len(found) > 1:
        raise UsageError(f"several Hugging Face index files ({', '.join(found)}); give one of them", path)
    return os.path.join(path, found[0]) if found else None


def read_weight_map(index_path: str, strict: bool = True) -> dict[str, str]:
    """``name -> file`` of an index: a Hugging Face index (``strict``) or MindSpore's ``param_name_map.json``.

    ``strict`` requires the ``weight_map`` object, string file names that stay inside the folder
    and no name listed twice; otherwise a bare ``{name: file}`` object is accepted too, as before.
    """
    try:
        with open(index_path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_pairs)
    except OSError as exc:
        raise UsageError(f"cannot read the index: {exc.strerror or exc}", index_path) from None
    except json.JSONDecodeError as exc:
        raise FormatError(f"malformed JSON: {exc.msg} (line {exc.lineno} column {exc.colno})", index_path) from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"malformed JSON: {exc}", index_path) from None
    mapping = data.get("weight_map", None if strict else data) if isinstance(data, dict) else None
    if not isinstance(mapping, dict):
        raise FormatError("the index has no weight_map object", index_path)
    duplicated = getattr(mapping, "duplicated", None)
    if strict and duplicated:
        raise FormatError(f"{duplicated!r} is listed twice in the weight_map", index_path)
    if strict:
        for name, file in mapping.items():
            _check_shard_name(name, file, index_path)
    return dict(mapping)


class _Object(dict[str, Any]):
    """A JSON object that remembers the first key it saw twice (``json`` keeps the last silently)."""

    duplicated: str | None = None


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    for key, value in pairs:
        if key in obj and obj.duplicated is None:
            obj.duplicated = key
        obj[key] = value
    return obj


def _check_shard_name(name: str, file: Any, index_path: str) -> None:
    if not isinstance(file, str) or not file:
        raise FormatError(f"weight_map[{name!r}] is not a file name", index_path)
    parts = file.replace("\\", "/").split("/")
    if os.path.isabs(file) or ".." in parts:
        raise FormatError(f"weight_map[{name!r}] = {file!r} points outside the model folder", index_path)


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "SHARD_METADATA",
    "SINGLE_NAME",
    "find_index",
    "index_text",
    "is_index_file",
    "read_weight_map",
    "shard_groups",
    "shard_names",
]
