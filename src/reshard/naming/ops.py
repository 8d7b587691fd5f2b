"""The tensor-surgery vocabulary: how a model's names and fused tensors map to another's.

MindFormers and Hugging Face name the same weights differently and fuse some of them
(MindFormers' ``linear_qkv`` is Hugging Face's ``q_proj``/``k_proj``/``v_proj``; its MoE experts
may be one stacked tensor). A ``ModelMap`` says how, as plain data: an ordered list of operations
and the config values their sizes need. ``apply`` turns a catalogue of input tensors (names,
shapes, dtypes) into the output tensors, each described as *pieces*: boxes of input tensors
copied into a box of the output. That is all a plan needs, so the planners compose a map onto
their own box copies and the executors stream it like any other copy (nothing is materialised).

Matching: every operation's patterns are regular expressions matched against the WHOLE name
(``re.fullmatch``). Each input name is claimed by the FIRST operation that matches it; a name no
operation matches is *unmatched* and kept as it is (the name report lists it, ``--strict`` refuses
it). Output names are the patterns' ``replace``/``output`` templates expanded with the match
(``\\1``, ``\\g<name>``).

The operations:

* ``Rename(match, replace)``: one tensor, new name.
* ``Split(match, outputs, axis, sizes, groups=None)``: one fused tensor into ``len(outputs)``
  tensors along ``axis``; ``sizes[p]`` is part ``p``'s total length (an int or an expression over
  the config; at most one may be ``-1``, "the rest"). With ``groups=g`` the axis is ``g`` repeats
  of ``[part0, part1, ...]`` each part ``sizes[p] / g`` long (Megatron's interleaved QKV:
  ``g = num_key_value_heads``; interleaved gate/up: ``g = ffn_hidden_size``).
* ``Join(inputs, output, axis, groups=None)``: the inverse, ``inputs[p]`` matching part ``p``;
  every part of an output must be present.
* ``Stack(match, output, axis=0)``: per-expert tensors (``match`` has a named group ``expert``,
  the expert index) into one tensor with a new ``axis`` of length ``experts``; indices must be
  ``0..n-1``.
* ``Unstack(match, output, axis=0)``: the inverse; ``output`` holds ``{expert}`` where the index
  goes. (Along the last axis it is not a box copy and is refused.)

Stack and Unstack change a tensor's number of dimensions; their pieces read the input through a
*view*, the C-order shape the input is reshaped to (inserting a unit axis, or merging the expert
axis with the next one), which is free on a memory map.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reshard.errors import UnsupportedError, UsageError
from reshard.naming.expr import Size, evaluate
from reshard.naming.report import NameReport

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Rename:
    """``match`` (a regex on the whole name) renamed to ``replace`` (its expansion)."""

    match: str
    replace: str


@dataclass(frozen=True)
class Split:
    """One fused tensor matching ``match`` into ``outputs`` (templates) along ``axis``."""

    match: str
    outputs: tuple[str, ...]
    axis: int
    sizes: tuple[Size, ...]
    groups: Size | None = None


@dataclass(frozen=True)
class Join:
    """The tensors matching ``inputs`` (one regex per part, in order) joined into ``output`` along ``axis``."""

    inputs: tuple[str, ...]
    output: str
    axis: int
    groups: Size | None = None


@dataclass(frozen=True)
class Transpose:
    """``match`` renamed to ``replace`` with its axes permuted: output axis j is input axis ``perm[j]``."""

    match: str
    replace: str
    perm: tuple[int, ...]


@dataclass(frozen=True)
class Stack:
    """Per-expert tensors (``match`` with a named group ``expert``) stacked into ``output``.

    Each expert is first permuted by ``perm`` (None: as it is); then the experts are stacked on a
    new ``axis``, or with ``fold=True`` concatenated along the existing ``axis`` (MindFormers'
    grouped experts: ``weight1`` is the experts' ``linear_fc1`` transposed and concatenated on
    axis 0, ``perm=(1, 0), fold=True``).
    """

    match: str
    output: str
    axis: int = 0
    perm: tuple[int, ...] | None = None
    fold: bool = False
    # Further parts of each expert (folded stacks): ``parts[k]`` matches part k+1 of the same
    # experts; each expert's parts, permuted, are joined along ``part_axis`` of the output
    # (MindFormers' ``weight1`` is gate.T | up.T per expert: ``parts=(up,), part_axis=1``).
    parts: tuple[str, ...] = ()
    part_axis: int = -1


@dataclass(frozen=True)
class Unstack:
    """One stacked tensor matching ``match`` into per-expert ``output`` tensors (``{expert}`` in the template).

    Without ``experts`` the ``axis`` is the expert axis and is removed; with ``experts`` (a size)
    the ``axis`` holds that many equal blocks, one per expert (the inverse of a folded stack).
    Each expert's part is then permuted by ``perm`` (None: as it is).
    """

    match: str
    output: str
    axis: int = 0
    perm: tuple[int, ...] | None = None
    experts: Size | None = None
    # Further parts of each expert (with ``experts``): each permuted block is split into
    # ``1 + len(outputs)`` equal parts along ``part_axis`` of the outputs; ``outputs[k]`` names part k+1.
    outputs: tuple[str, ...] = ()
    part_axis: int = 0


Op = Rename | Transpose | Split | Join | Stack | Unstack


@dataclass(frozen=True)
class ModelMap:
    """An ordered list of operations and the model config values their sizes use."""

    ops: tuple[Op, ...]
    config: Mapping[str, object] = field(default_factory=dict)
    name: str = "rules"  # what the report and errors call it ("rules.yaml", "preset qwen3")
    # A further map applied to this one's outputs (``reshard.naming.stages``): a name can be
    # unstacked by one stage and split by the next; the pieces still read the input tensors.
    then: ModelMap | None = None

    def stages(self) -> tuple[ModelMap, ...]:
        """This map and every map after it, in order."""
        return (self,) if self.then is None else (self, *self.then.stages())

    def all_ops(self) -> tuple[Op, ...]:
        """The operations of every stage, in order."""
        return tuple(op for stage in self.stages() for op in stage.ops)


@dataclass(frozen=True)
class TensorInfo:
    """An input tensor: its shape and dtype name."""

    shape: Shape
    dtype: str


@dataclass(frozen=True)
class Piece:
    """Box ``src_start``+``lengths`` of input ``source`` (viewed as ``view``) copied to ``dst_start`` of an output."""

    source: str
    src_start: Shape
    dst_start: Shape
    lengths: Shape
    view: Shape | None = None  # the C-order shape the input is viewed as (None: its own shape)
    # Output axis j is (viewed) input axis perm[j]; ``src_start`` is in the input's axis order,
    # ``dst_start`` and ``lengths`` in the output's (None: same axes).
    perm: Shape | None = None

    @property
    def src_lengths(self) -> Shape:
        """The box's lengths in the input's axis order."""
        return _unpermute(self.lengths, self.perm)


@dataclass(frozen=True)
class Derived:
    """One output tensor: name, shape, dtype, and the pieces of input tensors that fill it."""

    name: str
    shape: Shape
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.source for p in self.pieces))


@dataclass(frozen=True)
class Applied:
    """``apply``'s answer: the output tensors in order, and the name report."""

    outputs: tuple[Derived, ...]
    report: NameReport


def apply(model_map: ModelMap, catalogue: Mapping[str, TensorInfo]) -> Applied:
    """The output tensors ``model_map``'s own operations make of the input tensors ``catalogue``.

    One stage: ``reshard.naming.apply`` (``reshard.naming.stages.apply``) applies every stage of a
    map (``ModelMap.then``).

    Args:
        model_map: The operations and the config values they need.
        catalogue: The input tensors by name, in the checkpoint's order.

    Returns:
        ``Applied``: every output (unmatched inputs kept under their own name) in the order of each
        output's first input, and a ``NameReport`` (renamed, surgery, unmatched).

    Raises:
        UsageError: A bad regex, a size that does not fit the tensor, a join with a missing part,
            experts that are not ``0..n-1`` or differ in shape, or two inputs mapped to one output name.
        UnsupportedError: An unstack along the last axis.

    Example:
        from reshard.naming import ModelMap, Rename, TensorInfo, apply
        out = apply(ModelMap((Rename(r"a\\.(.*)", r"b.\\1"),)), {"a.w": TensorInfo((2, 3), "Float32")})
        assert [d.name for d in out.outputs] == ["b.w"]
    """
    compiled = [_compile(op) for op in model_map.ops]
    claims: dict[int, list[tuple[str, re.Match[str]]]] = {}
    unmatched: list[str] = []
    for name in catalogue:
        for index, patterns in enumerate(compiled):
            found = _first_match(patterns, name)
            if found is not None:
                claims.setdefault(index, []).append((name, found))
                break
        else:
            unmatched.append(name)
    order = {name: k for k, name in enumerate(catalogue)}
    outputs: list[tuple[int, Derived]] = []
    renamed: list[tuple[str, str]] = []
    surgery: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []
    for index, claimed in claims.items():
        op = model_map.ops[index]
        made = _outputs_of(op, claimed, catalogue, model_map.config)
        for inputs, derived in made:
            if isinstance(op, Rename):
                renamed.append((inputs[0], derived[0].name))
            else:
                surgery.append((type(op).__name__.lower(), inputs, tuple(d.name for d in derived)))
            outputs.extend((min(order[i] for i in inputs), d) for d in derived)
    outputs.extend((order[name], _kept(name, catalogue[name])) for name in unmatched)
    outputs.sort(key=lambda item: item[0])
    _check_unique([d for _, d in outputs])
    report = NameReport(renamed=tuple(renamed), surgery=tuple(surgery), unmatched=tuple(unmatched))
    return Applied(tuple(d for _, d in outputs), report)


# --------------------------------------------------------------------------------------------
# matching


def _regex(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UsageError(f"bad regular expression {pattern!r}: {e}") from None


def _compile(op: Op) -> list[re.Pattern[str]]:
    if isinstance(op, Join):
        if not op.inputs:
            raise UsageError(f"join into {op.output!r} names no inputs")
        return [_regex(p) for p in op.inputs]
    regex = _regex(op.match)
    if isinstance(op, Stack):
        regexes = [regex, *(_regex(p) for p in op.parts)]
        for r in regexes:
            if "expert" not in r.groupindex:
                raise UsageError(f"stack pattern {r.pattern!r} needs a named group (?P<expert>...), the expert index")
        return regexes
    return [regex]


def _first_match(patterns: Sequence[re.Pattern[str]], name: str) -> re.Match[str] | None:
    for pattern in patterns:
        m = pattern.fullmatch(name)
        if m is not None:
            return m
    return None


def _expand(m: re.Match[str], template: str) -> str:
    try:
        return m.expand(template)
    except (re.error, IndexError) as e:
        raise UsageError(f"output template {template!r} does not fit pattern {m.re.pattern!r}: {e}") from None


def _part_of(m: re.Match[str], op: Join) -> int:
    return op.inputs.index(m.re.pattern)


# --------------------------------------------------------------------------------------------
# outputs per operation

Made = list[tuple[tuple[str, ...], list[Derived]]]  # (inputs, their outputs)


def _outputs_of(
    op: Op, claimed: list[tuple[str, re.Match[str]]], catalogue: Mapping[str, TensorInfo], config: Mapping[str, object]
) -> Made:
    if isinstance(op, Rename):
        return [((n,), [_kept(_expand(m, op.replace), catalogue[n], n)]) for n, m in claimed]
    if isinstance(op, Transpose):
        return [((n,), [_transposed(op, n, m, catalogue[n])]) for n, m in claimed]
    if isinstance(op, Split):
        return [((n,), _split(op, n, m, catalogue[n], config)) for n, m in claimed]
    if isinstance(op, Unstack):
        return [((n,), _unstack(op, n, m, catalogue[n], config)) for n, m in claimed]
    if isinstance(op, Join):
        return _joins(op, claimed, catalogue, config)
    return _stacks(op, claimed, catalogue)


def _kept(name: str, info: TensorInfo, source: str | None = None) -> Derived:
    zeros = (0,) * len(info.shape)
    return Derived(name, info.shape, info.dtype, (Piece(source or name, zeros, zeros, info.shape),))


def _axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise UsageError(f"{what}: axis {axis} is outside its {ndim} dimensions")
    return axis % ndim


def _groups(groups: Size | None, config: Mapping[str, object], what: str) -> int:
    g = 1 if groups is None else evaluate(groups, config)
    if g < 1:
        raise UsageError(f"{what}: groups must be at least 1, not {g}")
    return g


def _sizes(sizes: Sequence[Size], total: int, config: Mapping[str, object], what: str) -> list[int]:
    values = [evaluate(s, config) for s in sizes]
    rest = [k for k, v in enumerate(values) if v == -1]
    if len(rest) > 1:
        raise UsageError(f"{what}: at most one size may be -1 (the rest)")
    if rest:
        values[rest[0]] = total - (sum(values) + 1)
    if any(v < 0 for v in values) or sum(values) != total:
        raise UsageError(f"{what}: sizes {values} do not add up to the axis length {total}")
    return values


def _box_along(shape: Shape, axis: int, start: int, length: int) -> tuple[Shape, Shape]:
    """(start, lengths) of the box of ``shape`` that is ``start:start+length`` along ``axis``."""
    starts = tuple(start if d == axis else 0 for d in range(len(shape)))
    lengths = tuple(length if d == axis else n for d, n in enumerate(shape))
    return starts, lengths


def _with(shape: Shape, axis: int, length: int) -> Shape:
    return tuple(length if d == axis else n for d, n in enumerate(shape))


def _split(op: Split, name: str, m: re.Match[str], info: TensorInfo, config: Mapping[str, object]) -> list[Derived]:
    what = f"split of {name!r}"
    if len(op.outputs) != len(op.sizes):
        raise UsageError(f"{what}: {len(op.outputs)} outputs but {len(op.sizes)} sizes")
    axis = _axis(op.axis, len(info.shape), what)
    g = _groups(op.groups, config, what)
    sizes = _sizes(op.sizes, info.shape[axis], config, what)
    if any(s % g for s in sizes):
        raise UsageError(f"{what}: sizes {sizes} are not all divisible by {g} groups")
    period = info.shape[axis] // g
    out: list[Derived] = []
    offset = 0
    for template, size in zip(op.outputs, sizes, strict=True):
        part = size // g
        shape = _with(info.shape, axis, size)
        pieces = []
        for j in range(g):
            src_start, lengths = _box_along(info.shape, axis, j * period + offset, part)
            dst_start, _ = _box_along(shape, axis, j * part, part)
            pieces.append(Piece(name, src_start, dst_start, lengths))
        out.append(Derived(_expand(m, template), shape, info.dtype, tuple(pieces)))
        offset += part
    return out


def _joins(
    op: Join,
    claimed: list[tuple[str, re.Match[str]]],
    catalogue: Mapping[str, TensorInfo],
    config: Mapping[str, object],
) -> Made:
    parts: dict[str, dict[int, str]] = {}
    for name, m in claimed:
        target = _expand(m, op.output)
        slot = parts.setdefault(target, {})
        part = _part_of(m, op)
        if part in slot:
            raise UsageError(f"{slot[part]!r} and {name!r} both map to part {part} of {target!r}")
        slot[part] = name
    made: Made = []
    for target, slot in parts.items():
        missing = [op.inputs[p] for p in range(len(op.inputs)) if p not in slot]
        if missing:
            have = ", ".join(repr(n) for n in slot.values())
            raise UsageError(f"join into {target!r}: {have} found but no tensor matches {missing[0]!r}")
        inputs = tuple(slot[p] for p in range(len(op.inputs)))
        made.append((inputs, [_join(op, target, inputs, catalogue, config)]))
    return made


def _join(
    op: Join, target: str, inputs: tuple[str, ...], catalogue: Mapping[str, TensorInfo], config: Mapping[str, object]
) -> Derived:
    what = f"join into {target!r}"
    infos = [catalogue[n] for n in inputs]
    first = infos[0]
    axis = _axis(op.axis, len(first.shape), what)
    for name, info in zip(inputs, infos, strict=True):
        if info.dtype != first.dtype:
            raise UsageError(f"{what}: {inputs[0]!r} is {first.dtype} but {name!r} is {info.dtype}")
        if len(info.shape) != len(first.shape) or _with(info.shape, axis, 0) != _with(first.shape, axis, 0):
            raise UsageError(
                f"{what}: {name!r} has shape {list(info.shape)}, which does not join {list(first.shape)} on axis {axis}"
            )
    g = _groups(op.groups, config, what)
    sizes = [info.shape[axis] for info in infos]
    if any(s % g for s in sizes):
        raise UsageError(f"{what}: part lengths {sizes} are not all divisible by {g} groups")
    shape = _with(first.shape, axis, sum(sizes))
    period = sum(sizes) // g
    pieces = []
    offset = 0
    for name, info, size in zip(inputs, infos, sizes, strict=True):
        part = size // g
        for j in range(g):
            src_start, lengths = _box_along(info.shape, axis, j * part, part)
            dst_start, _ = _box_along(shape, axis, j * period + offset, part)
            pieces.append(Piece(name, src_start, dst_start, lengths))
        offset += part
    return Derived(target, shape, first.dtype, tuple(pieces))


def _stacks(op: Stack, claimed: list[tuple[str, re.Match[str]]], catalogue: Mapping[str, TensorInfo]) -> Made:
    if op.parts:
        return _part_stacks(op, claimed, catalogue)
    groups: dict[str, dict[int, str]] = {}
    for name, m in claimed:
        target = _expand(m, op.output)
        experts = groups.setdefault(target, {})
        expert = int(m.group("expert"))
        if expert in experts:
            raise UsageError(f"{experts[expert]!r} and {name!r} are both expert {expert} of {target!r}")
        experts[expert] = name
    made: Made = []
    for target, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise UsageError(f"stack into {target!r}: expert indices {sorted(experts)} are not 0..{len(experts) - 1}")
        inputs = tuple(experts[e] for e in range(len(experts)))
        made.append((inputs, [_stack(op, target, inputs, catalogue)]))
    return made


def _part_stacks(op: Stack, claimed: list[tuple[str, re.Match[str]]], catalogue: Mapping[str, TensorInfo]) -> Made:
    """Stacks whose experts have several parts (``op.parts``): ``[(expert, part) -> name]`` per output."""
    patterns = [op.match, *op.parts]
    groups: dict[str, dict[tuple[int, int], str]] = {}
    for name, m in claimed:
        target = _expand(m, op.output)
        slots = groups.setdefault(target, {})
        key = (int(m.group("expert")), patterns.index(m.re.pattern))
        if key in slots:
            raise UsageError(f"{slots[key]!r} and {name!r} are both part {key[1]} of expert {key[0]} of {target!r}")
        slots[key] = name
    made: Made = []
    for target, slots in groups.items():
        experts = sorted({e for e, _ in slots})
        if experts != list(range(len(experts))):
            raise UsageError(f"stack into {target!r}: expert indices {experts} are not 0..{len(experts) - 1}")
        missing = [(e, p) for e in experts for p in range(len(patterns)) if (e, p) not in slots]
        if missing:
            e, p = missing[0]
            raise UsageError(f"stack into {target!r}: expert {e} has no tensor matching {patterns[p]!r}")
        grid = [[slots[(e, p)] for p in range(len(patterns))] for e in experts]
        inputs = tuple(n for row in grid for n in row)
        made.append((inputs, [_part_stack(op, target, grid, catalogue)]))
    return made


def _part_stack(op: Stack, target: str, grid: list[list[str]], catalogue: Mapping[str, TensorInfo]) -> Derived:
    what = f"stack into {target!r}"
    if not op.fold:
        raise UnsupportedError(f"{what}: experts with several parts are stacked with fold=True only")
    first = catalogue[grid[0][0]]
    for name in (n for row in grid for n in row):
        if catalogue[name] != first:
            info = catalogue[name]
            raise UsageError(
                f"{what}: {name!r} is {info.dtype} {list(info.shape)}, {grid[0][0]!r} {first.dtype} {list(first.shape)}"
            )
    ndim = len(first.shape)
    perm = _perm(op.perm, ndim, what)
    part = tuple(first.shape[a] for a in perm)  # one part of one expert, permuted
    axis, part_axis = _axis(op.axis, ndim, what), _axis(op.part_axis, ndim, what)
    block = _with(part, part_axis, part[part_axis] * len(grid[0]))  # one expert, its parts joined
    shape = _with(block, axis, block[axis] * len(grid))
    zeros, folded = (0,) * ndim, _nontrivial(perm)
    pieces = []
    for e, row in enumerate(grid):
        for p, name in enumerate(row):
            dst = list(_box_along(shape, axis, e * block[axis], block[axis])[0])
            dst[part_axis] += p * part[part_axis]
            pieces.append(Piece(name, zeros, tuple(dst), part, perm=folded))
    return Derived(target, shape, first.dtype, tuple(pieces))


def _stack(op: Stack, target: str, inputs: tuple[str, ...], catalogue: Mapping[str, TensorInfo]) -> Derived:
    first = catalogue[inputs[0]]
    for name in inputs:
        if catalogue[name] != first:
            info = catalogue[name]
            raise UsageError(
                f"stack into {target!r}: {name!r} is {info.dtype} {list(info.shape)}, "
                f"{inputs[0]!r} {first.dtype} {list(first.shape)}"
            )
    what = f"stack into {target!r}"
    ndim = len(first.shape)
    perm = _perm(op.perm, ndim, what)
    part = tuple(first.shape[a] for a in perm)  # one expert, permuted
    if op.fold:
        axis = _axis(op.axis, ndim, what)
        shape = _with(part, axis, part[axis] * len(inputs))
        zeros, folded = (0,) * ndim, _nontrivial(perm)
        pieces = tuple(
            Piece(name, zeros, _box_along(shape, axis, e * part[axis], part[axis])[0], part, perm=folded)
            for e, name in enumerate(inputs)
        )
        return Derived(target, shape, first.dtype, pieces)
    axis = _axis(op.axis, ndim + 1, what)
    shape = (*part[:axis], len(inputs), *part[axis:])
    lengths = (*part[:axis], 1, *part[axis:])
    if _nontrivial(perm) is None:  # a unit axis inserted at ``axis``: no permutation (byte runs stay possible)
        view, full_perm = lengths, None
    else:  # the unit axis first; the permutation puts it at ``axis``
        view = (1, *first.shape)
        full_perm = (*(1 + a for a in perm[:axis]), 0, *(1 + a for a in perm[axis:]))
    zeros = (0,) * (ndim + 1)
    pieces = tuple(
        Piece(name, zeros, _box_along(shape, axis, e, 1)[0], lengths, view, full_perm) for e, name in enumerate(inputs)
    )
    return Derived(target, shape, first.dtype, pieces)


def _unstack(op: Unstack, name: str, m: re.Match[str], info: TensorInfo, config: Mapping[str, object]) -> list[Derived]:
    what = f"unstack of {name!r}"
    axis = _axis(op.axis, len(info.shape), what)
    template = _expand(m, op.output)
    if "{expert}" not in template:
        raise UsageError(f"{what}: output template {op.output!r} needs {{expert}} where the expert index goes")
    if op.outputs:
        return _part_unstack(op, name, m, info, config)
    if op.experts is not None:  # folded: ``experts`` equal blocks along ``axis``
        experts = evaluate(op.experts, config)
        if experts < 1 or info.shape[axis] % experts:
            raise UsageError(f"{what}: axis {axis} of length {info.shape[axis]} is not {experts} equal blocks")
        block = info.shape[axis] // experts
        part = _with(info.shape, axis, block)
        perm = _perm(op.perm, len(part), what)
        shape = tuple(part[a] for a in perm)
        return [
            Derived(
                template.replace("{expert}", str(e)),
                shape,
                info.dtype,
                (
                    Piece(
                        name,
                        _box_along(part, axis, e * block, block)[0],
                        (0,) * len(shape),
                        shape,
                        perm=_nontrivial(perm),
                    ),
                ),
            )
            for e in range(experts)
        ]
    if axis == len(info.shape) - 1:
        raise UnsupportedError(f"{what}: unstacking along the last axis is not a box copy; stack on an earlier axis")
    part = info.shape[:axis] + info.shape[axis + 1 :]
    perm = _perm(op.perm, len(part), what)
    shape = tuple(part[a] for a in perm)
    inner = info.shape[axis + 1]
    view = (*info.shape[:axis], info.shape[axis] * inner, *info.shape[axis + 2 :])
    out = []
    for e in range(info.shape[axis]):
        src_start, _ = _box_along(view, axis, e * inner, inner)
        piece = Piece(name, src_start, (0,) * len(shape), shape, view=view, perm=_nontrivial(perm))
        out.append(Derived(template.replace("{expert}", str(e)), shape, info.dtype, (piece,)))
    return out


def _part_unstack(
    op: Unstack, name: str, m: re.Match[str], info: TensorInfo, config: Mapping[str, object]
) -> list[Derived]:
    """The inverse of a stack with parts: each expert's permuted block split into equal parts."""
    what = f"unstack of {name!r}"
    if op.experts is None:
        raise UnsupportedError(f"{what}: experts with several parts are unstacked from folded blocks (experts=...)")
    templates = [_expand(m, t) for t in (op.output, *op.outputs)]
    if any("{expert}" not in t for t in templates):
        raise UsageError(f"{what}: every output template needs {{expert}} where the expert index goes")
    ndim = len(info.shape)
    axis, part_axis = _axis(op.axis, ndim, what), _axis(op.part_axis, ndim, what)
    experts = evaluate(op.experts, config)
    if experts < 1 or info.shape[axis] % experts:
        raise UsageError(f"{what}: axis {axis} of length {info.shape[axis]} is not {experts} equal blocks")
    block = _with(info.shape, axis, info.shape[axis] // experts)
    perm = _perm(op.perm, ndim, what)
    permuted = tuple(block[a] for a in perm)
    n = len(templates)
    if permuted[part_axis] % n:
        raise UsageError(f"{what}: axis {part_axis} of each expert ({permuted[part_axis]}) is not {n} equal parts")
    shape = _with(permuted, part_axis, permuted[part_axis] // n)
    out = []
    for e in range(experts):
        for p, template in enumerate(templates):
            src = list(_box_along(block, axis, e * block[axis], block[axis])[0])
            src[perm[part_axis]] += p * shape[part_axis]
            piece = Piece(name, tuple(src), (0,) * ndim, shape, perm=_nontrivial(perm))
            out.append(Derived(template.replace("{expert}", str(e)), shape, info.dtype, (piece,)))
    return out


def _transposed(op: Transpose, name: str, m: re.Match[str], info: TensorInfo) -> Derived:
    perm = _perm(op.perm, len(info.shape), f"transpose of {name!r}")
    shape = tuple(info.shape[a] for a in perm)
    zeros = (0,) * len(shape)
    return Derived(
        _expand(m, op.replace), shape, info.dtype, (Piece(name, zeros, zeros, shape, perm=_nontrivial(perm)),)
    )


def _perm(perm: Sequence[int] | None, ndim: int, what: str) -> Shape:
    if perm is None:
        return tuple(range(ndim))
    if sorted(perm) != list(range(ndim)):
        raise UsageError(f"{what}: {list(perm)} is not a permutation of its {ndim} axes")
    return tuple(perm)


def _nontrivial(perm: Shape) -> Shape | None:
    return None if perm == tuple(range(len(perm))) else perm


def _unpermute(lengths: Shape, perm: Shape | None) -> Shape:
    """Lengths given in output axis order, in the input's axis order."""
    if perm is None:
        return lengths
    out = [0] * len(lengths)
    for j, axis in enumerate(perm):
        out[axis] = lengths[j]
    return tuple(out)


def _check_unique(outputs: Iterable[Derived]) -> None:
    seen: dict[str, Derived] = {}
    for d in outputs:
        if d.name in seen:
            a, b = seen[d.name].inputs, d.inputs
            raise UsageError(f"two input names map to one output name: {', '.join(a + b)} -> {d.name}")
        seen[d.name] = d


__all__ = [
    "Applied",
    "Derived",
    "Join",
    "ModelMap",
    "Op",
    "Piece",
    "Rename",
    "Split",
    "Stack",
    "TensorInfo",
    "Transpose",
    "Unstack",
    "apply",
]
