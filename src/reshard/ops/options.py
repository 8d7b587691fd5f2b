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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard import arguments
from reshard.errors import UsageError

if TYPE_CHECKING:
    from reshard.naming.options import NameOptions
    from reshard.plan.quantized import Precision

# The output formats an operation can be asked for. "hf" is safetensors laid out as a Hugging Face
# model folder (shards + index); "checkpoint2" is MindFormers 2.x's Checkpoint 2.0; "dcp" a PyTorch
# Distributed Checkpoint folder (``__<r>_0.distcp`` data files, ``.metadata`` last: ``ops.dcp_output``);
# "torch_dist" Megatron-core's checkpoint (the DCP folder with common.pt and metadata.json).
OUTPUT_FORMATS = ("ckpt", "safetensors", "hf", "checkpoint2", "dcp", "torch_dist")
# What each operation writes (the first: its default where it has one). The operations check an
# ``OutputSpec.format`` against these and the command offers them (``hf`` as its own flag ``--hf``).
WRITES: dict[str, tuple[str, ...]] = {
    "transform": ("ckpt", "safetensors", "hf", "checkpoint2", "dcp", "torch_dist"),
    "split": ("safetensors", "ckpt", "dcp", "torch_dist"),
    "convert": ("ckpt", "safetensors", "hf", "dcp", "torch_dist"),
    "unify": ("safetensors", "hf", "dcp", "torch_dist"),
    "auto-transform": ("ckpt", "safetensors"),
}


def format_choices(operation: str) -> tuple[str, ...]:
    """The ``--output-format`` / ``--to`` choices of an operation: what it writes, ``hf`` aside (``--hf``)."""
    return tuple(f for f in WRITES[operation] if f != "hf")


@dataclass(frozen=True)
class OutputSpec:
    """What the outputs are: ``format`` (None: the operation's default, usually the source's format).

    ``prefix``: output file name prefix (MindSpore's ``dst_checkpoint_prefix``). ``max_shard_size``:
    Hugging Face shard size (``hf`` only; bytes or text such as ``"5GB"``). ``iteration``, ``common``
    and ``optimizer_prefixes``: a Checkpoint 2.0 output's iteration folder, the ``common.json``
    content and the names that go to its optimizer files (``checkpoint2`` only; ``iteration`` also
    makes a ``torch_dist`` output a Megatron-LM run folder). ``dcp_ranks``: a
    ``dcp`` / ``torch_dist`` output's data files, dim 0 cut into that many even parts (None: the source slices of rank
    folders, the destination strategy's boxes, or 1).
    """

    format: str | None = None
    prefix: str | None = None
    max_shard_size: int | str | None = None
    iteration: int | None = None
    common: Mapping[str, object] | None = None
    optimizer_prefixes: Sequence[str] = ()
    dcp_ranks: int | None = None

    def __post_init__(self) -> None:
        """Each field's type; the values (a format's name, an iteration's range) are checked by the
        operation that writes them, against what it writes."""
        arguments.optional_text(self.format, "OutputSpec.format")
        arguments.optional_text(self.prefix, "OutputSpec.prefix")
        size = self.max_shard_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, str))):
            raise UsageError(
                "OutputSpec.max_shard_size must be bytes (an int) or a size such as '5GB', "
                f"not {arguments.describe(size)}"
            )
        arguments.optional_whole(self.iteration, "OutputSpec.iteration", None)
        arguments.optional_whole(self.dcp_ranks, "OutputSpec.dcp_ranks", None)
        if self.common is not None and not isinstance(self.common, Mapping):
            raise UsageError(
                f"OutputSpec.common must be a dict of common.json values, not {arguments.describe(self.common)}"
            )
        if isinstance(self.optimizer_prefixes, str) or not isinstance(self.optimizer_prefixes, Sequence):
            raise UsageError(
                "OutputSpec.optimizer_prefixes must be a sequence of name prefixes such as ('adam_m.',), "
                f"not {arguments.describe(self.optimizer_prefixes)}"
            )


@dataclass(frozen=True)
class Destination:
    """How a run treats its destination: replace earlier outputs, resume, only plan, write a manifest."""

    overwrite: bool = False
    resume: bool = False
    dry_run: bool = False
    manifest: bool = True

    def __post_init__(self) -> None:
        """Each field a bool: a truthy string (``overwrite="no"``) would replace files unasked."""
        for name in ("overwrite", "resume", "dry_run", "manifest"):
            arguments.flag(getattr(self, name), f"Destination.{name}")


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

    def __post_init__(self) -> None:
        """Each field's type (a dict for ``names`` failed deep inside planning). The types of ``names`` and
        ``precision`` are imported only when given: the caller has imported them already."""
        if self.names is not None:
            from reshard.naming.options import NameOptions

            if not isinstance(self.names, NameOptions):
                raise UsageError(
                    "TensorOptions.names must be a NameOptions (from reshard.naming.options: filters and a model "
                    f"map, docs/naming.md), not {arguments.describe(self.names)}"
                )
        arguments.optional_text(self.dtype, "TensorOptions.dtype")
        arguments.flag(self.dtype_all, "TensorOptions.dtype_all")
        if self.precision is not None:
            from reshard.plan.quantized import Precision

            if not isinstance(self.precision, Precision):
                raise UsageError(
                    "TensorOptions.precision must be a Precision (from reshard.plan.quantized), "
                    f"not {arguments.describe(self.precision)}"
                )


@dataclass(frozen=True)
class UnifyOptions:
    """How ``unify`` packs its parts, as MindSpore's ``unified_safetensors`` does.

    ``file_suffix``: read the file of each rank folder whose name ends with this (MindSpore's literal
    suffix; None: ``ReadOptions``' choice). ``choice_func(name)``: False moves a parameter to
    ``hyper_param.safetensors``, a str renames it. ``split_dst_file``: ``(index, count)`` writes only
    part group ``index`` of ``count`` (``()``: all). ``mindspore_order``: pack in the folder listing
    order, as MindSpore (False: rank order).
    """

    file_suffix: str | None = None
    choice_func: Callable[[str], bool | str] | None = None
    split_dst_file: tuple[int, int] | tuple[()] = ()
    mindspore_order: bool = False

    def __post_init__(self) -> None:
        """The fields' types; ``split_dst_file``'s values are checked where the parts are packed."""
        arguments.optional_text(self.file_suffix, "UnifyOptions.file_suffix")
        arguments.hook(self.choice_func, "UnifyOptions.choice_func")
        arguments.flag(self.mindspore_order, "UnifyOptions.mindspore_order")


def _choices(names: Sequence[str]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def output_format(output: OutputSpec | None, allowed: Sequence[str], operation: str) -> str | None:
    """``output.format`` (None: the operation's default), checked against the formats ``operation`` writes.

    Raises:
        UsageError: A format that does not exist, or one the operation does not write (naming the choices).
    """
    fmt = output.format if output is not None else None
    if fmt is None:
        return None
    if fmt not in OUTPUT_FORMATS:
        raise UsageError(f"unknown output format {fmt!r} (choose {_choices(OUTPUT_FORMATS)})")
    if fmt not in allowed:
        raise UsageError(f"{operation} writes {_choices(tuple(allowed))}, not {fmt!r}")
    return fmt


def shard_bytes(output: OutputSpec | None) -> int | None:
    """The Hugging Face shard size in bytes (``format="hf"``; default ``5GB``), or None for other formats.

    Raises:
        UsageError: A shard size without Hugging Face output, or one that does not parse.
    """
    from reshard.formats.hf_index import DEFAULT_MAX_SHARD_SIZE
    from reshard.text import parse_size

    size = output.max_shard_size if output is not None else None
    if output is None or output.format != "hf":
        if size is not None:
            raise UsageError("a maximum shard size needs Hugging Face output (--hf)")
        return None
    return parse_size(DEFAULT_MAX_SHARD_SIZE if size is None else size, "the shard size")


__all__ = [
    "OUTPUT_FORMATS",
    "WRITES",
    "Destination",
    "OutputSpec",
    "TensorOptions",
    "UnifyOptions",
    "format_choices",
    "output_format",
    "shard_bytes",
]
