"""The per-tensor pipeline every operation runs its planning inputs through, in one fixed order.

filters (``--include``/``--exclude``/``--weights-only``), then dequantize/quantize (``--dequantize``,
``--quantize``), then casts (``--dtype``), then model maps (``--rename``/``--preset``): each step
changes the *planning inputs* (``SourceFile`` facts) once, so every planner's outputs, shard sizes
and metadata carry the result, and the executor only has to notice what the plan says. The steps
were hand-written in five places (transform's two paths, unify, split, convert); ``TensorPipeline.apply``
is now the one place, and an operation only says whether its inputs are whole tensors (then the
map is applied before planning, so a destination strategy slices the mapped tensors) or not (then
``after`` applies it to the plan).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from reshard import statenames
from reshard.errors import UsageError
from reshard.layout import LayoutTable
from reshard.naming import NameReport
from reshard.ops.options import TensorOptions
from reshard.ops.pending import PendingCheck
from reshard.plan import Plan, SourceFile, SourceTensor
from reshard.plan.cast import cast_files, cast_rule
from reshard.plan.quantized import (
    Dequantizer,
    Pair,
    Precision,
    block_of_slices,
    full_pairs,
    paired_layouts,
    sharded_pairs,
)
from reshard.plan.quantized_map import check_mapped_pairs
from reshard.plan.surgery import MAPPED_SOURCE, MappedModel, NameRun
from reshard.sources import ReadOptions, config_path, open_checkpoint

if TYPE_CHECKING:
    from reshard.plan.dcp import Chunking
    from reshard.sources.kind import OpenedChunks

TableT = TypeVar("TableT", bound=LayoutTable)


@dataclass
class Inputs:
    """Planning inputs: rank sources (``mapping`` None) or a full model's files and name -> file map.

    ``hyper``: unify's hyper-parameter file beside a unified model (split carries it over).
    ``model``: the map applied before planning (``MAPPED_SOURCE`` then stands for it in ``files``);
    ``read``: the files the plan's copies really read (before the map stood in for them). ``table``:
    rank sources' strategy, which block-scaled pairs are checked and laid out through.
    """

    files: dict[Any, SourceFile]  # rank -> file, or a full model's file key -> file
    mapping: dict[str, str] | None = None
    hyper: SourceFile | None = None
    model: MappedModel | None = None
    read: dict[Any, SourceFile] | None = None
    table: LayoutTable | None = None  # rank sources' strategy (after apply: each FP8 scale laid out as its weight)
    narrowed: dict[Any, SourceFile] | None = None  # rank sources after the filters, as stored
    stored: LayoutTable | None = None  # the strategy as given

    def resolve(self, plan: Plan) -> Plan:
        """``plan`` reading the real files again where the map stood in for them."""
        return self.model.resolve(plan) if self.model is not None else plan


class TensorPipeline:
    """One operation's filters, low precision, casts and map, applied by ``apply`` in that order."""

    def __init__(self, options: TensorOptions | None, src: str, optimizer_prefixes: Sequence[str] = ()) -> None:
        """Raises: UsageError: an unknown dtype, ``dtype_all`` without one, an unreadable ``config.json``."""
        tensors = options or TensorOptions()
        self.naming = NameRun(tensors.names)
        self.cast = cast_rule(tensors.dtype, tensors.dtype_all, optimizer_prefixes)
        self.dequantizer = _dequantizer(tensors.precision, src)
        self.precision, self.src = tensors.precision, src
        self.stored_pairs: dict[str, str] = {}  # each block-scaled pair the sources hold: weight -> scale

    @property
    def report(self) -> NameReport | None:
        """The name report (None: no filter and no map)."""
        return self.naming.report if self.naming.active else None

    def apply(
        self,
        inputs: Inputs,
        notes: list[str],
        *,
        whole: bool = False,
        also: tuple[Mapping[str, object], str] | None = None,
    ) -> Inputs:
        """``inputs`` filtered, dequantized or quantized, cast, and (``whole`` tensors) mapped.

        ``whole``: the inputs are full tensors (a full model, or one full file), so the map is
        applied now and the full tensors are checked against the model config (and ``also``, a
        Hugging Face source's own ``config.json``).

        Raises:
            UsageError: A filter that matches nothing, a NaN-free cast that overflows, a map for
                another model family, a model config the shapes contradict.
        """
        if inputs.mapping is None:
            narrowed, stored = self.naming.narrow(inputs.files), inputs.table
            if self.naming.model_map is not None:  # what ``finish`` checks the map kept together
                self._note_pairs({n: t for sf in narrowed.values() for n, t in sf.tensors.items()})
            table = self.paired(stored, sharded_pairs(narrowed, stored), "source", notes, narrowed, stored)
            files = self.dequantizer.ranks(narrowed, table) if self.dequantizer is not None else narrowed
            out = Inputs(cast_files(files, self.cast, notes), table=table, narrowed=narrowed, stored=stored)
            out.model = self.naming.mapped_file(out.files) if whole else None
        else:
            files, mapping, hyper = self.naming.narrow_full(inputs.files, inputs.mapping, inputs.hyper)
            if self.naming.model_map is not None:
                self._note_pairs({n: files[f].tensors[n] for n, f in mapping.items()})
            if self.dequantizer is not None:
                files, mapping = self.dequantizer.full(files, mapping)
            hyper = cast_files({0: hyper}, self.cast)[0] if hyper is not None else None
            out = Inputs(cast_files(files, self.cast, notes), mapping, hyper)
            out.model = self.naming.mapped_model(out.files, mapping) if whole else None
        out.read = out.files
        if whole:
            self.naming.check_config(full_tensors(out.files.values()), also)
        if out.model is not None and out.mapping is None:
            out.files = {r: replace(out.model.source, rank=r) for r in out.files}
        elif out.model is not None:
            out.files, out.mapping = {MAPPED_SOURCE: out.model.source}, out.model.name_to_file
        return out

    def resourced(self, plan: Plan, opened: OpenedChunks) -> Plan:
        """``plan`` of a chunked source's virtual model reading its chunks (``ops.chunked.resourced``), the
        tensors ``--dequantize`` / ``--quantize`` computes from its pairs read from their chunks too."""
        from reshard.ops import chunked  # the DCP readers and box planner load only for a chunked source

        records = self.dequantizer.records if self.dequantizer is not None else None
        return chunked.resourced(plan, opened, records)

    def _note_pairs(self, tensors: Mapping[str, SourceTensor]) -> None:
        self.stored_pairs = {w: pair.scale for w, pair in full_pairs(tensors).items()}

    def paired(
        self,
        table: TableT | None,
        pairs: dict[str, Pair],
        side: str,
        notes: list[str],
        ranks: Mapping[Any, SourceFile] | None = None,
        ranks_table: LayoutTable | None = None,
    ) -> TableT | None:
        """``table`` laying out each FP8 weight's block scale as the weight (``plan.quantized.paired_layouts``);
        the block size given, else in config.json, else shown by the slices of ``ranks`` (cut by ``ranks_table``).

        Raises:
            UsageError: A cut not on a block boundary, a block size unknown for a cut weight.
        """
        seen = functools.partial(block_of_slices, ranks, ranks_table) if ranks is not None else None
        precision = self.precision or Precision()
        block = functools.partial(precision.pair_block, functools.partial(_config_beside, self.src), seen)
        # A StrategyFile stays one (dataclasses.replace); another table becomes a PairedTable of the same layouts.
        return cast("TableT | None", paired_layouts(table, pairs, block, side, notes))

    def dcp_pairs(self, plan: Plan, how: Chunking) -> Chunking:
        """``how`` cutting ``plan``'s FP8 weights in whole block rows (``--dcp-ranks``), checked: a cut off their
        block grid is refused (``plan.quantized_dcp``)."""
        from reshard.plan.quantized_dcp import block_grains, check_even_rows

        precision = self.precision or Precision()
        block = functools.partial(precision.pair_block, functools.partial(_config_beside, self.src))
        how = block_grains(plan, how, block)
        check_even_rows(plan, how, block)
        return how

    def dcp_config(self, plan: Plan, notes: list[str]) -> dict[str, object] | None:
        """The ``config.json`` a DCP output of ``plan`` carries so that its FP8 pairs' block size is known when
        it is read back (None: no FP8 pair out; or a note when the block size is not known here either)."""
        from reshard.plan.quantized_dcp import config_for_dcp, fp8_pairs  # DCP outputs only

        pairs = fp8_pairs(plan)
        if not pairs:
            return None
        precision = self.precision or Precision()
        config = _config_beside(self.src)
        doc = config_for_dcp(precision.pair_block(lambda: config), config, precision.quantize is not None)
        if doc is None:
            notes.append(
                f"the output holds {len(pairs)} FP8 block pairs ({pairs[0]}, ...) and no config.json beside the source "
                "gives their block size: reading it back with --dequantize will need --block-size"
            )
        return doc

    def paired_destination(self, table: TableT | None, inputs: Inputs, notes: list[str]) -> TableT | None:
        """The destination ``table`` with the pairs of ``inputs`` (as planned: after the map) laid out together."""
        if inputs.mapping is not None:
            pairs = full_pairs({n: inputs.files[f].tensors[n] for n, f in inputs.mapping.items()})
            return self.paired(table, pairs, "destination", notes)
        if inputs.table is not None:
            pairs = sharded_pairs(inputs.files, inputs.table)
        else:
            pairs = full_pairs(next(iter(inputs.files.values())).tensors)
        return self.paired(table, pairs, "destination", notes, inputs.narrowed, inputs.stored)

    def defer_quantize(self) -> None:
        """With a model map, ``--quantize`` applies to the map's outputs (``planned``): DeepSeek's rule, their names."""
        if self.dequantizer is not None:
            self.dequantizer.defer(self.naming.model_map is not None)

    def planned(self, plan: Plan, full: bool) -> Plan:
        """``plan`` with its outputs quantized when ``--quantize`` waited for a model map (``full``: whole tensors out).

        Raises:
            UnsupportedError: A deferred quantization of sharded outputs.
        """
        return self.dequantizer.planned(plan, full) if self.dequantizer is not None else plan

    def after(self, plan: Plan, inputs: Inputs, full: bool) -> Plan:
        """``plan`` with the map applied, when it was not applied before planning."""
        return self.naming.after(plan, list(inputs.read.values() if inputs.read else ()), full=full)

    def check_config(self, tensors: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """Full tensors (of a plan writing a full model, say) agree with the model config."""
        self.naming.check_config(tensors)

    def finish(self, plan: Plan, notes: list[str], read: ReadOptions | None = None) -> Plan:
        """``plan`` carrying what its dequantized tensors are read from (a note says how many).

        Raises:
            UsageError: A NaN or infinite block scale (read now: planning refuses it, nothing is written).
            UnsupportedError: A model map that renames a block-scaled pair's weight and its scale apart, or
                joins, stacks, splits or transposes it (``plan.quantized_map``).
        """
        if self.naming.model_map is not None and (self.precision is None or self.precision.dequantize is None):
            check_mapped_pairs(plan, self.naming.model_map.name, self.stored_pairs)
        if self.dequantizer is None:
            return plan
        from reshard.execute import dequant

        note = self.dequantizer.note()
        if note is not None:
            notes.append(note)
        plan = self.dequantizer.attach(plan)
        opened = replace(read, verify_crc=False) if read is not None else None
        dequant.check_scales(plan, lambda path: open_checkpoint(path, opened))
        return plan


def _dequantizer(precision: Precision | None, src: str) -> Dequantizer | None:
    """The run's dequantization (None without one), with the block size of the source's config.json."""
    if precision is None or not precision.active:
        return precision.dequantizer(None) if precision is not None else None
    return precision.dequantizer(_config_beside(src))


def _config_beside(src: str) -> dict[str, object] | None:
    """The ``config.json`` of a source (``sources.config_path``: a Hugging Face folder's own, a Megatron-LM run's
    checkpoint's), or None: the block size of its quantized weights."""
    import json

    path = config_path(src)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    return doc if isinstance(doc, dict) else None


def full_tensors(files: Iterable[SourceFile]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a full model's tensors, for ``NameRun.check_config`` (read only with a config)."""
    return ((name, t.shape) for f in files for name, t in f.tensors.items())


def plan_tensors(plan: Plan) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a plan's output tensors (whole tensors when it writes a full model)."""
    return ((t.name, t.shape) for f in plan.files for t in f.tensors)


def training_state_note(plan: Plan, notes: list[str]) -> None:
    """A Hugging Face folder is what ``transformers`` loads (weights only): say when training state goes in."""
    state = sorted({t.name for f in plan.files for t in f.tensors if statenames.DEFAULT.is_state(t.name)})
    if state:
        shown = ", ".join(state[:3]) + (", ..." if len(state) > 3 else "")
        notes.append(
            f"the Hugging Face output holds {len(state)} training-state tensor(s) beside the weights ({shown}); "
            "transformers loads model weights only"
        )


def check_copies(
    sources: Mapping[int, SourceFile], sf: LayoutTable | None, read: ReadOptions | None, absent: Sequence[str] = ()
) -> PendingCheck | None:
    """The copies of a slice the source strategy calls replicas hold the same bytes (sampled:
    ``reshard.sources.replicas``), checked once a plan is made from them, beside the copy: no output
    is renamed into place before it passed (``ops.pending``). None: no strategy, nothing to check.
    ``absent``: files not here (a Checkpoint 2.0 opened for some ranks), whose copies are passed over."""
    if sf is None:
        return None
    from reshard.sources.replicas import check_replicas

    return PendingCheck(lambda: check_replicas(sources, sf, read, absent=absent), name="reshard-replicas")


__all__ = [
    "Inputs",
    "TensorPipeline",
    "check_copies",
    "full_tensors",
    "plan_tensors",
    "training_state_note",
]
