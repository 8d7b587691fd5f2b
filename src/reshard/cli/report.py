"""What a writing command prints when its operation returns: notes, the name report, the summary.

On stderr the notes and the first names of each kind of the name report; on stdout exactly one
of: the plan (a dry run), one JSON record of what was written (``--json``), or the one-line
summary (``wrote 8 files (1.13 GiB) to out/ in 2.1 s, 540.00 MiB/s``). With ``--hf --hf-config``
the config.json is copied beside the shards here (never invented), after the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.cli import progress
from reshard.cli.flags import say_notes
from reshard.cli.tensor_flags import NAME_REPORT_LINES, Tensors
from reshard.errors import UsageError
from reshard.ops.options import TensorOptions
from reshard.text import format_size, one_line

if TYPE_CHECKING:
    from reshard.api import Report
    from reshard.naming import NameReport
    from reshard.plan import Plan


@dataclass(frozen=True)
class Printing:
    """How the command prints its result: ``--quiet``, ``--json``, a dry run, ``--hf`` output, what the
    names and dtypes flags asked (for the name report file and config.json), and when it started."""

    quiet: bool = False
    json: bool = False
    dry_run: bool = False
    hf: bool = False
    tensors: Tensors = field(default_factory=lambda: Tensors(TensorOptions()))
    started: float = field(default_factory=time.monotonic)


def print_plan(plan: Plan, as_json: bool, names: NameReport | None = None) -> None:
    """The plan as JSON, or a table of its outputs and one line of totals."""
    if as_json:
        doc = plan.to_json()
        if names is not None:
            doc["names"] = names.to_json()
        print(json.dumps(doc, indent=1))
        return
    from reshard.inspection import print_table  # paths never cut: folded on a terminal, whole lines on a pipe

    columns = [
        (c, c in ("tensors", "copies", "size", "rank"))
        for c in ("output", "rank", "format", "tensors", "copies", "size")
    ]
    rows = [
        [
            f.path,
            "" if f.rank is None else str(f.rank),
            f.format,
            str(len(f.tensors)),
            str(f.copy_count),
            format_size(f.nbytes),
        ]
        for f in plan.files
    ]
    console = progress.console()
    print_table(f"plan: {plan.operation}", columns, rows, console)
    s = plan.summary()
    console.print(
        f"{s['outputs']} files, {s['tensors']} tensors from {s['sources']} source files; "
        f"read {format_size(plan.bytes_read)}, write {format_size(plan.bytes_written)}, "
        f"largest tensor {format_size(plan.largest_tensor)}",
        soft_wrap=not console.is_terminal,
    )


def finish(report: Report, how: Printing, dst: str | None = None) -> None:
    """What a writing command prints: notes and the name report on stderr; on stdout the plan (a dry
    run), one JSON record of what was written (``--json``), or the one-line summary."""
    progress.end()
    say_notes(report.notes, how.quiet)
    _print_names(report.names, how)
    _copy_hf_config(report, how)
    _missing_config_note(report, how)
    seconds = time.monotonic() - how.started
    if how.dry_run:
        print_plan(report.plan, how.json, report.names)
    elif how.json:
        print(json.dumps(_result_record(report, dst, seconds), indent=1))
    else:
        print(summary(report, dst, seconds))


def _written(report: Report, dst: str | None) -> list[Any]:
    """The plan's files this run wrote: all but those a ``--resume`` kept (paths relative to ``dst``)."""
    if not report.kept or not dst:
        return list(report.plan.files)
    kept, root = set(report.kept), os.path.abspath(dst)
    return [
        f for f in report.plan.files if os.path.relpath(os.path.abspath(f.path), root).replace(os.sep, "/") not in kept
    ]


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _result_record(report: Report, dst: str | None, seconds: float) -> dict[str, Any]:
    """``--json`` after a run: what was written, for scripts (one JSON object)."""
    written = _written(report, dst)
    return {
        "operation": report.plan.operation,
        "destination": dst,
        "written": [{"path": f.path, "bytes": _size(f.path)} for f in written],
        "bytes_written": sum(_size(f.path) for f in written),
        "kept": list(report.kept),
        "texts": [t.path for t in report.plan.texts],
        "seconds": round(seconds, 3),
        "notes": [one_line(n) for n in report.notes],
        "names": report.names.to_json() if report.names is not None else None,
    }


def _copy_hf_config(report: Report, how: Printing) -> None:
    """With ``--hf --hf-config``: the config.json beside the shards (copied, never invented)."""
    raw = how.tensors.hf_config
    if raw is None or not how.hf or how.dry_run or not report.plan.files:
        return
    from reshard.formats.base import write_whole

    folder = os.path.dirname(report.plan.files[0].path)
    write_whole(os.path.join(folder, "config.json"), _config_for_output(raw, report, how))


def _config_for_output(raw: bytes, report: Report, how: Printing) -> bytes:
    """The ``--hf-config`` bytes as the output needs them: how its weights are stored now (``output_config``)."""
    tensors = how.tensors
    if tensors.dequantize is None and tensors.quantize is None and tensors.options.dtype is None:
        return raw  # nothing the run did changes what the config says
    from reshard.plan.output_config import rewritten
    from reshard.plan.quantized import DEFAULT_BLOCK, parse_block

    block = parse_block(tensors.block_size) if tensors.block_size is not None else DEFAULT_BLOCK
    return rewritten(
        raw,
        ((t.name, t.dtype, t.shape) for f in report.plan.files for t in f.tensors),
        quantized=block if tensors.quantize is not None else None,
        dequantized=tensors.dequantize is not None,
        cast=tensors.options.dtype is not None,
    )


def _missing_config_note(report: Report, how: Printing) -> None:
    """A Hugging Face folder without config.json does not load: say so (reshard never invents one)."""
    if not how.hf or how.dry_run or not report.plan.files:
        return
    folder = os.path.dirname(report.plan.files[0].path)
    if not os.path.exists(os.path.join(folder, "config.json")):
        say_notes(
            [
                f"no config.json in {folder}: transformers' from_pretrained needs the model's config.json beside "
                f"the shards (give --hf-config {_source_config(report) or 'FILE'} to copy it in{_config_change(how)})"
            ],
            how.quiet,
        )


def _source_config(report: Report) -> str | None:
    """The config.json beside the run's first source file, when there is one (a Hugging Face folder's)."""
    if not report.plan.sources:
        return None
    beside = os.path.join(os.path.dirname(report.plan.sources[0]), "config.json")
    return beside if os.path.isfile(beside) else None


def _config_change(how: Printing) -> str:
    if how.tensors.quantize is not None:
        return "; --quantize adds its quantization_config"
    if how.tensors.dequantize is not None:
        return "; --dequantize drops its quantization_config"
    return ""


def _print_names(names: NameReport | None, how: Printing) -> None:
    """The name report: on stderr, each kind's first names (nothing with --quiet; in the JSON with
    --json); every name in ``--names-report FILE`` (JSON)."""
    if names is None:
        return
    path = how.tensors.names_report
    if path:
        from reshard.formats.base import write_whole

        try:
            write_whole(path, (json.dumps(names.to_json(), indent=1) + "\n").encode())
        except OSError as exc:
            raise UsageError(f"cannot write the name report: {exc.strerror}", path) from None
    if how.json or how.quiet:
        return
    for line in names.lines(NAME_REPORT_LINES):
        print(f"reshard: {line}", file=sys.stderr)
    if path:
        print(f"reshard: every name is in {path}", file=sys.stderr)


def count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def summary(report: Report, dst: str | None, seconds: float) -> str:
    """``wrote 8 files (1.13 GiB) to out/ in 2.1 s, 540.00 MiB/s; kept 3 from the interrupted run``, or
    ``nothing to do: ...`` when a ``--resume`` found every file complete (its finishing files too), or
    ``the 4 files in out/ were complete already (verified, kept); wrote .metadata`` when it wrote only those."""
    files = _written(report, dst)
    nbytes = sum(f.nbytes for f in files)
    where = f" to {dst.rstrip(os.sep) + os.sep}" if dst else ""
    if report.kept and not files:
        inside = f" in {dst.rstrip(os.sep) + os.sep}" if dst else ""
        if report.finished:
            were = "was" if len(report.kept) == 1 else "were"
            done = f"the {count(len(report.kept), 'file')}{inside} {were} complete already (verified, kept)"
            return f"{done}; wrote {', '.join(report.finished)}"
        verb = "is" if len(report.kept) == 1 else "are"
        return f"nothing to do: the {count(len(report.kept), 'file')}{inside} {verb} complete already (verified, kept)"
    rate = f", {format_size(int(nbytes / seconds))}/s" if seconds > 0 and nbytes else ""
    kept = f"; kept {len(report.kept)} from the interrupted run" if report.kept else ""
    written = f"{count(len(files), 'file')} ({format_size(nbytes)})"
    return f"wrote {written}{where} in {seconds:.1f} s{rate}{kept}"


__all__ = ["Printing", "count", "finish", "print_plan", "summary"]
