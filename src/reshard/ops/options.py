"""What an operation writes, where and how it treats a destination, and what it does to tensors on the way.

Before these types the operations took 15 to 22 keywords each, and the output was described four
ways (an output format string, ``hf`` + a shard size, a prefix, Checkpoint 2.0's iteration and
texts). Three small values replace them, and the CLI's flag groups build exactly these:

* ``OutputSpec``: the output's format and the fields that only some formats have;
* ``Destination``: how a run treats its destination folder (overwrite, resume, dry run, manifest);
* ``TensorOptions``: the per-tensor pipeline, applied in one fixed order by every operation:
  filters (``names``), then dequantize/quantize (``precision``), then casts (``dtype``), then model
  maps (``names``).

How sources are read (``ReadOptions``), how outputs' bytes are made (``WriteOptions``) and how a run
executes (``RunOptions``) keep their own types in the layers that use them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.naming.options import NameOptions
    from reshard.plan.quantized import Precision

# The output formats an operation can be asked for. "hf" is safetensors laid out as a Hugging Face
# model folder (shards + index); "checkpoint2" is MindFormers 2.x's Checkpoint 2.0.
OUTPUT_FORMATS = ("ckpt", "safetensors", "hf", "checkpoint2")


@dataclass(frozen=True)
class OutputSpec:
    """What the outputs are: ``format`` (None: the operation's default, usually the source's format).

    ``prefix``: output file name prefix (MindSpore's ``dst_checkpoint_prefix``). ``max_shard_size``:
    Hugging Face shard size (``hf`` only; bytes or text such as ``"5GB"``). ``iteration``, ``common``
    and ``optimizer_prefixes``: a Checkpoint 2.0 output's iteration folder, the ``common.json``
    content and the names that go to its optimizer files (``checkpoint2`` only).
    """

    format: str | None = None
    prefix: str | None = None
    max_shard_size: int | str | None = None
    iteration: int | None = None
    common: Mapping[str, object] | None = None
    optimizer_prefixes: Sequence[str] = ()


@dataclass(frozen=True)
class Destination:
    """How a run treats its destination: replace earlier outputs, resume, only plan, write a manifest."""

    overwrite: bool = False
    resume: bool = False
    dry_run: bool = False
    manifest: bool = True


@dataclass(frozen=True)
class TensorOptions:
    """The per-tensor pipeline: filters and model maps (``names``), ``precision``, then ``dtype`` casts.

    ``dtype``: cast floating tensors to this dtype (``dtype_all``: every tensor). ``precision``:
    ``--dequantize`` / ``--quantize`` of block-scaled low precision.
    """

    names: NameOptions | None = None
    dtype: str | None = None
    dtype_all: bool = False
    precision: Precision | None = field(default=None)


__all__ = ["OUTPUT_FORMATS", "Destination", "OutputSpec", "TensorOptions"]
