"""Pictures: how a parameter is split among ranks (``reshard show``), and which source ranks feed
which destination ranks (``reshard plan --picture``).

Why it is built this way:

* **A scene first, then renderers.** Every picture is first a pure *scene*: rectangles (with the
  element box, the ranks and the bytes they stand for), labels and colours, in plain frozen
  dataclasses. The SVG writer and the terminal text form both render the same scene, so the tests
  check the scene (one block per distinct rank slice, cells equal to the plan's bytes) and the two
  renderers cannot disagree about what is drawn.
* **The layout math is not redone here.** Which box each rank holds comes from
  ``reshard.layout.algebra.rank_boxes`` (with and without the optimizer shard, through
  ``reshard.layout.slices.model_parallel``); ranks holding the same box are its replicas.
* **Hand-written SVG, PNG optional.** SVG is a text format: no dependency, byte-stable, testable
  by parsing it with ``xml.etree``, readable in every browser, and each block carries a
  ``<title>`` tooltip and ``data-*`` attributes naming its ranks and box. A PNG needs a
  rasteriser; writing one (fonts!) is not worth it, so PNG is drawn with matplotlib when it is
  installed (the optional extra ``reshard[picture]``) and is otherwise refused in one line that
  says how to install it.
* **A plan is a matrix.** Source ranks are rows, destination ranks columns, a cell's shade its
  bytes: readable at 64 x 64, where a bipartite drawing of 4 096 edges is not.

A strategy file stores no tensor shapes: drawn from one alone, a parameter's dims are given in
blocks (each dim as many elements as the layout cuts it into pieces, times the optimizer shard),
and the picture says so. With a checkpoint (rank folders and their strategy, or a Checkpoint 2.0)
the real shape is used.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from reshard import layout
from reshard.errors import ReshardError, UnsupportedError, UsageError
from reshard.formats.strategy import StrategyFile
from reshard.inspection import describe_layout, param_layouts, ranges_text, stage_layouts
from reshard.layout import Box, ParamLayout, StagedLayout, device_num, layout_map
from reshard.layout.slices import has_optimizer_shard, model_parallel
from reshard.plan import Plan, SourceFile
from reshard.plan.model import read_bytes
from reshard.sources import ReadOptions
from reshard.statenames import DEFAULT as STATE_NAMES
from reshard.text import format_size

FORMATS = (".svg", ".png")
PNG_HINT = "PNG pictures need matplotlib: pip install 'reshard[picture]' (or write .svg)"
DEFAULT_PANELS = 6  # parameters drawn when none is named: the first of each distinct layout

# A palette readable on white, distinct for neighbouring ranks (Tableau 20 order, light last).
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
)  # fmt: skip


def rank_colour(rank: int) -> str:
    """The colour of one rank (the palette repeats every 16 ranks)."""
    return PALETTE[rank % len(PALETTE)]


# ------------------------------------------------------------------------------------ the scene


@dataclass(frozen=True)
class Rect:
    """One rectangle of a scene, in scene units, and what it stands for.

    ``kind``: ``"slice"`` (a box of a tensor held by ``ranks``), ``"block"`` (a model-parallel
    block, outlined, when optimizer shards cut it further), ``"cell"`` (a plan matrix cell of
    ``nbytes`` from ``src`` to ``dst``). ``box`` is the element box of a slice or block.
    """

    x: float
    y: float
    w: float
    h: float
    kind: str
    fill: str
    label: str
    tooltip: str
    ranks: tuple[int, ...] = ()
    box: Box = ()
    src: str = ""
    dst: str = ""
    nbytes: int = 0


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str
    size: float = 12.0
    anchor: str = "start"  # start | middle | end
    bold: bool = False
    colour: str = "black"


@dataclass(frozen=True)
class Panel:
    """One parameter drawn for one pipeline stage (``dims``: the two dims drawn, rows then columns)."""

    title: str
    name: str
    stage: int
    shape: tuple[int, ...]
    layout_text: str
    slices: tuple[Rect, ...]
    blocks: tuple[Rect, ...]
    trailing: tuple[tuple[int, int], ...] = ()  # the box of dims >= 2 this panel shows (3-D and up)


@dataclass(frozen=True)
class Scene:
    """A whole picture: its size, rectangles in drawing order, labels, and the panels or matrix it came from."""

    title: str
    width: float
    height: float
    rects: tuple[Rect, ...]
    labels: tuple[Label, ...]
    panels: tuple[Panel, ...] = ()
    matrix: Matrix | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Matrix:
    """Bytes from each source (rows) to each destination (columns) of a plan."""

    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    cells: Mapping[tuple[str, str], int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.cells.values())


# ------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class ParamView:
    """What is needed to draw one parameter: its layout in each stage holding it, and its full shape."""

    name: str
    stages: Mapping[int, ParamLayout | None]  # None: a chunked source's one view (``chunks``)
    shape: tuple[int, ...]
    shape_known: bool
    devices: int  # devices per stage: global rank = stage * devices + local rank
    chunks: Mapping[Box, tuple[int, ...]] | None = None  # a chunked source's boxes -> the ranks saving them


def chunk_views(tensors: Mapping[str, Any], saved_by: Mapping[str, int]) -> dict[str, ParamView]:
    """Every tensor of a chunked source (a PyTorch DCP folder: ``ChunkedTensor`` s) with its chunks'
    boxes and the ranks that saved each (no layout: the boxes are what the files hold)."""
    views = {}
    for name, t in tensors.items():
        found: dict[Box, list[int]] = {}
        for box, path in zip(t.boxes, t.files, strict=True):
            found.setdefault(box, []).append(saved_by[path])
        chunks = {box: tuple(sorted(set(ranks))) for box, ranks in found.items()}
        views[name] = ParamView(name, {0: None}, t.shape, True, max(saved_by.values(), default=0) + 1, chunks)
    return views


def param_views(sf: StrategyFile, shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, ParamView]:
    """Every parameter of a strategy, with each stage's layout and a shape (``shapes`` or in blocks)."""
    lmap: dict[str, StagedLayout] = layout_map(sf)
    devices = device_num(sf, lmap)
    views = {}
    for name, staged in lmap.items():
        # a merged strategy names each stage's layout; a per-stage file is its own stage
        per_stage = stage_layouts(sf, name) or {sf.stage or 0: staged.layout}
        known = shapes is not None and name in shapes
        shape = tuple(shapes[name]) if shapes is not None and known else block_shape(*per_stage.values())
        views[name] = ParamView(name, dict(sorted(per_stage.items())), shape, known, devices)
    return views


def block_shape(*layouts: ParamLayout) -> tuple[int, ...]:
    """A shape in blocks that every layout given cuts evenly (a parameter's layout in each stage).

    For one layout each dim is as many elements as the layout cuts it into, the first dim also
    times the optimizer shard (which cuts a slice's first dim; every dim times it when that does
    not divide, as MindSpore's other construction needs); for several, the per-dim least common
    multiple.
    """
    shapes = [_one_block_shape(p) for p in layouts]
    shape = tuple(math.lcm(*dims) for dims in zip(*shapes, strict=True)) if shapes else ()
    for p in layouts:
        layout.rank_boxes(p, shape)  # divides: each stage's own shape divides the lcm
    return shape


def _one_block_shape(p: ParamLayout) -> tuple[int, ...]:
    blocks = layout.tensor_strategy(p)
    shard = max(layout.opt_shard_size(p), 1)
    if not blocks or shard == 1:
        return blocks
    first = (blocks[0] * shard, *blocks[1:])
    try:
        layout.rank_boxes(p, first)
    except ReshardError:
        return tuple(n * shard for n in blocks)
    return first


def param_panel(view: ParamView, stage: int, x: float = 0.0, y: float = 0.0, size: float = 360.0) -> list[Panel]:
    """One parameter in one stage as panels (one per distinct box of dims >= 2), at ``(x, y)``.

    Slices are the boxes of ``layout.rank_boxes`` (with the optimizer shard); ranks holding the
    same box are drawn as one slice labelled with all of them (replicas). With an optimizer
    shard, each model-parallel block is outlined around its shards.
    """
    p = view.stages[stage]
    base = stage * view.devices
    shape = view.shape
    if view.chunks is not None:  # a chunked source: its chunks as saved, no layout to apply
        sliced, blocks, layout_text = dict(view.chunks), {}, f"{len(view.chunks)} chunks (from .metadata)"
    else:
        assert p is not None  # a strategy's view has a layout per stage
        sliced = _grouped(layout.rank_boxes(p, shape), base)
        blocks = _grouped(layout.rank_boxes(model_parallel(p), shape), base) if has_optimizer_shard(p) else {}
        layout_text = describe_layout(p)
    trailing_keys = sorted({box[2:] for box in sliced}) or [()]
    panels = []
    for trailing in trailing_keys:
        rows, cols = _grid_dims(shape)
        # the full tensor is size wide, and as tall as its aspect ratio says within [1/5, 3/2] of that
        height = 30.0 if len(shape) < 2 else size * min(max(rows / max(cols, 1), 0.2), 1.5)
        scale_r, scale_c = height / max(rows, 1), size / max(cols, 1)

        def place(box: Box, kind: str, ranks: tuple[int, ...], s_r: float = scale_r, s_c: float = scale_c) -> Rect:
            (r0, r1), (c0, c1) = _rows_cols(box, shape)
            owners = ", ".join(str(r) for r in ranks)
            copies = f" ({len(ranks)} copies)" if len(ranks) > 1 else ""
            what = "optimizer shard" if kind == "slice" and blocks else "slice"
            tip = f"{what} {_box_text(box)} held by rank{'s' if len(ranks) > 1 else ''} {owners}{copies}"
            fill = rank_colour(ranks[0]) if kind == "slice" else "none"
            label = ranges_label(ranks) if kind == "slice" else ""
            return Rect(
                x + c0 * s_c, y + r0 * s_r, (c1 - c0) * s_c, (r1 - r0) * s_r, kind, fill, label, tip, ranks, box
            )

        slices = tuple(place(b, "slice", r) for b, r in sliced.items() if b[2:] == trailing)
        outlines = tuple(place(b, "block", r) for b, r in blocks.items() if b[2:] == trailing)
        extra = f" dims 2+: {_box_text(trailing)}" if trailing else ""
        ranks = f"ranks {base}-{base + view.devices - 1}"
        title = f"{view.name} {list(shape)}{'' if view.shape_known else ' (in blocks)'}, stage {stage} ({ranks}){extra}"
        if view.chunks is not None:
            title = f"{view.name} {list(shape)}, chunks as saved by {ranks}{extra}"
        panels.append(Panel(title, view.name, stage, shape, layout_text, slices, outlines, trailing))
    return panels


def _grouped(boxes: Sequence[Box], base: int) -> dict[Box, tuple[int, ...]]:
    """Boxes to the (global) ranks holding each, in rank order."""
    found: dict[Box, list[int]] = {}
    for local, box in enumerate(boxes):
        found.setdefault(box, []).append(base + local)
    return {box: tuple(ranks) for box, ranks in found.items()}


def _grid_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], shape[1]


def _rows_cols(box: Box, shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The row and column intervals a box covers when dims 0 and 1 are drawn (a 1-D tensor is one row)."""
    if not shape:
        return (0, 1), (0, 1)
    if len(shape) == 1:
        return (0, 1), box[0]
    return box[0], box[1]


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def ranges_label(ranks: tuple[int, ...]) -> str:
    return ranges_text(list(ranks))


def choose_params(views: Mapping[str, ParamView], wanted: str | None) -> tuple[list[str], str | None]:
    """The parameters to draw and a note saying how they were chosen.

    ``wanted``: a parameter name (a ``UsageError`` with close names when unknown); None: the first
    parameter of each distinct layout (model weights only), at most ``DEFAULT_PANELS``.
    """
    if wanted is not None:
        if wanted not in views:
            close = difflib.get_close_matches(wanted, list(views), n=3, cutoff=0.5)
            hint = (
                f"; did you mean {', '.join(close)}?" if close else f" ({len(views)} parameters; see reshard inspect)"
            )
            raise UsageError(f"no parameter {wanted!r} in the strategy{hint}")
        return [wanted], None
    firsts: dict[object, str] = {}
    for name, view in views.items():
        if STATE_NAMES.is_state(name):
            continue
        key = tuple((s, p, len(view.shape)) for s, p in view.stages.items())
        firsts.setdefault(key, name)
    chosen = list(firsts.values())[:DEFAULT_PANELS]
    if not chosen:
        chosen = list(views)[:DEFAULT_PANELS]
    note = (
        f"no PARAM given: drawing the first parameter of each of {len(firsts)} distinct layouts"
        + (f" (the first {len(chosen)})" if len(firsts) > len(chosen) else "")
        + "; name one to draw it"
    )
    return chosen, note


def param_scene(views: Mapping[str, ParamView], names: Sequence[str], note: str | None = None) -> Scene:
    """The scene of ``names``: one panel per parameter and stage, stacked, each with its legend."""
    size, gap, top = 360.0, 70.0, 40.0
    rects: list[Rect] = []
    labels: list[Label] = [Label(10, 24, note or f"how {names[0]} is split among ranks", 14, bold=True)]
    panels: list[Panel] = []
    y = top + 30
    width = 10 + size + 280
    for name in names:
        view = views[name]
        for stage in view.stages:
            for panel in param_panel(view, stage, 10, y + 22, size):
                panels.append(panel)
                labels.append(Label(10, y + 10, panel.title, 12, bold=True))
                labels.append(Label(10 + size + 16, y + 40, panel.layout_text, 11))
                if not view.shape_known:
                    labels.append(Label(10 + size + 16, y + 58, "shape not in a strategy: dims in blocks", 11))
                legend = []
                if panel.blocks:
                    legend += ["outlined: model-parallel blocks", "filled: optimizer shards"]
                if any(len(r.ranks) > 1 for r in panel.slices):
                    legend.append("several ranks on a block: replicas")
                for i, text in enumerate(legend):
                    labels.append(Label(10 + size + 16, y + 76 + 18 * i, text, 11))
                height = max((r.y + r.h for r in panel.slices), default=y + 22) - (y + 22)
                for r in (*panel.slices, *panel.blocks):
                    rects.append(r)
                    if r.kind == "slice" and r.label:
                        size_px = max(8.0, min(14.0, r.h * 0.6, 2.2 * r.w / max(len(r.label), 1)))
                        labels.append(Label(r.x + r.w / 2, r.y + r.h / 2 + size_px / 3, r.label, size_px, "middle"))
                y += 22 + max(height, 40.0) + gap
    title = note or names[0]
    width = max(width, *(lb.x + len(lb.text) * lb.size * 0.62 + 10 for lb in labels))  # room for the longest text
    return Scene(title, width, y, tuple(rects), tuple(labels), tuple(panels), notes=(note,) if note else ())


def panel_text(panel: Panel) -> list[str]:
    """A panel as a grid of rank numbers: one row per distinct row interval, one column per column interval."""
    lines = [f"{panel.title}: {panel.layout_text}"]
    shape = panel.shape
    rows = sorted({_rows_cols(r.box, shape)[0] for r in panel.slices})
    cols = sorted({_rows_cols(r.box, shape)[1] for r in panel.slices})
    owner: dict[tuple[tuple[int, int], tuple[int, int]], str] = {}
    for r in panel.slices:
        owner[_rows_cols(r.box, shape)] = r.label
    if len(shape) < 2:
        head = [f"[{a}:{b}]" for a, b in cols]
        cells = [owner.get(((0, 1), c), "") for c in cols]
        width = max(len(t) for t in head + cells)
        lines.append("  ".join(t.rjust(width) for t in head))
        lines.append("  ".join(t.rjust(width) for t in cells))
        return lines
    row_head = [f"rows {a}:{b}" for a, b in rows]
    col_head = [f"cols {a}:{b}" for a, b in cols]
    grid = [[owner.get((rw, cl), "") for cl in cols] for rw in rows]
    left = max(len(t) for t in row_head)
    width = max(len(t) for t in col_head + [c for row in grid for c in row])
    lines.append(" " * left + "  " + "  ".join(t.rjust(width) for t in col_head))
    for name, row in zip(row_head, grid, strict=True):
        lines.append(name.ljust(left) + "  " + "  ".join(c.rjust(width) for c in row))
    if panel.blocks:
        lines.append("(cells are optimizer shards; ranks in one cell are replicas)")
    elif any(len(r.ranks) > 1 for r in panel.slices):
        lines.append("(ranks in one cell hold the same slice: replicas)")
    return lines


def source_views(
    source: str, strategy: str | None = None, read: ReadOptions | None = None, notes: list[str] | None = None
) -> dict[str, ParamView]:
    """The parameters of a source, ready to draw: a strategy, rank folders (or one rank's folder) with
    ``strategy``, a Checkpoint 2.0 (which carries its layouts), or a full model with ``strategy``
    (how that strategy would split it).

    Rank folders and a Checkpoint 2.0 give each parameter's full shape from a rank's slice under
    that rank's layout, a full model its tensors' own shapes, a strategy alone shapes in blocks.

    Raises:
        UsageError: No strategy to draw with, or one given where the source carries its own.
    """
    from reshard.sources import ONE_RANK_FOLDER, OpenedChunks, OpenedModel, OpenedStrategy, registry, resolve

    notes = notes if notes is not None else []
    kind = resolve(
        source, strategy=strategy, read=read, flag="--strategy", full_takes_strategy=True, subject="the source"
    )
    opened = kind.open(source, read, notes)
    if isinstance(opened, OpenedStrategy):
        return param_views(opened.strategy)
    if isinstance(opened, OpenedChunks):  # its chunks are its layout: drawn as saved
        return chunk_views(opened.tensors, opened.saved_by)
    sf = registry.open_strategy(strategy, notes) if strategy else opened.strategy
    if sf is None:
        raise UsageError(f"this is {opened.kind}: give a strategy with --strategy to draw how it is split", source)
    if isinstance(opened, OpenedModel) and kind is not ONE_RANK_FOLDER:  # a full model: its own shapes
        return param_views(sf, {name: t.shape for f in opened.files.values() for name, t in f.tensors.items()})
    return param_views(sf, _full_shapes(opened.ranks, sf))  # a rank's slices under its layouts


def _full_shapes(ranks: Mapping[int, SourceFile], sf: StrategyFile) -> dict[str, tuple[int, ...]]:
    """Each parameter's full shape, from the first rank of each stage holding it (its slice under its layout)."""
    devices = device_num(sf)
    shapes: dict[str, tuple[int, ...]] = {}
    seen_stages: set[int] = set()
    for rank, facts in sorted(ranks.items()):
        if rank // devices in seen_stages:
            continue  # the ranks of one stage hold the same names
        seen_stages.add(rank // devices)
        layouts = param_layouts(sf, rank)
        for name, t in facts.tensors.items():
            if name in layouts and name not in shapes:
                shapes[name] = layout.full_shape(layouts[name][0], t.shape)
    return shapes


# ------------------------------------------------------------------------------------ plans


def plan_matrix(plan: Plan) -> Matrix:
    """Bytes each source rank sends to each destination rank of a plan (every copy counted once).

    A source is named by its rank (its ``rank_<r>`` folder or Checkpoint 2.0 file number), else by
    its file name; a destination by its output rank, else its file name.
    """
    labels = [_source_label(path) for path in plan.sources]
    cells: dict[tuple[str, str], int] = {}
    destinations: list[str] = []
    for f in plan.files:
        dst = str(f.rank) if f.rank is not None else os.path.basename(f.path)
        if dst not in destinations:
            destinations.append(dst)
        for t in f.tensors:
            for c in t.copies:
                nbytes = read_bytes(t.dtype, t.shape, math.prod(c.lengths), t.nbytes)
                key = (labels[c.source], dst)
                cells[key] = cells.get(key, 0) + nbytes
    sources = sorted(set(labels), key=_label_order)
    return Matrix(tuple(sources), tuple(sorted(destinations, key=_label_order)), cells)


def _source_label(path: str) -> str:
    from reshard.formats import checkpoint2 as cp2

    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if folder.startswith("rank_") and folder[5:].isdigit():
        return folder[5:]
    parsed = cp2.parse_file_name(os.path.basename(path))
    if parsed is not None:
        return str(parsed.number)
    return os.path.basename(path)


def _label_order(label: str) -> tuple[int, int, str]:
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def matrix_scene(matrix: Matrix, title: str) -> Scene:
    """A plan as a heat map: rows are sources, columns destinations, the shade is the bytes."""
    n_src, n_dst = len(matrix.sources), len(matrix.destinations)
    cell = max(10.0, min(48.0, 640.0 / max(n_src, n_dst, 1)))
    left, top = 90.0, 80.0
    peak = max(matrix.cells.values(), default=0)
    rects: list[Rect] = []
    labels = [
        Label(10, 24, title, 14, bold=True),
        Label(left + n_dst * cell / 2, top - 30, "destination rank", 12, "middle"),
        Label(10, top - 8, "source rank", 12),
    ]
    show_bytes = cell >= 40
    for i, src in enumerate(matrix.sources):
        labels.append(Label(left - 6, top + i * cell + cell / 2 + 4, src, min(11.0, cell * 0.8), "end"))
        for j, dst in enumerate(matrix.destinations):
            nbytes = matrix.cells.get((src, dst), 0)
            fill = _shade(nbytes, peak)
            tip = f"source {src} -> destination {dst}: {format_size(nbytes)} ({nbytes} bytes)"
            rect = Rect(
                left + j * cell, top + i * cell, cell, cell, "cell", fill, "", tip, src=src, dst=dst, nbytes=nbytes
            )
            rects.append(rect)
            if show_bytes and nbytes:
                ink = "white" if nbytes > peak / 2 else "black"
                text = short_size(nbytes)
                labels.append(Label(rect.x + cell / 2, rect.y + cell / 2 + 3, text, 9, "middle", colour=ink))
    every = max(1, math.ceil(max((len(d) for d in matrix.destinations), default=1) * 7.0 / cell))
    for j, dst in enumerate(matrix.destinations):  # every k-th one when narrow cells would crowd them
        if j % every == 0:
            labels.append(Label(left + j * cell + cell / 2, top - 8, dst, min(11.0, cell * 0.8), "middle"))
    note = f"total {format_size(matrix.total)} read; darker = more bytes (largest cell {format_size(peak)})"
    labels.append(Label(10, top + n_src * cell + 24, note, 11))
    width = left + n_dst * cell + 20
    return Scene(title, max(width, 480.0), top + n_src * cell + 40, tuple(rects), tuple(labels), matrix=matrix)


def _shade(nbytes: int, peak: int) -> str:
    """White for nothing, then light to dark blue by bytes."""
    if nbytes <= 0 or peak <= 0:
        return "#ffffff"
    t = 0.15 + 0.85 * nbytes / peak
    r, g, b = (int(255 + (c - 255) * t) for c in (0x1F, 0x4E, 0x99))
    return f"#{r:02x}{g:02x}{b:02x}"


def short_size(n: int) -> str:
    """``1.5KiB``, ``64KiB``; empty for nothing."""
    if not n:
        return ""
    return format_size(n).replace(".00 ", " ").replace(" ", "")


def matrix_text(matrix: Matrix, columns: int = 16) -> list[str]:
    """A plan's source -> destination bytes: the matrix when it is narrow, else one line per destination."""
    if len(matrix.destinations) <= columns:
        head = ["src \\ dst", *matrix.destinations]
        body = [
            [
                src,
                *(
                    short_size(matrix.cells[(src, d)]) if matrix.cells.get((src, d)) else "."
                    for d in matrix.destinations
                ),
            ]
            for src in matrix.sources
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *body]]
    lines = []
    for dst in matrix.destinations:
        feeds = [(src, matrix.cells[(src, dst)]) for src in matrix.sources if matrix.cells.get((src, dst))]
        lines.append(f"dst {dst} <- " + ", ".join(f"{src} ({short_size(b)})" for src, b in feeds))
    return lines


# ------------------------------------------------------------------------------------ writers


def check_output(path: str) -> str:
    """The format ``path`` asks for (``.svg`` / ``.png``), checked before anything is computed.

    Raises:
        UsageError: Another extension, or a folder that does not exist.
        UnsupportedError: PNG without matplotlib.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise UsageError(f"cannot draw a {ext or 'file without extension'}: write .svg or .png", path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError("the folder to write the picture in does not exist", folder)
    if os.path.isdir(path):
        raise UsageError("is a folder: give a file name ending in .svg or .png", path)
    if ext == ".png":
        _matplotlib()
    return ext


def write(scene: Scene, path: str) -> None:
    """Write ``scene`` to ``path`` (SVG, or PNG through matplotlib), atomically."""
    from reshard.formats.base import write_whole

    ext = check_output(path)
    data: bytes | str = svg(scene) if ext == ".svg" else png(scene)
    try:
        write_whole(path, data)
    except OSError as exc:
        raise UsageError(f"cannot write the picture: {exc.strerror}", path) from None


def svg(scene: Scene) -> str:
    """The scene as an SVG document (a ``<rect>`` with ``<title>`` and ``data-*`` attributes per rectangle)."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{scene.width:.0f}" height="{scene.height:.0f}" '
        f'viewBox="0 0 {scene.width:.1f} {scene.height:.1f}" font-family="sans-serif">',
        f"<title>{escape(scene.title)}</title>",
        '<rect x="0" y="0" width="100%" height="100%" fill="white"/>',
    ]
    for r in scene.rects:
        attrs = {"data-kind": r.kind}
        if r.ranks:
            attrs["data-ranks"] = " ".join(str(x) for x in r.ranks)
        if r.box:
            attrs["data-box"] = _box_text(r.box)
        if r.kind == "cell":
            attrs.update({"data-src": r.src, "data-dst": r.dst, "data-bytes": str(r.nbytes)})
        style = (
            'fill="none" stroke="black" stroke-width="2.5"'
            if r.kind == "block"
            else f'fill="{r.fill}" stroke="#333333" stroke-width="0.6"'
        )
        extra = " ".join(f"{k}={quoteattr(v)}" for k, v in attrs.items())
        out.append(
            f'<rect x="{r.x:.2f}" y="{r.y:.2f}" width="{r.w:.2f}" height="{r.h:.2f}" {style} {extra}>'
            f"<title>{escape(r.tooltip)}</title></rect>"
        )
    for lb in scene.labels:
        weight = ' font-weight="bold"' if lb.bold else ""
        ink = "" if lb.colour == "black" else f' fill="{lb.colour}"'
        out.append(
            f'<text x="{lb.x:.2f}" y="{lb.y:.2f}" font-size="{lb.size:.1f}" text-anchor="{lb.anchor}"{weight}{ink}>'
            f"{escape(lb.text)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnsupportedError(PNG_HINT) from None
    return plt


def png(scene: Scene) -> bytes:
    """The scene drawn by matplotlib as PNG bytes (``UnsupportedError`` when matplotlib is missing)."""
    import io

    plt = _matplotlib()
    from matplotlib.patches import Rectangle

    dpi = 100
    fig = plt.figure(figsize=(scene.width / dpi, scene.height / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, scene.width)
    ax.set_ylim(scene.height, 0)
    ax.axis("off")
    for r in scene.rects:
        if r.kind == "block":
            ax.add_patch(Rectangle((r.x, r.y), r.w, r.h, fill=False, edgecolor="black", linewidth=2.0))
        else:
            ax.add_patch(Rectangle((r.x, r.y), r.w, r.h, facecolor=r.fill, edgecolor="#333333", linewidth=0.5))
    align = {"start": "left", "middle": "center", "end": "right"}
    for lb in scene.labels:
        ax.text(
            lb.x, lb.y, lb.text, fontsize=lb.size * 0.75, ha=align[lb.anchor], va="baseline",
            fontweight="bold" if lb.bold else "normal", color=lb.colour,
        )  # fmt: skip
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def scene_text(scene: Scene) -> list[str]:
    """The terminal form of a scene: each panel's rank grid, or the plan's matrix."""
    lines = list(scene.notes)
    if scene.matrix is not None:
        return lines + matrix_text(scene.matrix)
    for panel in scene.panels:
        if lines:
            lines.append("")
        lines.extend(panel_text(panel))
    return lines


def all_ranks(rects: Iterable[Rect]) -> set[int]:
    """Every rank some slice of ``rects`` names (for checks: each rank of a stage appears)."""
    return {r for rect in rects if rect.kind == "slice" for r in rect.ranks}


__all__ = [
    "FORMATS",
    "PNG_HINT",
    "Label",
    "Matrix",
    "Panel",
    "ParamView",
    "Rect",
    "Scene",
    "all_ranks",
    "block_shape",
    "check_output",
    "choose_params",
    "chunk_views",
    "matrix_scene",
    "matrix_text",
    "panel_text",
    "param_panel",
    "param_scene",
    "param_views",
    "plan_matrix",
    "png",
    "ranges_label",
    "rank_colour",
    "scene_text",
    "short_size",
    "source_views",
    "svg",
    "write",
]
