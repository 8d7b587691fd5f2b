"""``--output-format dcp``: what the operations add to write a PyTorch DCP checkpoint.

Every operation plans its full tensors as it does for a full model; this module picks the chunking
(``plan.dcp``): the source slices themselves for rank folders (nothing merged), the destination
strategy's rank boxes when one is given, else ``dcp_ranks`` even parts of dim 0 (default 1), and
re-cuts the plan with it. The options that only ``.ckpt`` outputs have (the crc trailer,
encryption) and an output prefix are refused before anything is read. An ``--overwrite`` removes an
earlier checkpoint's ``.metadata`` first (``superseded``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

from reshard.errors import UsageError
from reshard.execute.options import WriteOptions
from reshard.formats.dcp import DATA_SUFFIX, METADATA_NAME
from reshard.layout import LayoutTable
from reshard.ops.options import OutputSpec
from reshard.plan import Plan
from reshard.plan.dcp import Chunking, EvenRows, SourceSlices, StrategyBoxes, dcp_plan

FORMAT = "dcp"


def asked(output: OutputSpec | None) -> bool:
    """Whether the output is a DCP checkpoint."""
    return output is not None and output.format == FORMAT


def check_options(output: OutputSpec | None, write: WriteOptions | None, strategy_given: bool = False) -> None:
    """Refuse what a DCP output cannot have, and ``dcp_ranks`` without one (before any file is read)."""
    ranks = output.dcp_ranks if output is not None else None
    if not asked(output):
        if ranks is not None:
            raise UsageError("a DCP rank count needs --output-format dcp")
        return
    assert output is not None
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
    if strategy is not None:
        if output.dcp_ranks is not None:
            raise UsageError("give a destination strategy or a DCP rank count, not both")
        return StrategyBoxes(strategy)
    if output.dcp_ranks is None and sharded:
        return SourceSlices()
    return EvenRows(output.dcp_ranks or 1)


def superseded(dst: str, overwrite: bool, resume: bool) -> Callable[[Plan], list[str]]:
    """``Target.superseded`` of a DCP output: with ``--overwrite``, an earlier checkpoint's ``.metadata``
    (removed under the lock before the first data file is replaced, so no half-replaced folder ever
    looks complete) and the data files this plan does not write."""

    def stale(plan: Plan) -> list[str]:
        if not overwrite or resume or not os.path.isdir(dst):
            return []
        ours = {os.path.abspath(f.path) for f in plan.files}
        earlier = sorted(glob.glob(os.path.join(glob.escape(dst), f"__*{DATA_SUFFIX}")))
        found = [p for p in earlier if os.path.abspath(p) not in ours]
        metadata = os.path.join(dst, METADATA_NAME)
        return ([metadata] if os.path.isfile(metadata) else []) + found

    return stale


def as_dcp(full: Plan, folder: str, how: Chunking, notes: list[str]) -> Plan:
    """``full`` (a plan of full tensors) re-cut as a DCP checkpoint in ``folder``, ``.metadata`` last."""
    return dcp_plan(full, folder, how, notes)


__all__ = ["FORMAT", "as_dcp", "asked", "check_options", "chunking", "superseded"]
