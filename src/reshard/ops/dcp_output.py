"""``--output-format dcp`` / ``torch_dist``: what the operations add to write a PyTorch DCP checkpoint.

Every operation plans its full tensors as it does for a full model; this module picks the chunking
(``plan.dcp``): the source slices themselves for rank folders (nothing merged), the destination
strategy's rank boxes when one is given, else ``dcp_ranks`` even parts of dim 0 (default 1), and
re-cuts the plan with it. The options that only ``.ckpt`` outputs have (the crc trailer,
encryption) and an output prefix are refused before anything is read. An ``--overwrite`` removes an
earlier checkpoint's ``.metadata`` first (``superseded``).

``torch_dist`` is Megatron-core's checkpoint: the same DCP data, then ``common.pt`` (carried byte for
byte from a torch_dist source, else the empty common state megatron-core writes), the source's
non-tensor values (Megatron's ShardedObjects, ``_extra_state``, which its loader asks for) carried byte
for byte in a data file of their own (``VALUES_FILE``), ``.metadata`` and
``metadata.json``, in megatron's order: ``metadata.json`` is what megatron's loader takes for "a
distributed checkpoint", so it comes after everything it describes. ``OutputSpec.iteration`` (the
``--dst-iteration`` flag) makes the destination a Megatron-LM run folder: the checkpoint in
``iter_<7 digits>/`` and ``latest_checkpointed_iteration.txt`` naming it, written last.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard import manifest
from reshard.errors import FormatError, UsageError
from reshard.execute.options import WriteOptions
from reshard.formats import megatron
from reshard.formats.dcp.names import DATA_SUFFIX, METADATA_NAME
from reshard.layout import LayoutTable
from reshard.ops.options import OutputSpec
from reshard.plan import Plan, TextOutput
from reshard.sources.full_model import CONFIG_NAME
from reshard.sources.kind import ByteValue, OpenedChunks

if TYPE_CHECKING:  # the DCP planners and records load when a DCP output is planned, not before
    from reshard.formats.dcp import BytesItem
    from reshard.plan.dcp import Chunking

FORMAT = "dcp"
TORCH_DIST = "torch_dist"  # Megatron-core's: DCP data + common.pt + metadata.json
FORMATS = (FORMAT, TORCH_DIST)  # the outputs written as DCP data
VALUES_FILE = f"__0_1{DATA_SUFFIX}"  # a DCP output's non-tensor values (the chunks are in __<r>_0)


def asked(output: OutputSpec | None) -> bool:
    """Whether the output is a DCP checkpoint (a plain one, or Megatron-core's ``torch_dist``)."""
    return output is not None and output.format in FORMATS


def save_folder(dst: str, output: OutputSpec | None) -> str:
    """Where the DCP files go: ``dst``, or a torch_dist run folder's ``iter_<7 digits>/``."""
    if output is not None and output.format == TORCH_DIST and output.iteration is not None:
        return os.path.join(dst, megatron.iteration_name(output.iteration))
    return dst


def check_iteration(output: OutputSpec | None, asked_by: str) -> None:
    """``--dst-iteration`` with an output that has none (split's and convert's: only torch_dist's run folder).

    Raises:
        UsageError: An iteration given for another output format.
    """
    if output is not None and output.iteration is not None and output.format != TORCH_DIST:
        raise UsageError(
            f"--dst-iteration applies to {asked_by} torch_dist (a Megatron-LM run folder), not to "
            f"{output.format or 'the default output format'}"
        )


def check_options(output: OutputSpec | None, write: WriteOptions | None, strategy_given: bool = False) -> None:
    """Refuse what a DCP output cannot have, and ``dcp_ranks`` without one (before any file is read)."""
    ranks = output.dcp_ranks if output is not None else None
    if not asked(output):
        if ranks is not None:
            raise UsageError("a DCP rank count needs --output-format dcp or torch_dist")
        return
    assert output is not None
    if output.iteration is not None and output.format == TORCH_DIST and output.iteration < 0:
        raise UsageError(f"an iteration is a number from 0, not {output.iteration}")
    if ranks is not None and ranks < 1:
        raise UsageError(f"a DCP checkpoint needs at least 1 rank, not {ranks}")
    if ranks is not None and strategy_given:
        raise UsageError("give a destination strategy or a DCP rank count, not both")
    if output.prefix is not None:
        raise UsageError("a DCP checkpoint's files are named __<rank>_0.distcp: give no --prefix")
    if write is not None and write.write_crc:
        raise UsageError("--crc is MindSpore's .ckpt trailer: a DCP checkpoint carries ZIP CRC-32s of its own")
    if write is not None and write.enc_key is not None:
        raise UsageError("a DCP checkpoint cannot be encrypted: give no encryption key")


def chunking(output: OutputSpec, strategy: LayoutTable | None, sharded: bool) -> Chunking:
    """The chunks to write: a strategy's rank boxes, ``dcp_ranks`` even row parts, or (``sharded`` sources
    without either) the source slices."""
    from reshard.plan.dcp import EvenRows, SourceSlices, StrategyBoxes

    if strategy is not None:
        if output.dcp_ranks is not None:
            raise UsageError("give a destination strategy or a DCP rank count, not both")
        return StrategyBoxes(strategy)
    if output.dcp_ranks is None and sharded:
        return SourceSlices()
    return EvenRows(output.dcp_ranks or 1)


def superseded(dst: str, overwrite: bool, resume: bool) -> Callable[[Plan], list[str]]:
    """``Target.superseded`` of a DCP output: with ``--overwrite``, an earlier checkpoint's ``.metadata``
    and Megatron's ``metadata.json`` (removed under the lock before the first data file is replaced, so
    no half-replaced folder ever looks complete), the data files this plan does not write, and the
    ``config.json`` an earlier run wrote that this plan does not write again."""

    def stale(plan: Plan) -> list[str]:
        if not overwrite or resume or not os.path.isdir(dst):
            return []
        ours = {os.path.abspath(f.path) for f in plan.files}
        earlier = sorted(glob.glob(os.path.join(glob.escape(dst), f"__*{DATA_SUFFIX}")))
        found = [p for p in earlier if os.path.abspath(p) not in ours]
        markers = [os.path.join(dst, n) for n in (megatron.CONFIG_NAME, METADATA_NAME)]
        written = {os.path.abspath(t.path) for t in plan.texts}
        config = [p for p in _earlier_config(dst) if os.path.abspath(p) not in written]
        return [p for p in markers if os.path.isfile(p)] + found + config

    return stale


def _earlier_config(dst: str) -> list[str]:
    """The ``config.json`` an earlier reshard run wrote beside its ``.metadata`` in ``dst`` (its manifest, in
    ``dst`` or in the run folder above, lists it): superseded like the data, or its block size would outlive
    the pairs it described. One a user put there is never touched."""
    path = os.path.join(dst, CONFIG_NAME)
    if not os.path.isfile(path):
        return []
    for root in (dst, os.path.dirname(os.path.abspath(dst))):
        if os.path.relpath(path, root).replace(os.sep, "/") in manifest.previous_outputs(root):
            return [path]
    return []


@dataclass(frozen=True)
class Carried:
    """What a chunked source hands a DCP output byte for byte: its ``.metadata``'s non-tensor values (an
    optimizer's step and param groups, Megatron's ShardedObjects) and, for a torch_dist output, a
    torch_dist source's ``common.pt`` (a path; None: megatron's empty common state)."""

    common: str | None = None
    values: Mapping[str, ByteValue] = field(default_factory=dict)


def as_dcp(
    full: Plan,
    folder: str,
    how: Chunking,
    notes: list[str],
    output: OutputSpec | None = None,
    carried: Carried | None = None,
    chunks: OpenedChunks | None = None,
    config: Mapping[str, object] | None = None,
) -> Plan:
    """``full`` (a plan of full tensors) re-cut as a DCP checkpoint in ``folder``, ``.metadata`` last, with
    the non-tensor values a chunked source ``carried``; as a torch_dist checkpoint when ``output`` asks for
    one, with a torch_dist source's ``common.pt`` too.
    ``chunks``: the chunked source ``full`` reads whole (``ops.chunked.virtual_model``): planned from its
    chunk boxes at once when it can be (``ops.chunked.boxed_dcp``), else re-sourced and re-cut.
    ``config``: a ``config.json`` written beside ``.metadata`` (``TensorPipeline.dcp_config``: the block
    size of the FP8 pairs it holds)."""
    carried = carried or Carried()
    if output is None or output.format != TORCH_DIST:  # a plain DCP checkpoint: the values, then .metadata
        values, items = _values_file(folder, carried.values)
        plan = _recut(full, folder, how, notes, chunks, items)
        plain = (*values, *_config_text(folder, config), *plan.texts)
        return Plan(plan.operation, plan.sources, plan.files, plain, plan.quantized)
    save = save_folder(folder, output)
    values, items = _values_file(save, carried.values)
    plan = _recut(full, save, how, notes, chunks, items)
    texts = [
        TextOutput(os.path.join(save, megatron.COMMON_NAME), _common_bytes(carried.common)),
        *values,
        *_config_text(save, config),
        *plan.texts,  # .metadata
        TextOutput(os.path.join(save, megatron.CONFIG_NAME), megatron.config_text()),
    ]
    if output.iteration is not None:  # Megatron-LM's tracker: str(iteration), no newline
        texts.append(TextOutput(os.path.join(folder, megatron.TRACKER_NAME), str(output.iteration)))
    return Plan(plan.operation, plan.sources, plan.files, tuple(texts), plan.quantized)


def _recut(
    full: Plan,
    folder: str,
    how: Chunking,
    notes: list[str],
    chunks: OpenedChunks | None,
    items: Sequence[BytesItem],
) -> Plan:
    """The DCP data of ``full`` in ``folder``: from the chunk boxes of ``chunks`` when they plan it, else
    every copy of a full tensor re-cut (``plan.dcp.dcp_plan``); ``items`` listed in its ``.metadata``."""
    from reshard.ops import chunked
    from reshard.plan.dcp import dcp_plan

    if chunks is None:
        return dcp_plan(full, folder, how, notes, items)
    boxed = chunked.boxed_dcp(full, chunks, folder, how, notes, items)
    return boxed or dcp_plan(chunked.resourced(full, chunks), folder, how, notes, items)


def _config_text(folder: str, config: Mapping[str, object] | None) -> list[TextOutput]:
    if config is None:
        return []
    # beside .metadata, where sources.config_path finds it again
    return [TextOutput(os.path.join(folder, CONFIG_NAME), json.dumps(config, indent=2) + "\n")]


def _common_bytes(path: str | None) -> bytes:
    if path is None:
        return megatron.empty_common()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise FormatError(f"cannot read it: {exc.strerror}", path) from None


def _values_file(save: str, values: Mapping[str, ByteValue]) -> tuple[list[TextOutput], list[BytesItem]]:
    """The source's non-tensor values, one after another in ``VALUES_FILE`` (a data file of their own,
    written before ``.metadata``), and the ``.metadata`` records of where each is."""
    if not values:
        return [], []
    from reshard.formats import dcp  # the DCP records (numpy) load with a DCP output's values

    data = bytearray()
    items = []
    for value in values.values():
        items.append(dcp.BytesItem(value.name, VALUES_FILE, len(data), value.length))
        data += _read_value(value)
    return [TextOutput(os.path.join(save, VALUES_FILE), bytes(data))], items


def _read_value(value: ByteValue) -> bytes:
    try:
        with open(value.file, "rb") as fh:
            data = os.pread(fh.fileno(), value.length, value.offset)
    except OSError as exc:
        raise FormatError(f"cannot read the value {value.name!r}: {exc.strerror}", value.file) from None
    if len(data) != value.length:
        raise FormatError(f"the value {value.name!r} is cut short ({len(data)} of {value.length} bytes)", value.file)
    return data


__all__ = [
    "FORMAT",
    "FORMATS",
    "TORCH_DIST",
    "VALUES_FILE",
    "Carried",
    "as_dcp",
    "asked",
    "check_iteration",
    "check_options",
    "chunking",
    "save_folder",
    "superseded",
]
