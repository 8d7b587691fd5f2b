"""A toy source kind, "an npyraw model", added from outside reshard through ``sources.registry.register``.

File 2 of 3 of the toy-format test (``tests/test_toy_format.py``): the source kind. An npyraw model
is a folder holding ``npyraw.index.json`` (``{"weight_map": {tensor: file}}``) and the ``.npyraw``
files it names. It holds a full model (``Traits(FULL)``), so every operation that reads full
models reads it; ``open`` gives the files, the weight map, and the model as rank 0 of a one-rank
job: one virtual file whose tensors name their own files (``SourceFile.homes``).
"""

from __future__ import annotations

import json
import os

from reshard.errors import FormatError
from reshard.plan import SourceFile
from reshard.sources import FULL, OpenedModel, ReadOptions, Traits, source_file
from tests.toy_npyraw import NAME

INDEX = "npyraw.index.json"


class NpyRawModel:
    name = "an npyraw model"
    looks_for = f"an npyraw model ({INDEX} and .npyraw files)"
    traits = Traits(FULL)

    def detect(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, INDEX))

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        index = os.path.join(path, INDEX)
        with open(index, encoding="utf-8") as fh:
            weight_map: dict[str, str] = json.load(fh)["weight_map"]
        files = {name: source_file(os.path.join(path, name), 0, options) for name in sorted(set(weight_map.values()))}
        tensors, homes = {}, {}
        for tensor, file in weight_map.items():
            if tensor not in files[file].tensors:
                raise FormatError(f"{INDEX} puts {tensor!r} in {file}, which does not hold it", index)
            tensors[tensor], homes[tensor] = files[file].tensors[tensor], files[file].path
        rank0 = SourceFile(os.path.join(path, "model"), 0, tensors, homes=homes)
        return OpenedModel(self.name, path, NAME, files, weight_map, ranks={0: rank0})


NPYRAW_MODEL = NpyRawModel()
