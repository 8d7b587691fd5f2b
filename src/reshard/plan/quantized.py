"""Block-scaled low precision while planning (``--dequantize``): which stored pairs become which tensors.

Two stored layouts are understood (docs/low-precision.md):

* **FP8 blocks** (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): ``X`` is ``F8_E4M3`` (or ``F8_E5M2``)
  ``[..., rows, cols]`` and ``X_scale_inv`` (``X.weight`` -> ``X.weight_scale_inv``) is ``F32``,
  ``BF16`` or ``F8_E8M0`` ``[..., ceil(rows / b0), ceil(cols / b1)]``; the value is
  ``float32(X[i, j]) * float32(scale[i // b0, j // b1])``, edge blocks partial. The block size
  ``(b0, b1)`` comes from ``--block-size`` or ``config.json``'s ``quantization_config.weight_block_size``.
* **MXFP4** (gpt-oss): ``P_blocks`` is ``U8`` ``[E, R, G, 16]`` (two FP4 E2M1 values a byte, the
  low nibble first, 32 values a block) and ``P_scales`` ``U8``/``F8_E8M0`` ``[E, R, G]`` (a power
  of two, bias 127). ``P`` is ``[E, G * 32, R]``: transformers' own dequantization transposes the
  last two axes, and reshard writes what transformers holds after loading.

Like a cast (``reshard.plan.cast``), dequantizing rewrites the *planning inputs*: the pair is
replaced by one tensor of the target dtype (under the weight's name, or ``P``), the scale is gone,
and every planner sizes its outputs from that. What planners cannot know (how to compute the
values) is recorded as ``QuantizedSource`` facts that ``attach`` puts into the finished plan; the
executor (``reshard.execute.dequant``) reads each box of such a tensor from its stored pair, so no
tensor is ever dequantized whole. Every refusal here names the tensor and happens before any byte
is written.

``--quantize`` rewrites the planning inputs the same way, except with a model map (a preset to Hugging
Face names): DeepSeek's rule is about the map's outputs, so the finished plan's output tensors are
quantized instead (``Quantizer.planned``), each computed from its own copies.

Without either, a pair is moved as two tensors of bytes, and ``paired_layouts`` keeps each rank's pair
self-consistent: a scale the strategy does not name is laid out like its weight (FP8: axes counted in
blocks; MXFP4: without the 16 bytes of a block), and a cut off the block grid is refused here, while
planning, naming the tensor, the cut and the block. What ``inspect`` shows of pairs: ``quantized_view``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TypeVar

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import LayoutError, UnsupportedError, UsageError
from reshard.layout import Box, LayoutTable, ParamLayout, full_shape, layout_map, rank_boxes, split_stage_name
from reshard.plan.model import SCALE_INV, Copy, Plan, QuantizedSource, SourceFile, SourceTensor, TensorPlan

K = TypeVar("K")

FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"
QUANTIZE = "fp8-block-quantize"  # the F8_E4M3 values of a weight --quantize writes
QUANTIZE_SCALE = "fp8-block-quantize-scale"  # the F32 weight_scale_inv beside them
BLOCKS, SCALES = "_blocks", "_scales"  # P_blocks + P_scales -> P
DEFAULT_BLOCK = (128, 128)  # --quantize fp8-block: DeepSeek-V3's block


@dataclass(frozen=True)
class Dequantize:
    """``--dequantize``: every block-scaled pair becomes one tensor of ``target``.

    ``block``: the FP8 block size given by the user (None: the config's, else refused).

    Example:
        from reshard import dtypes
        from reshard.plan.quantized import Dequantize
        rule = Dequantize(dtypes.BFLOAT16, (128, 128))
        assert rule.block == (128, 128)
    """

    target: DType
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class Precision:
    """What an operation does to block-scaled low precision (what the operations' ``precision=`` takes).

    ``dequantize``: ``"bf16"``, ``"fp16"`` or ``"fp32"``: every FP8 block pair and MXFP4 pair becomes
    one tensor of that dtype (None: pairs are copied as they are). ``block_size``: the FP8 block
    ``(rows, cols)`` (None: ``config.json``'s ``quantization_config.weight_block_size``).

    Example:
        from reshard.plan.quantized import Precision
        p = Precision(dequantize="bf16", block_size=(128, 128))
        assert p.active
    """

    dequantize: str | None = None
    block_size: tuple[int, int] | None = None
    quantize: str | None = None  # "fp8-block"
    quantize_include: tuple[str, ...] = ()
    quantize_exclude: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.dequantize is not None or self.quantize is not None

    def pair_block(
        self, config: Callable[[], Mapping[str, object] | None], seen: Callable[[], Block] | None = None
    ) -> Block | None:
        """The FP8 block size of the pairs a strategy cuts: given, ``--quantize``'s, ``config()``'s, else ``seen()``
        (what a sharded source's slices show, ``block_of_slices``)."""
        if self.block_size is not None:
            return self.block_size
        if self.quantize is not None:
            return DEFAULT_BLOCK
        return block_from_config(config()) or (seen() if seen is not None else None)

    def dequantizer(self, config: Mapping[str, object] | None) -> Dequantizer | None:
        """The run's ``Dequantizer`` or ``Quantizer`` (None without either); ``config``: the source's config.json.

        Raises:
            UsageError: An unknown dtype or scheme, both at once, ``block_size`` alone, a bad config block size.
        """
        if self.quantize is not None:
            if self.dequantize is not None:
                raise UsageError("--quantize and --dequantize exclude each other")
            if self.quantize != FP8_BLOCK:
                raise UsageError(f"unknown --quantize {self.quantize!r} (choose fp8-block)")
            return Quantizer(self.block_size or DEFAULT_BLOCK, self.quantize_include, self.quantize_exclude)
        if self.quantize_include or self.quantize_exclude:
            raise UsageError("--quantize-include/--quantize-exclude need --quantize")
        if self.dequantize is None:
            return None  # a block size alone: the FP8 pairs a strategy cuts (``paired_layouts``)
        target = dequantize_target(self.dequantize)
        return Dequantizer(Dequantize(target, self.block_size), block_from_config(config))


def parse_block(text: str) -> tuple[int, int]:
    """``128`` or ``128x128`` / ``128,128`` (rows x cols) as a block size.

    Raises:
        UsageError: Not one or two positive integers.
    """
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) == 1:
        sizes *= 2
    if len(sizes) != 2 or min(sizes) <= 0:
        raise UsageError(f"--block-size {text!r}: give ROWS or ROWSxCOLS, positive integers (e.g. 128 or 128x128)")
    return sizes[0], sizes[1]


def block_from_config(config: Mapping[str, object] | None) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of a ``config.json`` (None when absent).

    Raises:
        UsageError: Present but not two positive integers.
    """
    qc = config.get("quantization_config") if config else None
    value = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise UsageError(f"config.json: quantization_config.weight_block_size {value!r} is not two positive integers")
    return value[0], value[1]


def dequantize_target(name: str) -> DType:
    """The dtype ``--dequantize NAME`` writes (bf16, fp16 or fp32, as ``--dtype`` spells them)."""
    try:
        return dtypes.cast_target(name)
    except UsageError:
        raise UsageError(f"unknown --dequantize {name!r} (choose bf16, fp16 or fp32)") from None


class Dequantizer:
    """One run's dequantization: rewrites its sources' planning facts, then attaches the recipe to its plan."""

    def __init__(self, rule: Dequantize, config_block: tuple[int, int] | None = None) -> None:
        self.rule = rule
        self.block = rule.block or config_block
        self.records: dict[tuple[str, str], QuantizedSource] = {}
        self.pairs = {FP8_BLOCK: 0, MXFP4: 0}
        self.deferred = False  # --quantize with a model map: applied to the planned outputs (``planned``)

    flag = "--dequantize"

    def defer(self, mapped: bool) -> None:
        """A model map renames and reshapes the tensors: --quantize then applies to the map's outputs
        (``planned``, DeepSeek's rule on the Hugging Face names); --dequantize always comes before it."""

    def planned(self, plan: Plan, full: bool) -> Plan:
        """``plan`` with its outputs quantized (``--quantize`` after a model map); ``plan`` itself otherwise."""
        return plan

    # ---- full models: names unique across files, a pair may span two files

    def full(
        self, files: Mapping[str, SourceFile], name_to_file: Mapping[str, str]
    ) -> tuple[dict[str, SourceFile], dict[str, str]]:
        """A full model's files and name map with every pair replaced by its dequantized tensor."""
        if self.deferred:
            return dict(files), dict(name_to_file)
        catalogue = {n: files[f] for n, f in name_to_file.items()}
        changes = self._changes(catalogue)
        new_files = {k: self._rewritten(sf, changes) for k, sf in files.items()}
        mapping: dict[str, str] = {}
        for n, f in name_to_file.items():
            if n in changes.dropped:
                continue
            out = changes.renamed.get(n, n)
            mapping[out] = f
            for added, _ in changes.added.get(n, ()):
                mapping[added] = f
        return new_files, mapping

    # ---- sharded sources: each file holds its own pairs

    def ranks(self, sources: Mapping[K, SourceFile], table: LayoutTable | None = None) -> dict[K, SourceFile]:
        """Per-rank sources with every pair (within one file) replaced by its dequantized tensor.

        ``table``: the source strategy, its pairs checked by ``paired_layouts`` (each rank's cut on the block
        grid, so each rank's pair dequantizes exactly); without one, several ranks holding pairs are refused.
        """
        if self.deferred:
            return dict(sources)
        out: dict[K, SourceFile] = {}
        checked: dict[frozenset[str], bool] = {}  # the pairs a rank holds (most ranks hold the same) -> exact
        for key, sf in sources.items():
            catalogue = dict.fromkeys(sf.tensors, sf)
            changes = self._changes(catalogue)
            made = frozenset(changes.made)
            if made and len(sources) > 1 and made not in checked:
                checked[made] = _paired_checked(table, sources, changes.made, self.block)
            if made and len(sources) > 1 and not checked[made]:
                # A rank's slice of a pair is only exact when its cut falls on a block boundary, which
                # a rank's file alone cannot tell: merge the pairs first (unify copies them as bytes).
                raise UnsupportedError(
                    f"{next(iter(changes.made))}: {self.flag} computes a rank's pair alone only when the source "
                    "strategy cuts it on its block grid, and this one does not (or the block size is unknown); "
                    f"merge the ranks first (unify or transform without {self.flag}), then run {self.flag} on that"
                )
            out[key] = self._rewritten(sf, changes)
        return out

    def note(self) -> str | None:
        """``--dequantize: 12 FP8 block pair(s), 2 MXFP4 pair(s) -> BFloat16 (scales consumed)``, or that none is."""
        if not any(self.pairs.values()):
            return "--dequantize: the source holds no FP8 block pair or MXFP4 pair: every tensor copied as it is"
        return (
            f"--dequantize: {self.pairs[FP8_BLOCK]} FP8 block pair(s), {self.pairs[MXFP4]} MXFP4 pair(s) "
            f"-> {self.rule.target.ms_name} (scale tensors consumed)"
        )

    def attach(self, plan: Plan) -> Plan:
        """``plan`` carrying the recipe of every dequantized tensor its copies read."""
        read = {(plan.sources[c.source], c.tensor) for f in plan.files for t in f.tensors for c in t.copies}
        used = tuple(r for key, r in self.records.items() if key in read)
        return replace(plan, quantized=used) if used else plan

    # ---- the rules

    def _changes(self, catalogue: Mapping[str, SourceFile]) -> _Changes:
        changes = _Changes()
        for name, sf in catalogue.items():
            t = sf.tensors[name]
            if name.endswith(SCALE_INV):
                self._fp8_pair(name[: -len(SCALE_INV)], name, catalogue, changes)
            elif name.endswith(SCALES) and t.dtype in (dtypes.UINT8, dtypes.FLOAT8_E8M0):
                self._mxfp4_pair(name[: -len(SCALES)], catalogue, changes)
            elif name.endswith(BLOCKS) and t.dtype is dtypes.UINT8:
                if name[: -len(BLOCKS)] + SCALES not in catalogue:
                    raise UsageError(f"{name}: MXFP4 blocks without their scales {name[: -len(BLOCKS)] + SCALES}")
            elif t.dtype in dtypes.FP8_WEIGHTS and name + SCALE_INV not in catalogue:
                raise UsageError(f"{name}: a {t.dtype} weight without its block scale {name + SCALE_INV}")
        return changes

    def _fp8_pair(self, weight: str, scale: str, catalogue: Mapping[str, SourceFile], changes: _Changes) -> None:
        if weight not in catalogue:
            raise UsageError(f"{scale}: a block scale without its weight {weight}")
        w, s = catalogue[weight].tensors[weight], catalogue[scale].tensors[scale]
        if w.dtype not in dtypes.FP8_WEIGHTS:
            raise UsageError(f"{weight}: has a block scale {scale} but is {w.dtype}, not F8_E4M3 or F8_E5M2")
        if s.dtype not in dtypes.FP8_SCALES:
            raise UsageError(f"{scale}: a block scale must be F32, BF16 or F8_E8M0, not {s.dtype}")
        if len(w.shape) < 2:
            raise UsageError(f"{weight}: a FP8 block-scaled weight needs 2 dimensions or more, not {list(w.shape)}")
        if self.block is None:
            raise UsageError(
                f"{weight}: FP8 block size unknown: no config.json beside the source gives "
                "quantization_config.weight_block_size (give --block-size, e.g. 128x128)"
            )
        b0, b1 = self.block
        want = (*w.shape[:-2], math.ceil(w.shape[-2] / b0), math.ceil(w.shape[-1] / b1))
        if s.shape != want:
            raise UsageError(
                f"{scale}: shape {list(s.shape)} does not fit weight {weight} {list(w.shape)} in "
                f"{b0}x{b1} blocks (expected {list(want)})"
            )
        self._record(weight, weight, scale, FP8_BLOCK, w.shape, (b0, b1), catalogue, changes)

    def _mxfp4_pair(self, stem: str, catalogue: Mapping[str, SourceFile], changes: _Changes) -> None:
        blocks, scales = stem + BLOCKS, stem + SCALES
        if blocks not in catalogue:
            raise UsageError(f"{scales}: MXFP4 scales without their blocks {blocks}")
        b, s = catalogue[blocks].tensors[blocks], catalogue[scales].tensors[scales]
        if b.dtype is not dtypes.UINT8:
            raise UsageError(f"{blocks}: MXFP4 blocks must be U8 (two FP4 values a byte), not {b.dtype}")
        per_block = dtypes.MXFP4_BLOCK // dtypes.LOW_PRECISION["MXFP4"].values_per_item
        if len(b.shape) != 4 or b.shape[-1] != per_block:
            raise UnsupportedError(
                f"{blocks}: MXFP4 blocks of shape {list(b.shape)}: reshard dequantizes [experts, rows, groups, "
                f"{per_block}] (gpt-oss)"
            )
        if s.shape != b.shape[:-1]:
            raise UsageError(f"{scales}: shape {list(s.shape)} does not fit blocks {blocks} {list(b.shape)}")
        e, r, g, _ = b.shape
        self._record(
            stem, blocks, scales, MXFP4, (e, g * dtypes.MXFP4_BLOCK, r), (dtypes.MXFP4_BLOCK,), catalogue, changes
        )

    def _record(
        self,
        out: str,
        weight: str,
        scale: str,
        kind: str,
        shape: tuple[int, ...],
        block: tuple[int, ...],
        catalogue: Mapping[str, SourceFile],
        changes: _Changes,
    ) -> None:
        wf, sf = catalogue[weight], catalogue[scale]
        target = self.rule.target
        changes.made[weight] = (out, SourceTensor(target, shape, math.prod(shape) * target.itemsize))
        changes.dropped.add(scale)
        if out != weight:
            changes.renamed[weight] = out
        path = wf.path_of(weight)
        key = (path, out)
        if key not in self.records:
            self.pairs[kind] += 1
            self.records[key] = QuantizedSource(
                path, out, kind, weight, sf.path_of(scale), scale, block, self.rule.target.st_code
            )

    def _rewritten(self, sf: SourceFile, changes: _Changes) -> SourceFile:
        if not any(n in changes.made or n in changes.dropped or n in changes.added for n in sf.tensors):
            return sf
        tensors: dict[str, SourceTensor] = {}
        homes = dict(sf.homes) if sf.homes else {}
        for name, t in sf.tensors.items():
            if name in changes.dropped:
                homes.pop(name, None)
            elif name in changes.made:
                out, made = changes.made[name]
                tensors[out] = made
                if out != name and name in homes:
                    homes[out] = homes.pop(name)
            else:
                tensors[name] = t
            for added, facts in changes.added.get(name, ()):
                tensors[added] = facts
                if name in homes:
                    homes[added] = homes[name]
        return replace(sf, tensors=tensors, homes=homes if sf.homes else sf.homes)


@dataclass
class _Changes:
    made: dict[str, tuple[str, SourceTensor]]  # stored values -> (output name, its planning facts)
    dropped: set[str]  # scales consumed
    renamed: dict[str, str]  # P_blocks -> P
    added: dict[str, list[tuple[str, SourceTensor]]]  # stored tensor -> tensors made beside it (scales)

    def __init__(self) -> None:
        self.made, self.dropped, self.renamed, self.added = {}, set(), {}, {}


# --------------------------------------------------------------------------------------------
# quantizing (--quantize fp8-block)

# Names the quantizing rule leaves alone (DeepSeek-V3's and transformers' own choice): embeddings,
# norms, the output head and MoE routers. Matched as substrings of the name, lower case.
NOT_QUANTIZED = ("embed", "norm", "lm_head", "router", ".gate.weight", "output_layer")


class Quantizer(Dequantizer):
    """``--quantize fp8-block``: every 2-D floating ``*.weight`` (but ``NOT_QUANTIZED``) becomes an F8_E4M3
    weight and an F32 ``*.weight_scale_inv`` beside it (DeepSeek's rule, ``reshard.execute.dequant``).

    ``include``/``exclude``: globs that override the rule (a name matching ``include`` is quantized if it is
    a 2-D float, one matching ``exclude`` never is).
    """

    flag = "--quantize"

    def __init__(self, block: tuple[int, int], include: Sequence[str] = (), exclude: Sequence[str] = ()) -> None:
        super().__init__(Dequantize(dtypes.FLOAT8_E4M3, block))
        self.include, self.exclude = tuple(include), tuple(exclude)
        self.pairs = {QUANTIZE: 0}
        self.not_2d: set[str] = set()  # names ``include`` matched that are no 2-D float (left as they are)

    def eligible(self, name: str, t: SourceTensor) -> bool:
        """Whether ``name`` (of ``t``) is quantized: the documented rule, then the user's globs."""
        import fnmatch

        included = any(fnmatch.fnmatchcase(name, g) for g in self.include)
        if t.dtype not in dtypes.CASTABLE or len(t.shape) != 2 or 0 in t.shape:
            if included:
                self.not_2d.add(name)
            return False
        if any(fnmatch.fnmatchcase(name, g) for g in self.exclude):
            return False
        if included:
            return True
        lower = name.lower()
        return name.endswith(".weight") and not any(part in lower for part in NOT_QUANTIZED)

    def defer(self, mapped: bool) -> None:
        self.deferred = mapped

    def planned(self, plan: Plan, full: bool) -> Plan:
        if not self.deferred:
            return plan
        if not full:
            raise UnsupportedError(
                "--quantize with a model map writes a full model (Hugging Face names): give no destination strategy"
            )
        return _quantized_outputs(self, plan)

    def note(self) -> str | None:
        left = f"; --quantize-include matched {len(self.not_2d)} tensor(s) not 2-D floats, left as they are"
        left = left if self.not_2d else ""
        if not self.pairs[QUANTIZE]:
            none = "--quantize: no tensor the rule quantizes (2-D linear weights, --include/--exclude): none changed"
            return none + left
        b0, b1 = self.block or DEFAULT_BLOCK
        return f"--quantize: {self.pairs[QUANTIZE]} weight(s) -> F8_E4M3 with F32 {b0}x{b1} block scales{left}"

    def _changes(self, catalogue: Mapping[str, SourceFile]) -> _Changes:
        changes = _Changes()
        b0, b1 = self.block or DEFAULT_BLOCK
        for name, sf in catalogue.items():
            t = sf.tensors[name]
            _refuse_quantized(name, t.dtype)
            if not self.eligible(name, t):
                continue
            scale = name + SCALE_INV
            if scale in catalogue:
                raise UsageError(f"{scale}: --quantize would write this name, which the source already holds")
            grid = (math.ceil(t.shape[0] / b0), math.ceil(t.shape[1] / b1))
            f8, f32 = dtypes.FLOAT8_E4M3, dtypes.FLOAT32
            changes.made[name] = (name, SourceTensor(f8, t.shape, math.prod(t.shape) * f8.itemsize))
            changes.added[name] = [(scale, SourceTensor(f32, grid, math.prod(grid) * f32.itemsize))]
            path = sf.path_of(name)
            if (path, name) not in self.records:
                self.pairs[QUANTIZE] += 1
            self.records[(path, name)] = QuantizedSource(path, name, QUANTIZE, name, path, scale, (b0, b1))
            self.records[(path, scale)] = QuantizedSource(path, scale, QUANTIZE_SCALE, name, path, scale, (b0, b1))
        return changes


def _quantized_outputs(quantizer: Quantizer, plan: Plan) -> Plan:
    """``plan`` with every eligible output tensor written as F8_E4M3 plus its F32 scale, computed from its copies.

    Each such tensor's copies (a model map's renames, joins and stacks of the stored tensors) are kept in the
    plan's ``quantized`` facts; the tensor itself and its new scale each read one whole "tensor" of the same
    name from the file of its first copy, which the executor computes (``reshard.execute.dequant``).
    """
    b0, b1 = quantizer.block or DEFAULT_BLOCK
    f8, f32 = dtypes.FLOAT8_E4M3, dtypes.FLOAT32
    sources = list(plan.sources)
    files = []
    for f in plan.files:
        tensors: list[TensorPlan] = []
        for t in f.tensors:
            _refuse_quantized(t.name, t.dtype)
            facts = SourceTensor(t.dtype, t.shape, t.nbytes)
            if not t.copies or t.literal is not None or not quantizer.eligible(t.name, facts):
                tensors.append(t)
                continue
            first = t.copies[0].source
            path, scale = sources[first], t.name + SCALE_INV
            grid = (math.ceil(t.shape[0] / b0), math.ceil(t.shape[1] / b1))
            for name, dtype, shape, kind in ((t.name, f8, t.shape, QUANTIZE), (scale, f32, grid, QUANTIZE_SCALE)):
                copy = Copy(first, name, (0, 0), (0, 0), shape, whole_source=True)
                tensors.append(TensorPlan(name, dtype, shape, (copy,), math.prod(shape) * dtype.itemsize))
                quantizer.records[(path, name)] = QuantizedSource(
                    path, name, kind, t.name, path, scale, (b0, b1), None, t, plan.sources
                )
            quantizer.pairs[QUANTIZE] += 1
        files.append(replace(f, tensors=tuple(tensors)))
    return replace(plan, files=tuple(files))


def _refuse_quantized(name: str, dtype: DType) -> None:
    """``--quantize`` takes floats: an FP8 pair's or an MXFP4 pair's tensor is refused (mixing two block
    formats in one model, under one ``quantization_config``, is a model no loader reads)."""
    if name.endswith((SCALE_INV, SCALES, BLOCKS)) or dtype in dtypes.FP8_WEIGHTS:
        raise UsageError(f"{name}: already block-quantized (--quantize takes a checkpoint of floats)")


# --------------------------------------------------------------------------------------------
# resharding pairs as pairs: a weight's block scale cut by the same blocks


def _paired_checked(
    table: LayoutTable | None, sources: Mapping[K, SourceFile], weights: Mapping[str, object], block: Block | None
) -> bool:
    """Whether every rank's slice of these FP8 pairs sits on the block grid of ``table`` (each rank's pair exact)."""
    if table is None or any(w.endswith(BLOCKS) for w in weights):
        return False
    stored = layout_map(table)
    pairs = sharded_pairs(sources, table)
    for weight in weights:
        if weight not in stored:
            continue  # not laid out: every rank holds the whole pair
        scale = stored.get(weight + SCALE_INV)
        if weight not in pairs or scale is None:
            return False
        try:
            _check_pair(pairs[weight], stored[weight].layout, scale.layout, lambda: block, "source")
        except UsageError:
            return False
    return True


@dataclass(frozen=True)
class PairedTable:
    """A strategy (``LayoutTable``) with a layout for each block scale of the weights it lays out."""

    base: LayoutTable
    layouts: Mapping[str, ParamLayout]

    @property
    def path(self) -> str | None:
        return self.base.path


@dataclass(frozen=True)
class Pair:
    """A block-scaled pair as full tensors: names and full shapes (an FP8 weight and its ``_scale_inv``, or
    MXFP4 ``P_blocks`` and ``P_scales``)."""

    weight: str
    weight_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    kind: str = FP8_BLOCK

    @property
    def scale(self) -> str:
        return self.weight + SCALE_INV if self.kind == FP8_BLOCK else self.weight[: -len(BLOCKS)] + SCALES

    def scale_key(self, key: str) -> str:
        """The strategy name of the scale beside the weight's ``key`` (``"0-..."`` in merged files)."""
        return key + SCALE_INV if self.kind == FP8_BLOCK else key[: -len(BLOCKS)] + SCALES


def full_pairs(tensors: Mapping[str, SourceTensor]) -> dict[str, Pair]:
    """The block-scaled pairs among a full model's tensors (name -> facts), keyed by weight (blocks) name."""
    out: dict[str, Pair] = {}
    for n, t in tensors.items():
        if n.endswith(SCALE_INV):
            w = tensors.get(n[: -len(SCALE_INV)])
            if w is not None and w.dtype in dtypes.FP8_WEIGHTS:
                out[n[: -len(SCALE_INV)]] = Pair(n[: -len(SCALE_INV)], w.shape, t.shape)
        elif n.endswith(SCALES) and t.dtype in (dtypes.UINT8, dtypes.FLOAT8_E8M0):
            blocks = n[: -len(SCALES)] + BLOCKS
            b = tensors.get(blocks)
            if b is not None and b.dtype is dtypes.UINT8 and len(b.shape) == len(t.shape) + 1:
                out[blocks] = Pair(blocks, b.shape, t.shape, MXFP4)
    return out


def _derived_layout(pair: Pair, p: ParamLayout, side: str) -> ParamLayout:
    """The layout a scale the strategy does not name takes from its weight's ``p``.

    FP8: the weight's own (the scale's axes are the weight's, counted in blocks). MXFP4: without the
    blocks' last axis (the 16 bytes of one block), which must not be cut.
    """
    if pair.kind == FP8_BLOCK:
        return p
    if p.is_list_map or p.split_shape or p.indices_offset or p.tensor_map[-1] != -1:
        raise UsageError(
            f"{pair.weight}: the {side} strategy cuts its last axis (the 16 bytes of an MXFP4 block) or lays it "
            "out in a way reshard cannot follow for its scales: cut the experts, rows or block groups instead"
        )
    return replace(p, tensor_map=p.tensor_map[:-1])


def sharded_pairs(sources: Mapping[K, SourceFile], table: LayoutTable | None) -> dict[str, Pair]:
    """The FP8 block pairs of per-rank files, with full shapes through ``table``'s weight layouts.

    The scale's full shape is its slice through its weight's layout (the layout ``paired_layouts`` gives it)
    unless ``table`` has one of its own.
    """
    if table is None:
        return {}
    stored = layout_map(table)
    out: dict[str, Pair] = {}
    for sf in sources.values():
        for weight, pair in full_pairs(sf.tensors).items():
            if weight in out or weight not in stored:
                continue
            given = stored.get(pair.scale)
            own = given.layout if given is not None else _derived_layout(pair, stored[weight].layout, "source")
            whole = full_shape(stored[weight].layout, pair.weight_shape)
            out[weight] = Pair(weight, whole, full_shape(own, pair.scale_shape), pair.kind)
    return out


Block = tuple[int | None, int | None]  # an FP8 block size, an axis None where unknown


def block_of_slices(sources: Mapping[K, SourceFile], table: LayoutTable | None) -> Block:
    """The FP8 block size the per-rank pairs of ``sources`` show along each axis ``table`` cuts (else None).

    A rank's slice of a pair cut on the block grid holds whole blocks along a cut axis, so its rows divided by
    its scale's rows is the block's rows: one value over every cut pair, or unknown.
    """
    seen: tuple[set[int], set[int]] = (set(), set())
    stored = layout_map(table) if table is not None else {}
    for sf in sources.values():
        for weight, pair in full_pairs(sf.tensors).items():
            if weight not in stored or pair.kind != FP8_BLOCK:
                continue
            whole = full_shape(stored[weight].layout, pair.weight_shape)
            for axis, found in zip((-2, -1), seen, strict=True):
                size, blocks = pair.weight_shape[axis], pair.scale_shape[axis]
                if whole[axis] != size:
                    found.add(size // blocks if blocks and size % blocks == 0 else 0)
    b0, b1 = (next(iter(f)) if len(f) == 1 and 0 not in f else None for f in seen)
    return b0, b1


def paired_layouts(
    table: LayoutTable | None,
    pairs: Mapping[str, Pair],
    block: Callable[[], Block | None],
    side: str,
    notes: list[str] | None = None,
) -> LayoutTable | None:
    """``table`` with each laid-out FP8 weight's block scale laid out like the weight (``table`` itself without any).

    A scale the strategy does not name gets its weight's layout; either way every rank's scale box must be
    its weight box divided by the block (edge blocks partial), so each rank's pair is self-consistent.
    ``block``: the FP8 block size (asked only when a weight is cut); ``side``: "source" or "destination",
    for messages. ``notes`` gains one line saying how many pairs are cut.

    Raises:
        UsageError: A cut not on a block boundary (naming the tensor, the cut and the block), a block size
            unknown for a cut weight, a scale whose shape does not fit its weight, a scale laid out apart.
    """
    if table is None or not pairs:
        return table
    layouts = dict(table.layouts)
    out: dict[str, ParamLayout] = {}
    cut = 0
    for key, p in layouts.items():
        if key in out:
            continue
        out[key] = p
        _, origin = split_stage_name(key, table.path)
        pair = pairs.get(origin)
        if pair is None:
            continue
        scale_key = pair.scale_key(key)
        scale_layout = layouts[scale_key] if scale_key in layouts else _derived_layout(pair, p, side)
        if pair.kind == MXFP4:
            cut += _check_mxfp4(pair, p, scale_layout, side)
        elif side != "source" or scale_key not in layouts:  # a source's own scale layout moves its bytes as stored
            cut += _check_pair(pair, p, scale_layout, block, side)
        out[scale_key] = scale_layout
    scales = {pair.scale: pair for pair in pairs.values()}
    for key, p in layouts.items():  # a scale laid out without its weight
        _, origin = split_stage_name(key, table.path)
        if origin in scales and key not in out and _is_cut(p, scales[origin].scale_shape):
            weight = scales[origin].weight
            raise UsageError(f"{origin}: the {side} strategy cuts this block scale but not its weight {weight}")
    if cut and notes is not None:
        notes.append(f"block scales cut with their weights for the {side} strategy: {cut} pair(s)")
    if is_dataclass(table) and any(f.name == "layouts" and f.init for f in fields(table)):
        return replace(table, layouts=out)  # a StrategyFile stays one (its stages, items and notes kept)
    return PairedTable(table, out)


def _is_cut(p: ParamLayout, shape: tuple[int, ...]) -> bool:
    return any(box != tuple((0, d) for d in shape) for box in rank_boxes(p, shape))


def _check_pair(
    pair: Pair,
    weight_layout: ParamLayout,
    scale_layout: ParamLayout,
    block: Callable[[], Block | None],
    side: str,
) -> bool:
    """Whether the weight is cut; refuses a cut off the block grid or a scale box that is not the weight's."""
    weight_boxes = rank_boxes(weight_layout, pair.weight_shape)
    whole = tuple((0, d) for d in pair.weight_shape)
    if all(box == whole for box in weight_boxes):
        if _is_cut(scale_layout, pair.scale_shape):
            raise UsageError(
                f"{pair.scale}: the {side} strategy cuts this block scale but not its weight {pair.weight}"
            )
        return False
    size = block() or (None, None)
    *lead, rows, cols = pair.weight_shape
    want = (
        *lead,
        *(math.ceil(d / b) if b else n for d, b, n in zip((rows, cols), size, pair.scale_shape[-2:], strict=True)),
    )
    if pair.scale_shape != tuple(want):
        b0, b1 = size
        raise UsageError(
            f"{pair.scale}: shape {list(pair.scale_shape)} does not fit weight {pair.weight} "
            f"{list(pair.weight_shape)} in {b0}x{b1} blocks (expected {list(want)})"
        )
    expected = [_scale_box(pair, box, size, side, rank) for rank, box in enumerate(weight_boxes)]
    try:
        scale_boxes: tuple[Box, ...] | None = rank_boxes(scale_layout, pair.scale_shape)
    except LayoutError:
        scale_boxes = None
    if scale_boxes is None or list(scale_boxes) != expected:
        raise UsageError(
            f"{pair.scale}: the {side} strategy lays it out apart from its weight {pair.weight} "
            f"(its ranks' boxes must be the weight's blocks, {[list(b) for b in expected[:2]]}...)"
        )
    return True


def _check_mxfp4(pair: Pair, blocks_layout: ParamLayout, scale_layout: ParamLayout, side: str) -> bool:
    """Whether MXFP4 blocks are cut; refuses scales whose boxes are not the blocks' (without their last axis)."""
    boxes = rank_boxes(blocks_layout, pair.weight_shape)
    expected = [box[:-1] for box in boxes]
    try:
        scale_boxes: list[Box] | None = list(rank_boxes(scale_layout, pair.scale_shape))
    except LayoutError:
        scale_boxes = None
    if scale_boxes != expected:
        raise UsageError(
            f"{pair.scale}: the {side} strategy lays it out apart from its MXFP4 blocks {pair.weight} "
            "(each rank's scales must be its blocks' groups)"
        )
    return any(box != tuple((0, d) for d in pair.weight_shape) for box in boxes)


def _scale_box(pair: Pair, box: Box, block: Block, side: str, rank: int) -> Box:
    """The scale box of a weight box (block-aligned cuts, the tensor's far edge partial), or refused."""
    *lead, rows_box, cols_box = box
    out = []
    shown = "x".join(str(b) if b else "?" for b in block)
    for what, (a, b), size, edge in zip(
        ("row", "column"), (rows_box, cols_box), block, pair.weight_shape[-2:], strict=True
    ):
        if size is None:
            if (a, b) != (0, edge):
                raise UsageError(
                    f"{pair.weight}: the {side} strategy cuts this FP8 weight's {what}s, and its block size is "
                    "unknown: no config.json beside the source gives quantization_config.weight_block_size "
                    "(give --block-size, e.g. 128x128)"
                )
            out.append((0, pair.scale_shape[-2 if what == "row" else -1]))
            continue
        for at in (a, b):
            if at % size and at != edge:
                raise UsageError(
                    f"{pair.weight}: the {side} strategy cuts it at {what} {at} (rank {rank}), not on a "
                    f"{shown} block boundary of its scale {pair.scale}: give --dequantize "
                    f"(exact at any cut) or a strategy whose cuts fall on multiples of {size}"
                )
        out.append((a // size, -(-b // size)))
    return (*lead, *out)


# --------------------------------------------------------------------------------------------
# what inspect shows: quantized weights as such, their parameters counted once


__all__ = [
    "BLOCKS",
    "DEFAULT_BLOCK",
    "FP8_BLOCK",
    "MXFP4",
    "NOT_QUANTIZED",
    "QUANTIZE",
    "QUANTIZE_SCALE",
    "SCALES",
    "SCALE_INV",
    "Block",
    "Dequantize",
    "Dequantizer",
    "Pair",
    "PairedTable",
    "Precision",
    "QuantizedSource",
    "Quantizer",
    "block_from_config",
    "block_of_slices",
    "dequantize_target",
    "full_pairs",
    "paired_layouts",
    "parse_block",
    "sharded_pairs",
]
