"""The ``reshard`` command.

Every user-facing failure is a ``ReshardError``: it becomes one line on stderr and exit code 2.
Anything else is a bug; it is still reported as one line, with exit code 3 (set ``RESHARD_DEBUG=1``
for the traceback) so scripts never parse a Python stack. Exit codes: 0 done, 1 ``verify`` found
a difference, 2 bad input or usage, 3 internal error, 128+signal interrupted (130 Ctrl-C, 143
SIGTERM, 129 SIGHUP; ``--resume`` continues); output cut short by its
reader (``reshard inspect --json | head``) ends quietly with 141, as ``cat`` killed by SIGPIPE does.
``transform`` accepts MindFormers' ``transform_ckpt.py`` flags verbatim (``--src_ckpt_strategy`` ...)
as well as hyphenated forms.

Keys never appear on the command line (shell history, ``ps``): ``--dec-key-file``/``--enc-key-file``
name a file, ``--dec-key-env``/``--enc-key-env`` an environment variable holding hex (``--key-format``
says how to read a key file whose text is also a valid raw key).
"""

from __future__ import annotations

if __name__ == "__main__":  # ``python -m reshard.cli`` is ``python -m reshard``: handlers before any import
    import runpy

    runpy.run_module("reshard", run_name="__main__")  # reshard.entry ends the process

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

# numpy's OpenBLAS starts a spinning thread per core at import; reshard never multiplies matrices,
# and on a 2-core box those threads took 6.6% of a transform's CPU (perf). The command sets this
# before numpy loads (a value the user set wins); library users keep their own setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from reshard import __version__, cli_help, interrupts
from reshard.errors import ReshardError, UsageError
from reshard.execute.digest import ALGORITHMS, DEFAULT_ALGORITHM
from reshard.execute.options import DEFAULT_MAX_MEMORY, RunOptions, WriteOptions, default_workers
from reshard.formats.layout_dir import PICKS
from reshard.interrupts import Signalled
from reshard.naming import (
    EXCLUDE,
    INCLUDE,
    ModelMap,
    NameFilter,
    NameOptions,
    NameReport,
    load_rules,
    name_filter,
    presets,
)
from reshard.naming.config import load_config
from reshard.naming.filters import HF_WEIGHTS_ONLY, WEIGHTS_ONLY
from reshard.naming.presets import PRESETS
from reshard.ops.options import Destination, OutputSpec, TensorOptions
from reshard.text import format_size, one_line, parse_size


def _loaded_on_first_use(name: str) -> ModuleType:
    """Module ``name``, executed when one of its attributes is first read (``importlib.util.LazyLoader``).

    Why: everything above is numpy-free, so ``reshard --version`` and every ``--help`` build the parser
    and exit without loading numpy or the operations; a command that runs loads ``reshard.api`` (and
    numpy with it) at its first ``api.<name>``. The module is registered as a normal import would be,
    so ``import reshard.api`` elsewhere gets the same object.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from reshard import api
    from reshard.plan import Plan
else:
    api = _loaded_on_first_use("reshard.api")

EXIT_USAGE = 2
EXIT_BUG = 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for `cat big | head`
EXIT_CODES = (
    "exit codes: 0 done, 1 verify found a difference, 2 bad input or usage, 3 internal error, "
    "128+signal interrupted (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 141 output closed by its reader "
    "(e.g. | head)"
)


def _memory_size(text: str) -> int:
    """``--max-memory``: a size as ``text.parse_size`` reads it (``512M``, ``2GiB``, ``2GB``)."""
    try:
        return parse_size(text, "the memory bound")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def _whole_number(text: str, minimum: int, what: str, too_small: str) -> int:
    """``text`` as an int of at least ``minimum``; else argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: {too_small}")
    return value


def _rank_number(text: str) -> int:
    return _whole_number(text, 0, "rank", "ranks count from 0")


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, "whole number", "must be at least 1")


def _parse_ranks(text: str) -> list[int]:
    """``0,1,4-7``: ranks in the order given. A reversed range, an empty list or a rank named twice is
    refused: each is a typo more often than not, and a run that writes the wrong set of files is worse
    than a one-line error (a duplicate would also plan the same output file twice)."""
    ranks: list[int] = []
    hint = "(try 0,1,4-7)"
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-"))
                if first > last:
                    raise argparse.ArgumentTypeError(f"{text!r}: range {part} runs backwards (write {last}-{first})")
                ranks.extend(range(first, last + 1))
            elif part:
                ranks.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a rank list: {text!r} {hint}") from None
    if not ranks:
        raise argparse.ArgumentTypeError(f"{text!r} names no rank {hint}")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names rank {', '.join(map(str, twice))} more than once")
    return ranks


def _parse_split(text: str) -> tuple[int, int]:
    """``i/n``: part group i of n, 1 <= i <= n."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a part group: {text!r} (write i/n, e.g. 1/2)") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{text!r}: i/n needs 1 <= i <= n")
    return index, count


def _console():  # imported lazily: rich is only needed for human output
    from rich.console import Console

    _rich_raises_broken_pipe()
    return Console(stderr=False, highlight=False)


def print_plan(plan: Plan, as_json: bool, names: NameReport | None = None) -> None:
    if as_json:
        doc = plan.to_json()
        if names is not None:
            doc["names"] = names.to_json()
        print(json.dumps(doc, indent=1))
        return
    from reshard.inspect import print_table  # paths never cut: folded on a terminal, whole lines on a pipe

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
    console = _console()
    print_table(f"plan: {plan.operation}", columns, rows, console)
    s = plan.summary()
    console.print(
        f"{s['outputs']} files, {s['tensors']} tensors from {s['sources']} source files; "
        f"read {format_size(plan.bytes_read)}, write {format_size(plan.bytes_written)}, "
        f"largest tensor {format_size(plan.largest_tensor)}",
        soft_wrap=not console.is_terminal,
    )


def _speed_column() -> Any:
    """Transfer speed in MiB/s or GiB/s (rich's own column counts in MB/s), matching the summary."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinarySpeed(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{format_size(int(speed))}/s", style="progress.data.speed")

    return BinarySpeed()


class _ProgressBar:
    """A rich progress bar over bytes written (or compared, for verify), on stderr, for a terminal (binary
    units, like the summary)."""

    def __init__(self, description: str = "writing") -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        self.description = description
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),
            _speed_column(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task: Any = None

    def start(self, total: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task(self.description, total=total)

    def advance(self, nbytes: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=nbytes)

    def stop(self) -> None:
        self.progress.stop()


class _ProgressLines:
    """Progress for logs (stderr is a pipe or a file): a plain line every few seconds and one at the end,
    ``reshard: 1.23 GiB / 4.00 GiB (30%), 850.00 MiB/s, ETA 0:03``."""

    def __init__(self, every: float = 5.0, label: str = "") -> None:
        import threading

        self.every, self.label = every, label
        self.lock = threading.Lock()
        self.total = self.done = 0
        self.started = self.last = 0.0
        self.running = False

    def start(self, total: int) -> None:
        self.total, self.done, self.running = total, 0, True
        self.started = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = time.monotonic()
            if self.running and now - self.last >= self.every:
                self.last = now
                self._print(now)

    def stop(self) -> None:
        """A run that failed ends with its error line alone."""
        with self.lock:
            self.running = False

    def finish(self) -> None:
        """The last line, once everything was written."""
        with self.lock:
            if self.running:
                self.running = False
                self._print(time.monotonic())

    def _print(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        percent = 100 * self.done // self.total if self.total else 100
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        print(
            f"reshard: {self.label}{format_size(self.done)} / {format_size(self.total)} ({percent}%), "
            f"{format_size(int(rate))}/s, ETA {_clock(left)}",
            file=sys.stderr,
            flush=True,
        )


def _clock(seconds: float) -> str:
    """``0:03``, ``12:40``, ``1:02:03``."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


_BARS: list[_ProgressBar | _ProgressLines] = []


def _progress_hooks(args: argparse.Namespace, what: str = "writing") -> dict[str, Any]:
    """``--progress``: a bar on a terminal, plain lines in a log; by default a bar on a terminal only.
    ``--quiet`` or ``--no-progress`` silences it. ``what`` names the work on the bar (``verify``: comparing)."""
    show = getattr(args, "progress", None)
    terminal = sys.stderr.isatty()
    if getattr(args, "quiet", False) or getattr(args, "dry_run", False) or show is False or not (show or terminal):
        return {}
    label = "" if what == "writing" else f"{what} "  # transform's log lines stay as documented
    bar: _ProgressBar | _ProgressLines = _ProgressBar(what) if terminal else _ProgressLines(label=label)
    _BARS.append(bar)
    return {"on_start": bar.start, "progress": bar.advance}


def _write_options(args: argparse.Namespace) -> WriteOptions:
    """``--crc``, ``--enc-key-file``/``--enc-key-env``, ``--enc-mode``, ``--checksum``: what outputs hold."""
    return WriteOptions(
        write_crc=getattr(args, "crc", False),
        enc_key=_key(args, "enc"),
        enc_mode=getattr(args, "enc_mode", None) or "AES-GCM",
        checksum=getattr(args, "checksum", DEFAULT_ALGORITHM),
    )


def _run_options(args: argparse.Namespace) -> RunOptions:
    """``--workers``, ``--max-memory``, progress and the executor (``--executor ray`` and its flags)."""
    hooks = _progress_hooks(args)
    if getattr(args, "executor", "local") == "ray":  # Ray imported only when the run starts
        from reshard.execute.ray import RayOptions

        return RayOptions(
            workers=args.workers,
            max_memory=args.max_memory,
            address=args.ray_address,
            shared_disk=args.shared_disk,
            placement=getattr(args, "placement", None),
            on_nodes=None if getattr(args, "quiet", False) else _print_nodes,
            **hooks,
        )
    if getattr(args, "placement", None) is not None:
        raise UsageError("--placement applies to --executor ray only")
    if getattr(args, "ray_address", None) is not None or getattr(args, "shared_disk", True) is False:
        flag = "--ray-address" if getattr(args, "ray_address", None) is not None else "--no-shared-disk"
        raise UsageError(f"{flag} applies to --executor ray only")
    return RunOptions(workers=args.workers, max_memory=args.max_memory, **hooks)


def _print_nodes(done: Any) -> None:
    """``--placement``: the bytes that will cross nodes, said once before any byte moves."""
    if not done.received:
        print(f"reshard: note: {done.schedule.summary(done.names)}", file=sys.stderr)


def _source_from_nodes(args: argparse.Namespace, run: RunOptions | None) -> tuple[str, RunOptions | None]:
    """``--placement``: plan from a header-only copy of ``--src`` made from the nodes (none need be here)."""
    from reshard.execute.ray import RayOptions, source_from_nodes

    if not isinstance(run, RayOptions) or run.placement is None:
        return args.src, run
    return source_from_nodes(args.src, run, _read_options(args))


def _print_planned_nodes(report: api.Report, args: argparse.Namespace) -> None:
    """``reshard plan --placement FILE``: the bytes that would cross nodes, from the placement file."""
    from reshard.execute.nodes import load_placement, planned_schedule

    sched = planned_schedule(report.plan, load_placement(args.placement), _read_options(args))
    print(sched.summary())


def _read_options(args: argparse.Namespace) -> api.ReadOptions:
    return api.ReadOptions(
        dec_key=_key(args, "dec"),
        dec_mode=getattr(args, "dec_mode", None) or "AES-GCM",
        verify_crc=getattr(args, "check_crc", True),
        file_suffix=getattr(args, "file_suffix", None),
        pick=getattr(args, "pick", None),
        src_format=getattr(args, "src_format", None),
        iteration=getattr(args, "read_iteration", None),
    )


_ASSUMED_KEYS: list[str] = []  # "--dec-key-file k.txt read as hex (...)": said again when decryption fails


def _key(args: argparse.Namespace, side: str) -> bytes | None:
    """The key named by ``--<side>-key-file`` / ``--<side>-key-env`` (None when neither is given)."""
    from reshard.formats import crypto

    key_file, env = getattr(args, f"{side}_key_file", None), getattr(args, f"{side}_key_env", None)
    key_format = getattr(args, "key_format", None)
    if key_file is None and env is None:
        if getattr(args, f"{side}_mode", None):
            raise UsageError(f"--{side}-mode needs a key: give --{side}-key-file or --{side}-key-env")
        return None
    if key_file is not None and key_format is None and crypto.ambiguous_key_file(key_file):
        _ASSUMED_KEYS.append(
            f"--{side}-key-file {key_file} was read as hex (32 hex digits: a 16-byte key); "
            "if it is a 32-byte raw key, pass --key-format raw"
        )
    return crypto.load_key(key_file, env, key_format or "auto")


def _destination(args: argparse.Namespace) -> Destination:
    """``--overwrite`` / ``--resume`` / ``--dry-run`` / ``--no-manifest``."""
    return Destination(
        overwrite=args.overwrite, resume=args.resume, dry_run=bool(args.dry_run), manifest=not args.no_manifest
    )


def _output(
    args: argparse.Namespace, fmt: str | None, hf_not_ckpt: tuple[str, str | None] = ("", None), **fields: Any
) -> OutputSpec:
    """``--hf`` / ``--max-shard-size`` beside the command's format flag: the API parses the size
    (``text.parse_size``: ``5GB``, ``2GiB``). ``hf_not_ckpt``: the command's refusal of ``--hf`` with ckpt."""
    hf = getattr(args, "hf", False)
    if hf and fmt == "checkpoint2":
        raise UsageError("a Checkpoint 2.0 is not a Hugging Face model: give --hf or --output-format checkpoint2")
    if hf and fmt == "ckpt" and hf_not_ckpt[0]:
        raise UsageError(*hf_not_ckpt)
    return OutputSpec(format="hf" if hf else fmt, max_shard_size=getattr(args, "max_shard_size", None), **fields)


def _add_hf_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hf",
        action="store_true",
        help="write the full model as Hugging Face shards + model.safetensors.index.json, model weights only "
        "(optimizer moments, global_step ... are dropped as with --weights-only)",
    )
    p.add_argument(
        "--keep-training-state",
        "--keep_training_state",
        dest="keep_training_state",
        action="store_true",
        help="with --hf: keep optimizer moments, global_step ... in the shards too (transformers ignores them)",
    )
    p.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        metavar="SIZE",
        help="with --hf: largest shard, e.g. 5GB (the default), 500MB, 2GiB or bytes (KB/MB/GB are "
        "decimal as on the Hub, K/M/G and KiB/MiB/GiB binary)",
    )


def _add_dtype_flags(p: argparse.ArgumentParser) -> None:
    """``--dtype`` / ``--dtype-all``: cast floating tensors while copying (reshard.plan.cast)."""
    p.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="cast floating model weights to bf16, fp16 or fp32 while copying (integers, bools, strings "
        "and 0-d scalars are never cast; an overflow to inf is an error and writes nothing)",
    )
    p.add_argument(
        "--dtype-all",
        "--dtype_all",
        dest="dtype_all",
        action="store_true",
        help="with --dtype: cast optimizer states too (default: they keep their dtype)",
    )
    _add_precision_flags(p)


def _add_precision_flags(p: argparse.ArgumentParser) -> None:
    """``--dequantize`` / ``--block-size``: block-scaled FP8 and MXFP4 pairs (docs/low-precision.md)."""
    p.add_argument(
        "--dequantize",
        metavar="DTYPE",
        help="turn every FP8 block pair (X + X_scale_inv) and MXFP4 pair (P_blocks + P_scales) into one "
        "bf16, fp16 or fp32 tensor while copying; the scales are consumed",
    )
    p.add_argument(
        "--block-size",
        "--block_size",
        dest="block_size",
        metavar="ROWSxCOLS",
        help="the FP8 block size, e.g. 128x128: with --dequantize (default: config.json's "
        "quantization_config.weight_block_size), with --quantize (default: 128x128)",
    )
    p.add_argument(
        "--quantize",
        metavar="SCHEME",
        help="fp8-block: write 2-D float *.weight tensors as F8_E4M3 plus an F32 *.weight_scale_inv per block "
        "(DeepSeek's rule; embeddings, norms, lm_head and routers stay as they are)",
    )
    p.add_argument(
        "--quantize-include",
        dest="quantize_include",
        metavar="GLOB",
        action="append",
        help="with --quantize: also quantize the 2-D float tensors these names match (repeatable)",
    )
    p.add_argument(
        "--quantize-exclude",
        dest="quantize_exclude",
        metavar="GLOB",
        action="append",
        help="with --quantize: never quantize the tensors these names match (repeatable)",
    )


def _precision(args: argparse.Namespace) -> Any:
    from reshard.plan.quantized import Precision, parse_block

    block = getattr(args, "block_size", None)
    include = tuple(getattr(args, "quantize_include", None) or ())
    exclude = tuple(getattr(args, "quantize_exclude", None) or ())
    quantize = getattr(args, "quantize", None)
    if getattr(args, "dequantize", None) is None and quantize is None and block is None and not include + exclude:
        return None
    size = parse_block(block) if block is not None else None if quantize is not None else _config_block(args)
    return Precision(args.dequantize, size, quantize, include, exclude)


def _config_block(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--hf-config``'s FP8 block size, when it has one (else the source's config.json decides)."""
    from reshard.plan.quantized import block_from_config

    raw = getattr(args, "hf_config_bytes", None)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return block_from_config(doc) if isinstance(doc, dict) else None


def _tensors(args: argparse.Namespace) -> TensorOptions:
    """The name flags (``_names``), ``--dtype`` / ``--dtype-all`` and ``--dequantize`` / ``--quantize``."""
    names = _names(args).get("names")
    return TensorOptions(names=names, dtype=args.dtype, dtype_all=args.dtype_all, precision=_precision(args))


def _notes(notes: Sequence[str], args: argparse.Namespace) -> None:
    if getattr(args, "quiet", False):
        return
    for note in notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)


def _end_progress() -> None:
    """The bar goes (or the last progress line prints) before the command's own output."""
    for bar in _BARS:
        bar.finish() if isinstance(bar, _ProgressLines) else bar.stop()


def _finish(report: api.Report, args: argparse.Namespace, dst: str | None = None) -> None:
    """What a writing command prints: notes and the name report on stderr; on stdout the plan (a dry
    run), one JSON record of what was written (``--json``), or the one-line summary."""
    _end_progress()
    _notes(report.notes, args)
    _print_names(report.names, args)
    _copy_hf_config(report, args)
    _missing_config_note(report, args)
    seconds = time.monotonic() - getattr(args, "started", time.monotonic())
    if getattr(args, "dry_run", False):
        print_plan(report.plan, getattr(args, "json", False), report.names)
    elif getattr(args, "json", False):
        print(json.dumps(_result_record(report, dst, seconds), indent=1))
    else:
        print(summary(report, dst, seconds))


JSON_HELP = (  # every command's --json: one JSON record of its result on stdout, nothing else there
    "print one JSON record on stdout: the plan with --dry-run, else what the run wrote "
    "(destination, files with their bytes, files a --resume kept, notes, the name report)"
)


def _written(report: api.Report, dst: str | None) -> list[Any]:
    """The plan's files this run wrote: all but those a ``--resume`` kept (paths relative to ``dst``)."""
    if not report.kept or not dst:
        return list(report.plan.files)
    kept, root = set(report.kept), os.path.abspath(dst)
    return [
        f for f in report.plan.files if os.path.relpath(os.path.abspath(f.path), root).replace(os.sep, "/") not in kept
    ]


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _result_record(report: api.Report, dst: str | None, seconds: float) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------ names


class _NameRule(argparse.Action):
    """``--include``/``--exclude``: each appends ``(kind, glob)`` to ``name_rules``, keeping the user's order."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        kind = INCLUDE if self.dest == "include" else EXCLUDE
        rules = [*(getattr(namespace, "name_rules", None) or []), (kind, values)]
        namespace.name_rules = rules


def _add_filter_flags(p: argparse.ArgumentParser, verb: str = "keep only", drop: str = "drop") -> None:
    """``--include`` / ``--exclude`` / ``--weights-only``: which tensors a command takes (by source name)."""
    p.add_argument(
        "--include",
        action=_NameRule,
        metavar="GLOB",
        help=f"{verb} tensors whose source name matches (repeatable; with --exclude the last matching rule wins)",
    )
    p.add_argument(
        "--exclude", action=_NameRule, metavar="GLOB", help=f"{drop} tensors whose source name matches (repeatable)"
    )
    p.add_argument(
        "--weights-only",
        action="store_true",
        help=f"{drop} training state: optimizer moments (adam_m., adam_v., accu_grads., ...), global_step, "
        "learning_rate, ...",
    )
    p.set_defaults(name_rules=None)


def _name_filter(args: argparse.Namespace) -> NameFilter | None:
    """The filter the flags of ``_add_filter_flags`` give (None: every tensor). ``--hf`` means weights
    only (what every Hugging Face loader expects) unless ``--keep-training-state`` says otherwise."""
    rules = getattr(args, "name_rules", None) or []
    keep_state = getattr(args, "keep_training_state", False)
    if keep_state and not getattr(args, "hf", False):
        raise UsageError(
            "--keep-training-state applies to --hf output (other outputs keep everything unless --weights-only)"
        )
    if keep_state and getattr(args, "weights_only", False):
        raise UsageError("--keep-training-state and --weights-only contradict each other: give one")
    asked = getattr(args, "weights_only", False)
    weights_only = asked or (getattr(args, "hf", False) and not keep_state)
    rule = WEIGHTS_ONLY if asked else HF_WEIGHTS_ONLY
    if not (rules or weights_only):
        return None
    return name_filter(order=rules, weights_only=weights_only, weights_only_rule=rule)


def _add_name_flags(p: argparse.ArgumentParser) -> None:
    """Filters and renames (docs/naming.md): every writing command takes them."""
    _add_filter_flags(p)
    p.add_argument(
        "--rename", metavar="RULES", help="JSON or YAML file of ordered {match, replace} regex rules (first match wins)"
    )
    p.add_argument("--strict", action="store_true", help="with --rename: fail if a name matches no rule")
    p.add_argument(
        "--names-report",
        metavar="FILE",
        help=f"write the whole name report (every renamed, dropped and unmatched name) as JSON to FILE; "
        f"stderr lists the first {NAME_REPORT_LINES} of each kind",
    )
    _add_preset_flags(p)


def _names(args: argparse.Namespace) -> dict[str, Any]:
    """The ``names=`` argument of an operation (rules files are read here, before any checkpoint)."""
    report = getattr(args, "names_report", None)
    if report:
        _check_side_file(args, report, "name report (--names-report)")
    strict = getattr(args, "strict", False)
    model_map = _model_map(args)
    if strict and model_map is None:
        raise UsageError("--strict needs --rename or --preset (it refuses names no rule matches)")
    keep = _name_filter(args)
    config = getattr(args, "hf_config_values", None)
    if keep is None and model_map is None and config is None:
        return {}
    guard = getattr(args, "preset", None) is not None
    path = getattr(args, "hf_config", None)
    return {"names": NameOptions(keep or name_filter(), model_map, strict, guard, config, path)}


def _sources(args: argparse.Namespace) -> list[str]:
    """Every path the command reads (checkpoint and strategies): no output may lie in one."""
    names = ("src", "checkpoint", "src_strategy", "dst_strategy", "strategy", "source")
    return [v for v in (getattr(args, n, None) for n in names) if isinstance(v, str) and _none(v) is not None]


def _check_side_file(
    args: argparse.Namespace, path: str, what: str, make_folder: bool = False, sources: Sequence[str] | None = None
) -> None:
    """A file the command writes beside its output, checked before the first byte (reshard.destination)."""
    from reshard import destination

    inputs = _sources(args) if sources is None else sources
    destination.check_output_file(path, inputs, getattr(args, "overwrite", False), what, make_folder)


def _model_map(args: argparse.Namespace) -> ModelMap | None:
    """The model map the flags give: ``--rename RULES`` or ``--preset NAME`` (None: names kept)."""
    rename = getattr(args, "rename", None)
    if rename and getattr(args, "preset", None):
        raise UsageError("--rename and --preset are two name maps: give one")
    preset = _preset_map(args)
    return load_rules(rename) if rename else preset


# ------------------------------------------------------------------------------------ presets


def _add_preset_flags(p: argparse.ArgumentParser) -> None:
    """``--preset NAME`` and ``--hf-config FILE`` (docs/presets.md)."""
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="MindFormers <-> Hugging Face names of a model family, with its tensor surgery (docs/presets.md); "
        "with --hf: to Hugging Face names",
    )
    p.add_argument(
        "--hf-config",
        metavar="FILE",
        help="the model's Hugging Face config.json: gives --preset the sizes its surgery needs; with --hf it is "
        "copied into the output",
    )


def _preset_map(args: argparse.Namespace) -> ModelMap | None:
    """The preset's map; ``--hf-config`` is read here, before any checkpoint (bad: nothing written)."""
    name, path = getattr(args, "preset", None), getattr(args, "hf_config", None)
    hf = getattr(args, "hf", False)
    if path and not (hf or name):
        raise UsageError("--hf-config needs --hf (to copy it) or --preset (to take sizes from it)")
    config = None
    if path:
        config = load_config(path)  # names what is wrong with the file, before any checkpoint is read
        args.hf_config_values = config  # the full tensors' shapes must agree with it (naming.shapes)
        try:
            with open(path, "rb") as f:
                args.hf_config_bytes = f.read()  # copied beside the shards as it is
        except OSError as e:
            raise UsageError(f"--hf-config {path}: {e.strerror or e}") from None
        if hf and not _is_json_object(args.hf_config_bytes):
            raise UsageError(f"--hf-config {path}: with --hf it is copied as config.json, so it must be a JSON object")
    if name is None:
        return None
    return presets.preset_map(name, None, config, presets.TO_HF if hf else None)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def _copy_hf_config(report: api.Report, args: argparse.Namespace) -> None:
    """With ``--hf --hf-config``: the config.json beside the shards (copied, never invented)."""
    raw = getattr(args, "hf_config_bytes", None)
    if raw is None or not getattr(args, "hf", False) or getattr(args, "dry_run", False) or not report.plan.files:
        return
    from reshard.formats.base import write_whole

    folder = os.path.dirname(report.plan.files[0].path)
    if getattr(args, "dequantize", None) is not None:  # the weights are no longer quantized
        doc = json.loads(raw)
        if doc.pop("quantization_config", None) is not None:
            raw = (json.dumps(doc, indent=2) + "\n").encode()
    elif getattr(args, "quantize", None) is not None:  # the config says how the weights are stored now
        from reshard.plan.quantized import DEFAULT_BLOCK, parse_block, quantization_config

        block = parse_block(args.block_size) if args.block_size is not None else DEFAULT_BLOCK
        doc = json.loads(raw)
        doc["quantization_config"] = quantization_config(block)
        raw = (json.dumps(doc, indent=2) + "\n").encode()
    write_whole(os.path.join(folder, "config.json"), raw)


def _missing_config_note(report: api.Report, args: argparse.Namespace) -> None:
    """A Hugging Face folder without config.json does not load: say so (reshard never invents one)."""
    if not getattr(args, "hf", False) or getattr(args, "dry_run", False) or not report.plan.files:
        return
    folder = os.path.dirname(report.plan.files[0].path)
    if not os.path.exists(os.path.join(folder, "config.json")):
        _notes(
            [
                f"no config.json in {folder}: transformers' from_pretrained needs the model's config.json beside "
                "the shards (give --hf-config FILE to copy it in)"
            ],
            args,
        )


NAME_REPORT_LINES = 10  # names listed per kind on stderr; --names-report FILE keeps every one


def _print_names(names: NameReport | None, args: argparse.Namespace) -> None:
    """The name report: on stderr, each kind's first names (nothing with --quiet; in the JSON with
    --json); every name in ``--names-report FILE`` (JSON)."""
    if names is None:
        return
    path = getattr(args, "names_report", None)
    if path:
        from reshard.formats.base import write_whole

        try:
            write_whole(path, (json.dumps(names.to_json(), indent=1) + "\n").encode())
        except OSError as exc:
            raise UsageError(f"cannot write the name report: {exc.strerror}", path) from None
    if getattr(args, "json", False) or getattr(args, "quiet", False):
        return
    for line in names.lines(NAME_REPORT_LINES):
        print(f"reshard: {line}", file=sys.stderr)
    if path:
        print(f"reshard: every name is in {path}", file=sys.stderr)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def summary(report: api.Report, dst: str | None, seconds: float) -> str:
    """``wrote 8 files (1.13 GiB) to out/ in 2.1 s, 540.00 MiB/s; kept 3 from the interrupted run``, or
    ``nothing to do: ...`` when a ``--resume`` found every file complete."""
    files = _written(report, dst)
    nbytes = sum(f.nbytes for f in files)
    where = f" to {dst.rstrip(os.sep) + os.sep}" if dst else ""
    if report.kept and not files:
        inside = f" in {dst.rstrip(os.sep) + os.sep}" if dst else ""
        verb = "is" if len(report.kept) == 1 else "are"
        return f"nothing to do: the {_count(len(report.kept), 'file')}{inside} {verb} complete already (verified, kept)"
    rate = f", {format_size(int(nbytes / seconds))}/s" if seconds > 0 and nbytes else ""
    kept = f"; kept {len(report.kept)} from the interrupted run" if report.kept else ""
    written = f"{_count(len(files), 'file')} ({format_size(nbytes)})"
    return f"wrote {written}{where} in {seconds:.1f} s{rate}{kept}"


# ------------------------------------------------------------------------------------ commands


def cmd_transform(args: argparse.Namespace) -> None:
    if _tool_mode(args):  # MindFormers' transform_checkpoint.py flags
        return cmd_transform_ckpt(args)
    if args.command == "plan":
        args.dry_run = True
    if not args.src:
        raise UsageError("give the source with --src_ckpt_dir")
    if not args.dst:
        raise UsageError("give the destination with --dst_ckpt_dir")
    if args.command == "plan" and getattr(args, "picture", None):
        from reshard import picture

        picture.check_output(args.picture)  # a bad picture name fails before planning
        _check_side_file(args, args.picture, "picture (--picture)")
    run = None if args.command == "plan" else _run_options(args)
    src, run = _source_from_nodes(args, run)
    read = _read_options(args) if src == args.src else dataclasses.replace(_read_options(args), verify_crc=False)
    report = api.transform(
        src,
        args.dst,
        _mindformers_strategy(args.src, args.src_strategy, "--src-strategy", args),
        _none(args.dst_strategy),
        ranks=args.ranks,
        output=_output(args, args.output_format, (_HF_NOT_CKPT, None), prefix=args.prefix, **_checkpoint2(args)),
        destination=_destination(args),
        tensors=_tensors(args),
        read=read,
        write=None if args.command == "plan" else _write_options(args),
        run=run,
    )
    _finish(report, args, args.dst)
    if args.command == "plan" and getattr(args, "picture", None):
        _plan_picture(report, args.picture)
    if args.command == "plan" and getattr(args, "placement", None):
        _print_planned_nodes(report, args)


_HF_NOT_CKPT = "Hugging Face output is a full safetensors model: give no destination strategy and no ckpt output format"

# Flags of reshard's own transform that MindFormers' tool has no counterpart for: refused beside its flags.
_NOT_WITH_TOOL = {
    "src": "--src_ckpt_dir/--src",
    "dst": "--dst_ckpt_dir/--dst",
    "ranks": "--ranks",
    "hf": "--hf",
    "keep_training_state": "--keep-training-state",
    "resume": "--resume",
    "dry_run": "--dry-run",
    "src_format": "--src-format",
    "file_suffix": "--file-suffix",
    "pick": "--pick",
    "crc": "--crc",
    "dec_key_file": "--dec-key-file",
    "dec_key_env": "--dec-key-env",
    "enc_key_file": "--enc-key-file",
    "enc_key_env": "--enc-key-env",
    "json": "--json",
    "name_rules": "--include/--exclude",
    "weights_only": "--weights-only",
    "rename": "--rename",
    "strict": "--strict",
    "dtype": "--dtype",
    "dtype_all": "--dtype-all",
    "dequantize": "--dequantize",
    "block_size": "--block-size",
    "quantize": "--quantize",
    "quantize_include": "--quantize-include",
    "quantize_exclude": "--quantize-exclude",
}
_TOOL_FLAGS = ("tool_src", "tool_dst", "rank_id", "world_size", "transform_process_num", "transform_by_rank")


def _tool_mode(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in _TOOL_FLAGS)


def cmd_transform_ckpt(args: argparse.Namespace) -> None:
    """``reshard transform --src_checkpoint ...``: MindFormers' TransformCkpt tool (reshard.transform_ckpt)."""
    from reshard import transform_ckpt as tool

    if args.tool_src is None:
        raise UsageError("give the source with --src_checkpoint (MindFormers' transform_checkpoint.py flags)")
    for name, flag in _NOT_WITH_TOOL.items():
        if getattr(args, name, None) not in (None, False):
            raise UsageError(f"{flag} does not combine with MindFormers' --src_checkpoint flags")
    if args.output_format not in (None, "ckpt") or args.executor != "local":
        raise UsageError("MindFormers' --src_checkpoint flags write .ckpt on this machine only")
    say = (lambda _: None) if args.quiet else (lambda note: _notes([note], args))
    note = tool.bool_note(args.transform_by_rank)
    if note:
        say(note)
    defaults = tool.ToolArgs()
    result = tool.run(
        tool.ToolArgs(
            src_checkpoint=args.tool_src,
            dst_checkpoint_dir=args.tool_dst if args.tool_dst is not None else defaults.dst_checkpoint_dir,
            src_strategy=args.src_strategy,
            dst_strategy=args.dst_strategy,
            prefix=defaults.prefix if args.prefix is None else args.prefix,
            rank_id=defaults.rank_id if args.rank_id is None else args.rank_id,
            world_size=defaults.world_size if args.world_size is None else args.world_size,
            transform_process_num=(
                defaults.transform_process_num if args.transform_process_num is None else args.transform_process_num
            ),
            transform_by_rank=args.transform_by_rank is not None and tool.parse_bool(args.transform_by_rank),
        ),
        say,
    )
    seconds = time.monotonic() - args.started
    where = ", ".join(d.rstrip(os.sep) + os.sep for d in result.model_dirs)
    files = _count(len(result.written), "file")
    print(f"wrote {files} ({format_size(tool.written_bytes(result.written))}) to {where} in {seconds:.1f} s")


def _mindformers_strategy(checkpoint: str | None, given: str | None, flag: str, args: argparse.Namespace) -> str | None:
    """The source strategy given, else for several rank folders (or, without a checkpoint, always) the
    folder where MindFormers keeps it (``reshard.sources.conventions``), said in a note."""
    from reshard.sources.conventions import find_source_strategy, needs_strategy

    if given is not None:
        return _none(given)
    if checkpoint is not None and not needs_strategy(checkpoint):
        return None
    notes: list[str] = []
    found = find_source_strategy(checkpoint, flag, notes)
    _notes(notes, args)
    return found


def _checkpoint2(args: argparse.Namespace) -> dict[str, Any]:
    """``--iteration`` / ``--common-json`` / ``--optimizer-prefix`` (Checkpoint 2.0 output only)."""
    common = _load_common(args.common_json) if args.common_json else None
    return {"iteration": args.iteration, "common": common, "optimizer_prefixes": tuple(args.optimizer_prefixes or ())}


def _load_common(path: str) -> dict[str, object]:
    """A JSON object of common.json values (a MindFormers common.json itself will do)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--common-json: cannot read JSON: {exc}", path) from None
    if not isinstance(data, dict):
        raise UsageError('--common-json: expected a JSON object such as {"global_step": 100}', path)
    return data


def _iteration(text: str) -> int:
    return _whole_number(text, 0, "iteration", "iterations count from 0")


def _add_checkpoint2_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--iteration",
        type=_iteration,
        help="with --output-format checkpoint2: the iteration number, iteration_<N 8 digits>/ "
        "(default: a Checkpoint 2.0 source's own, else 0)",
    )
    p.add_argument(
        "--common-json",
        "--common_json",
        dest="common_json",
        metavar="FILE",
        help="with --output-format checkpoint2: a JSON object of common.json's values (epoch_num, step_num, "
        "global_step, loss_scale, global_batch_size, consumed_samples, ckpt_status; the rest null)",
    )
    p.add_argument(
        "--optimizer-prefix",
        "--optimizer_prefix",
        dest="optimizer_prefixes",
        action="append",
        metavar="PREFIX",
        help="with --output-format checkpoint2: names starting with PREFIX go to the opt- files too "
        "(repeatable; adam_m., adam_v., accu_grads., global_step, learning_rate ... always do)",
    )


def _none(value: str | None) -> str | None:
    return None if value in (None, "", "None", "none") else value


def cmd_auto_transform(args: argparse.Namespace) -> None:
    """``reshard auto-transform``: the path rank ``--rank-id`` loads on stdout, notes on stderr."""
    from reshard.auto import auto_transform

    path = auto_transform(
        args.checkpoint,
        args.dst_strategy,
        args.rank_id,
        src_strategy=args.src_strategy,
        cache_dir=args.cache_dir,
        world_size=args.world_size,
        output_format=args.output_format,
        timeout=args.timeout,
        local_ranks=args.local_ranks,
        max_cache_bytes=args.max_cache_bytes,
        on_note=lambda note: _notes([note], args),
        **_names(args),
    )
    print(path)


def cmd_unify(args: argparse.Namespace) -> None:
    split = args.split or ()
    strategy = _mindformers_strategy(args.src, args.strategy, "--strategy", args)
    if strategy is None and not _is_checkpoint2(args.src):  # a Checkpoint 2.0's layouts are in its metadata.json
        raise UsageError("unify needs the strategy of the rank folders: give --strategy", args.src)
    read, write, run = _read_options(args), _write_options(args), _run_options(args)
    if split and not args.dry_run:  # an empty part group is refused before anything is written
        groups = api.unify(
            args.src,
            strategy,
            args.dst,
            parts=api.UnifyOptions(split_dst_file=split),
            destination=api.Destination(dry_run=True),
            read=read,
        ).plan
        if not groups.files:
            raise UsageError(
                f"--split {split[0]}/{split[1]}: that part group is empty (this model fills fewer "
                f"than {split[1]} part files; use a smaller n)"
            )
    report = api.unify(
        args.src,
        strategy,
        args.dst,
        parts=api.UnifyOptions(split_dst_file=split),
        output=_output(args, None),
        destination=_destination(args),
        tensors=_tensors(args),
        read=read,
        write=write,
        run=run,
    )
    _finish(report, args, args.dst)


def cmd_split(args: argparse.Namespace) -> None:
    name_map = _load_json(args.name_map) if args.name_map else None
    report = api.split(
        args.src,
        args.strategy,
        args.dst,
        ranks=args.ranks,
        output=OutputSpec(format=args.output_format),
        name_map=name_map,
        destination=_destination(args),
        tensors=_tensors(args),
        write=_write_options(args),
        run=_run_options(args),
    )
    _finish(report, args, args.dst)


def cmd_rank_list(args: argparse.Namespace) -> None:
    from reshard.formats.strategy import load_strategy
    from reshard.layout import device_num, stage_count

    notes: list[str] = []
    dst = _none(args.dst_strategy)
    dst_sf = load_strategy(dst) if dst is not None else None
    if dst_sf is not None:
        notes.extend(dst_sf.notes)
    total = device_num(dst_sf) * stage_count(dst_sf) if dst_sf is not None else 1
    if args.rank >= total:
        where = (
            f"the destination strategy has {total} ranks (0..{total - 1})"
            if dst_sf is not None
            else "without a destination strategy the destination is one full model, rank 0"
        )
        raise UsageError(f"destination rank {args.rank} out of range: {where}", dst)
    if args.files:
        _print_rank_files(args, dst_sf, notes)
        return
    ranks = api.needed_ranks(args.rank, _rank_list_source(args, notes), dst_sf, notes)
    _notes(notes, args)
    ranks = sorted(int(r) for r in ranks)  # MindSpore's list order carries no meaning; a person reads 0 1 2
    print(json.dumps(ranks) if args.json else " ".join(str(r) for r in ranks))


def _is_checkpoint2(path: str) -> bool:
    from reshard.sources import CHECKPOINT2, kind_of

    return kind_of(path) is CHECKPOINT2


def _rank_list_source(args: argparse.Namespace, notes: list[str]) -> Any:
    """The source layouts: ``--src-strategy``, or a MindFormers Checkpoint 2.0's metadata.json (``--src``)."""
    if args.src is None:
        if args.read_iteration is not None:
            raise UsageError("--iteration applies to a MindFormers Checkpoint 2.0 given with --src")
        return _mindformers_strategy(None, args.src_strategy, "--src-strategy", args)
    from reshard.sources import CHECKPOINT2, identify
    from reshard.sources.checkpoint2 import check_iteration

    kind = identify(args.src)
    check_iteration(args.src, kind, _read_options(args))
    if kind is not CHECKPOINT2:
        return _mindformers_strategy(args.src, args.src_strategy, "--src-strategy", args)
    if args.src_strategy is not None:
        raise UsageError("a MindFormers Checkpoint 2.0 carries its layouts in metadata.json: give no source strategy")
    return CHECKPOINT2.open(args.src, _read_options(args), notes).strategy


def _print_rank_files(args: argparse.Namespace, dst_sf: Any, notes: list[str]) -> None:
    """The files destination ``args.rank`` reads: the sources of its plan (nothing is written)."""
    if args.src is None:
        raise UsageError("--files needs the source (--src)")
    report = api.transform(
        args.src,
        "",
        _none(args.src_strategy),
        dst_sf,
        ranks=[args.rank],
        destination=api.Destination(dry_run=True),
        read=_read_options(args),
    )
    _notes([*notes, *report.notes], args)
    files = sorted(report.plan.sources)
    print(json.dumps(files) if args.json else "\n".join(files))


def _load_json(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read JSON: {exc}", path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UsageError("expected a JSON object of old name -> new name", path)
    return data


def _default_destination(src: str, to: str, hf: bool) -> str:
    """Where ``convert SRC`` without DST writes: a new folder beside the source, never inside it
    (``ckpt_8ranks`` -> ``ckpt_8ranks_safetensors``, ``full/model.ckpt`` -> ``full/model_safetensors``)."""
    path = src.rstrip(os.sep) or os.sep
    if os.path.basename(path) in ("", ".", ".."):  # "." has no name to put a suffix on
        path = os.path.abspath(path)
    stem = path if os.path.isdir(path) else os.path.splitext(path)[0]
    return f"{stem}_{'hf' if hf else to}"


def cmd_convert(args: argparse.Namespace) -> None:
    name_map = _load_json(args.name_map) if args.name_map else None
    beside = None
    if args.dst is None:
        args.dst = _default_destination(args.src, args.to, args.hf)
        beside = f"no destination given: wrote into {args.dst}, a new folder beside the source"
    refusal = ("Hugging Face output converts one full .ckpt file to safetensors", args.src)
    report = api.convert(
        args.src,
        args.dst,
        _output(args, args.to, refusal),
        name_map=name_map,
        file_regex=args.file_regex,
        destination=_destination(args),
        tensors=_tensors(args),
        read=_read_options(args),
        write=_write_options(args),
        run=_run_options(args),
    )
    if beside is not None and not args.dry_run:
        report.notes.insert(0, beside)
    _finish(report, args, args.dst)


def cmd_verify(args: argparse.Namespace) -> int:
    from reshard import verify

    report = verify.verify(
        args.a,
        args.b,
        a_strategy=_mindformers_strategy(args.a, args.a_strategy, "--a-strategy", args),
        b_strategy=_mindformers_strategy(args.b, args.b_strategy, "--b-strategy", args),
        read=_read_options(args),
        verify_crc=not args.no_crc_check,
        atol=args.atol,
        max_memory=args.max_memory,
        dtype=args.dtype,
        names=_name_filter(args),
        dequantize=args.dequantize,
        **_progress_hooks(args, "comparing"),
    )
    _end_progress()
    _notes(report.notes, args)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        verify.print_report(report, _console(), all_rows=args.all)
    return 0 if report.ok else verify.EXIT_DIFFER


def cmd_merge_strategies(args: argparse.Namespace) -> None:
    from reshard.formats.strategy import find_strategy_files, is_merged_file, merge_pipeline_strategies

    # As MindSpore's merge_pipeline_strategys: the merged file may go into the folder of the
    # per-stage files (readers pass over it there, with a note), but never onto one of them.
    candidates = find_strategy_files(args.src) if os.path.isdir(args.src) else [args.src]
    stages = [f for f in candidates if not is_merged_file(f)]  # an earlier merged file may be replaced
    _check_side_file(args, args.dst, "merged strategy", make_folder=True, sources=stages)
    notes: list[str] = []
    out = merge_pipeline_strategies(args.src, args.dst, notes)
    _notes(notes, args)
    print(f"wrote {out}")


def cmd_inspect(args: argparse.Namespace) -> None:
    from reshard import inspect as inspect_mod

    inspect_mod.main(args.path, as_json=args.json, strategy=args.strategy, read=_read_options(args), params=args.params)


def cmd_show(args: argparse.Namespace) -> None:
    """``reshard show``: draw how parameters are split among ranks (``-o``), and print it as rank grids."""
    from reshard import picture

    if args.output:
        picture.check_output(args.output)  # a bad name fails before anything is read
        _check_side_file(args, args.output, "picture (--output)")
    strategy = _mindformers_strategy(args.source, args.strategy, "--strategy", args)  # as transform finds it
    notes: list[str] = []
    views = picture.source_views(args.source, strategy, _read_options(args), notes)
    names, note = picture.choose_params(views, args.param)
    _notes(notes, args)
    scene = picture.param_scene(views, names, note)
    if args.output:
        picture.write(scene, args.output)
    print("\n".join(picture.scene_text(scene)))
    if args.output:
        print(f"wrote {args.output}")


def _plan_picture(report: api.Report, path: str) -> None:
    """``reshard plan --picture FILE``: the plan's source -> destination bytes, drawn and printed."""
    from reshard import picture

    matrix = picture.plan_matrix(report.plan)
    title = f"plan: {len(matrix.sources)} sources -> {len(matrix.destinations)} destinations, bytes read"
    picture.write(picture.matrix_scene(matrix, title), path)
    print("\n".join(picture.matrix_text(matrix)))
    print(f"wrote {path}")


def cmd_demo(args: argparse.Namespace) -> None:
    from reshard import demo

    demo.main(args.dir)


# ------------------------------------------------------------------------------------ parser


def _add_write_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that read checkpoints of any kind and write them (convert, transform)."""
    _add_run_flags(p)
    _add_crypto_flags(p)
    _add_check_crc_flag(p)
    _add_hf_flags(p)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=default_workers(),
        help="worker threads: parallel output files, or tensors of a one-file output "
        "(default: one per core, at least 4, at most 8)",
    )
    p.add_argument(
        "--max-memory",
        "--max_memory",
        type=_memory_size,
        default=DEFAULT_MAX_MEMORY,
        help="bound on staging bytes in flight, e.g. 512M or 2G (K/M/G and KiB/MiB/GiB are binary, "
        "KB/MB/GB decimal: 2GB = 2*10^9)",
    )
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the plan, write nothing")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr: a bar on a terminal, a plain line every 5 s in a log or pipe "
        "(default: the bar, on a terminal only)",
    )
    _add_quiet_flag(p)
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted run: keep its verified files, redo the rest"
    )
    p.add_argument(
        "--no-manifest",
        action="store_true",
        help="skip reshard-manifest.json and the journal (saves hashing the outputs; no --resume)",
    )
    p.add_argument(
        "--checksum",
        choices=ALGORITHMS,
        default=DEFAULT_ALGORITHM,
        help="checksum of each output in the manifest: blake3 (default, b3sum; 4x faster here) or sha256 (sha256sum)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="run output files on this machine's threads or as Ray tasks (pip install reshard[ray])",
    )
    p.add_argument(
        "--ray-address",
        help="with --executor ray: the cluster to join, HOST:PORT (default: RAY_ADDRESS or a new local cluster)",
    )
    p.add_argument(
        "--shared-disk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --executor ray: nodes see the same paths (else sources/outputs travel through Ray)",
    )
    _add_placement_flag(p, "with --executor ray: sources are on the nodes' own disks; ")


def _add_placement_flag(p: argparse.ArgumentParser, prefix: str) -> None:
    p.add_argument(
        "--placement",
        metavar="FILE|auto",
        help=prefix + "a JSON file saying which node holds which files, or auto (ask every node); "
        "outputs are written on the node holding most of their input, only needed byte ranges cross nodes",
    )


def _add_quiet_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no notes and no progress on stderr (errors still print)")


def _add_source_flags(p: argparse.ArgumentParser, src_format: bool = True) -> None:
    """Which file of a rank folder holding several checkpoints is the source."""
    p.add_argument(
        "--file-suffix",
        "--file_suffix",
        dest="file_suffix",
        metavar="SUFFIX",
        help="the file of each rank folder whose name ends in SUFFIX, e.g. -1_4 (MindFormers' -{epoch}_{step}) or 1_4; "
        "auto: the newest -{epoch}_{step} every rank folder holds",
    )
    p.add_argument(
        "--pick",
        choices=tuple(PICKS),
        help="when a rank folder holds several checkpoints: the last name "
        "(MindSpore) or the newest file (MindFormers by rank); default: MindSpore's rule, said in a note",
    )
    if src_format:
        p.add_argument(
            "--src-format",
            "--src_format",
            dest="src_format",
            choices=("ckpt", "safetensors"),
            help="read these files when the rank folders hold both .ckpt and .safetensors",
        )


def _add_check_crc_flag(p: argparse.ArgumentParser) -> None:
    """The crc trailer of every .ckpt source is checked by default; ``--no-check-crc`` skips it."""
    p.add_argument(
        "--no-check-crc",
        "--no_check_crc",
        dest="check_crc",
        action="store_false",
        default=True,
        help="skip verifying the crc trailer of .ckpt sources that have one (checked by default: "
        "one extra read of each)",
    )
    p.add_argument(
        "--check-crc", "--check_crc", dest="check_crc", action="store_true", help=argparse.SUPPRESS
    )  # the old opt-in flag: now the default, still accepted


def _add_crypto_flags(p: argparse.ArgumentParser, read: bool = True, write: bool = True) -> None:
    from reshard.formats.crypto import MODES

    if read:
        p.add_argument("--dec-key-file", "--dec_key_file", help="key of encrypted .ckpt sources (raw bytes or hex)")
        p.add_argument("--dec-key-env", "--dec_key_env", metavar="VAR", help="environment variable holding it in hex")
        p.add_argument("--dec-mode", "--dec_mode", choices=MODES, help="cipher of the sources (default AES-GCM)")
        p.add_argument(
            "--key-format",
            choices=("raw", "hex"),
            help="how to read a key file: raw bytes, or hex digits (default: hex when the file holds "
            "exactly 32, 48 or 64 hex digits, raw otherwise; 32 hex characters are also a valid "
            "raw AES-256 key, so name the format for those)",
        )
    if write:
        p.add_argument("--enc-key-file", "--enc_key_file", help="encrypt .ckpt outputs with this key file")
        if not read:
            p.add_argument(
                "--key-format",
                choices=("raw", "hex"),
                help="how to read a key file (default: as for "
                "transform: hex when it holds exactly 32, 48 or 64 hex digits, raw otherwise)",
            )
        p.add_argument("--enc-key-env", "--enc_key_env", metavar="VAR", help="... or the key in this variable (hex)")
        p.add_argument("--enc-mode", "--enc_mode", choices=MODES, help="cipher of the outputs (default AES-GCM)")
        p.add_argument("--crc", action="store_true", help="append a crc trailer to .ckpt outputs (MindSpore crc_check)")


def _add_transform_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src_ckpt_dir", "--src-ckpt-dir", "--src", dest="src", help="rank_<r> folders or a full file")
    p.add_argument("--dst_ckpt_dir", "--dst-ckpt-dir", "--dst", dest="dst", help="output folder")
    p.add_argument(
        "--src_ckpt_strategy",
        "--src-ckpt-strategy",
        "--src-strategy",
        dest="src_strategy",
        help="source strategy file or folder of per-stage files (None: full weights)",
    )
    p.add_argument(
        "--dst_ckpt_strategy",
        "--dst-ckpt-strategy",
        "--dst-strategy",
        dest="dst_strategy",
        help="destination strategy file or folder (None: full weights)",
    )
    p.add_argument(
        "--prefix",
        help="output name prefix (default checkpoint_; with checkpoint2: none, else MindFormers' <prefix>-model-...)",
    )
    p.add_argument(
        "--output_format",
        "--output-format",
        dest="output_format",
        choices=("ckpt", "safetensors", "checkpoint2"),
        help="ckpt or safetensors rank folders, or checkpoint2: a MindFormers 2.x Checkpoint 2.0 "
        "(default: the source's format)",
    )
    _add_checkpoint2_flags(p)
    p.add_argument("--ranks", type=_parse_ranks, help="only these destination ranks, e.g. 0,1,4-7")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    _add_source_flags(p)
    _add_iteration_flag(p, "--src-iteration", "--src_iteration")
    _add_dtype_flags(p)


def _add_iteration_flag(p: argparse.ArgumentParser, *names: str, both: bool = False) -> None:
    """Which ``iteration_*`` folder of a MindFormers Checkpoint 2.0 root is read (docs/formats.md §13)."""
    sides = " (on either side)" if both else ""
    p.add_argument(
        *(names or ("--iteration",)),
        dest="read_iteration",
        metavar="N",
        type=_iteration_number,
        help=f"the iteration of a MindFormers Checkpoint 2.0 to read{sides} (default: the tracker's)",
    )


def _iteration_number(text: str) -> int:
    return _whole_number(text, 0, "iteration", "an iteration is 0 or more")


def _add_transform_ckpt_flags(p: argparse.ArgumentParser) -> None:
    """MindFormers 2.1.0's ``tools/ckpt_transform/transform_checkpoint.py`` flags (``reshard.transform_ckpt``)."""
    g = p.add_argument_group("MindFormers' transform_checkpoint.py flags (its output layout and marker files)")
    g.add_argument(
        "--src_checkpoint", dest="tool_src", help="a .ckpt file, or a folder of rank_<r> folders or of .ckpt files"
    )
    g.add_argument("--dst_checkpoint_dir", dest="tool_dst", help="writes DST/<source name>/rank_<r>/<prefix><r>.ckpt "
                   "(default: ./transformed_checkpoint)")  # fmt: skip
    g.add_argument("--src_strategy", dest="src_strategy", help="as --src-strategy (None: full weights)")
    g.add_argument("--dst_strategy", dest="dst_strategy", help="as --dst-strategy (None: full weights)")
    g.add_argument("--rank_id", type=int, help="this invocation's rank (default 0: the RANK_ID variable, else 0)")
    g.add_argument("--world_size", type=int, help="ranks of the job (default 1; 0: the RANK_SIZE variable)")
    g.add_argument(
        "--transform_process_num",
        type=int,
        help="invocations that convert (default 1): ranks 0, W/P, 2W/P, ... each convert W/P destination ranks",
    )
    g.add_argument(
        "--transform_by_rank",
        nargs="?",
        const="True",
        metavar="BOOL",
        help="convert rank by rank (any non-empty value is true, as in the tool; forced by "
        "--transform_process_num > 1, off for --world_size 1)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``reshard: error: ...``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        where = "" if self.prog == "reshard" else f"{self.prog}: "  # "reshard: error: reshard: ..." says it twice
        print(f"reshard: error: {where}{message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class _IntermixedParser(_Parser):
    """A subcommand whose optional positional may come after its flags (argparse before 3.12 takes
    ``[PARAM]`` with the first positionals and then refuses it as unrecognized)."""

    _inside = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="reshard", description="Convert, merge, split and reshard MindSpore checkpoints.", epilog=EXIT_CODES
    )
    parser.add_argument("-V", "--version", action="version", version=f"reshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", help="build an 8-rank example model and show what reshard does")
    p.add_argument("--dir", help="a new or empty folder to keep the demo's files in (default: a temporary one)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("inspect", help="summary of a checkpoint, a rank folder tree or a strategy file")
    p.add_argument("path")
    p.add_argument("--strategy", help="strategy file or folder, to show full shapes and layouts")
    p.add_argument("--params", action="store_true", help="also list every parameter (one table, names never cut)")
    p.add_argument("--json", action="store_true", help="print one JSON record on stdout: the summary and every tensor")
    _add_crypto_flags(p, write=False)
    _add_iteration_flag(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "convert", help="convert .ckpt <-> .safetensors, or re-encrypt / decrypt .ckpt (a file or rank* folders)"
    )
    p.add_argument("src")
    p.add_argument(
        "dst",
        nargs="?",
        help="output folder (default: a new folder beside the source, SRC_safetensors / SRC_ckpt / SRC_hf; "
        "never the source's own folders)",
    )
    p.add_argument("--to", required=True, choices=("safetensors", "ckpt"))
    p.add_argument("--name-map", "--name_map", help="JSON file: old name -> new name")
    p.add_argument("--file-regex", "--file_name_regex", dest="file_regex", help="only files matching this regex")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    _add_source_flags(p, src_format=False)
    _add_write_flags(p)
    _add_name_flags(p)
    _add_dtype_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("merge-strategies", help="merge per-stage strategy files into one")
    p.add_argument("src", help="folder of per-stage strategy files")
    p.add_argument("dst", help="merged strategy file to write (a new file, or --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file at DST")
    p.set_defaults(func=cmd_merge_strategies)

    p = sub.add_parser("transform", help="move a checkpoint to another parallel layout", epilog=EXIT_CODES)
    _add_transform_flags(p)
    _add_transform_ckpt_flags(p)
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty destination")
    _add_write_flags(p)
    _add_name_flags(p)
    p.set_defaults(func=cmd_transform)

    p = sub.add_parser("plan", help="print the transform plan without writing anything", epilog=EXIT_CODES)
    _add_transform_flags(p)  # only what shapes the plan: nothing about running it
    _add_crypto_flags(p, write=False)
    _add_check_crc_flag(p)
    _add_hf_flags(p)
    _add_placement_flag(p, "print the bytes that would cross nodes: ")
    p.add_argument(
        "--picture",
        metavar="FILE",
        help="also draw which source ranks feed which destination ranks, with bytes (.svg, or .png with matplotlib)",
    )
    _add_name_flags(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --picture or --names-report file")
    p.set_defaults(func=cmd_transform, resume=False, no_manifest=False, dry_run=True)

    p = sub.add_parser("show", help="draw how a parameter's full tensor is split among ranks (SVG/PNG and text)")
    p.add_argument("source", help="a strategy file or folder, rank folders (with --strategy), or a Checkpoint 2.0")
    p.add_argument("param", nargs="?", help="the parameter to draw (default: the first of each distinct layout)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the picture here (.svg, or .png with matplotlib)")
    p.add_argument("--strategy", help="the strategy of rank folders (a Checkpoint 2.0 carries its own)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    _add_crypto_flags(p, write=False)
    _add_iteration_flag(p)
    p.set_defaults(func=cmd_show)
    p.__class__ = _IntermixedParser  # PARAM may follow the flags: show SRC --strategy S PARAM

    p = sub.add_parser("unify", help="merge rank shards into full safetensors parts + param_name_map.json")
    p.add_argument("src", help="folder of rank_<r> folders (safetensors), or a MindFormers Checkpoint 2.0")
    p.add_argument("dst", help="output folder")
    p.add_argument(
        "--strategy",
        "--src-strategy",
        help="source strategy file or folder (default: where MindFormers keeps it; none for a Checkpoint 2.0)",
    )
    _add_iteration_flag(p)
    _add_source_flags(p, src_format=False)
    p.add_argument("--split", type=_parse_split, help="produce only part group i of n, as i/n (1 <= i <= n)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the files this run writes in a non-empty destination"
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    _add_run_flags(p)
    _add_hf_flags(p)
    _add_check_crc_flag(p)
    _add_name_flags(p)
    _add_dtype_flags(p)
    p.set_defaults(func=cmd_unify)

    p = sub.add_parser("split", help="slice a unified model into per-rank files for a strategy")
    p.add_argument("src", help="unified folder (part files + param_name_map.json)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--strategy", "--dst-strategy", required=True, help="destination strategy file or folder")
    p.add_argument("--ranks", type=_parse_ranks)
    p.add_argument(
        "--output-format",
        "--output_format",
        dest="output_format",
        default="safetensors",
        choices=("ckpt", "safetensors"),
    )
    p.add_argument("--name-map", "--name_map", help="JSON file: strategy name -> unified name")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the files this run writes in a non-empty destination"
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    _add_run_flags(p)
    _add_crypto_flags(p, read=False)
    _add_name_flags(p)
    _add_dtype_flags(p)
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("verify", help="compare the full tensors of two checkpoints (exit 0 same, 1 differ)")
    p.add_argument("a", help="checkpoint file, unified folder, or rank_<r> folder tree (with --a-strategy)")
    p.add_argument("b", help="the other side, in any of those forms and either format")
    p.add_argument("--a-strategy", "--a_strategy", help="strategy file or folder of side A's rank folders")
    p.add_argument("--b-strategy", "--b_strategy", help="strategy file or folder of side B's rank folders")
    p.add_argument("--atol", type=float, default=0.0, help="count values within this absolute difference as equal")
    p.add_argument(
        "--all", action="store_true", help="list every tensor, matching ones too (default: only those that differ)"
    )
    p.add_argument("--no-crc-check", action="store_true", help="skip checking .ckpt crc trailers")
    p.add_argument(
        "--max-memory",
        "--max_memory",
        type=_memory_size,
        default=256 * 1024**2,
        help="bound on the tensor blocks compared at once, e.g. 256M (K/M/G and KiB/MiB/GiB are "
        "binary, KB/MB/GB decimal)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the result as one JSON record on stdout (every tensor compared)"
    )
    _add_quiet_flag(p)
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bytes compared and ETA on stderr: a bar on a terminal, a plain line every 5 s in a log or pipe "
        "(default: the bar, on a terminal only)",
    )
    _add_source_flags(p)
    _add_crypto_flags(p, write=False)
    _add_iteration_flag(p, both=True)
    p.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="read floating tensors of both sides as bf16, fp16 or fp32 before comparing them exactly "
        "(checks an output written with --dtype against its source)",
    )
    p.add_argument(
        "--dequantize",
        metavar="DTYPE",
        help="read FP8 block pairs and MXFP4 pairs of both sides as bf16, fp16 or fp32 (checks an output "
        "written with --dequantize against its quantized source)",
    )
    _add_filter_flags(p, verb="compare only", drop="leave out")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "auto-transform",
        help="at job start: convert once for all ranks into a shared cache, print the file this rank loads",
    )
    p.add_argument("checkpoint", help="any source transform reads (full model, rank folders, unify output, HF, ...)")
    p.add_argument("--dst-strategy", required=True, help="the job's strategy file or folder (waited for)")
    p.add_argument("--rank-id", required=True, type=_rank_number, help="this caller's destination rank")
    p.add_argument("--src-strategy", help="source strategy (default: MindFormers' strategy folder, for rank folders)")
    p.add_argument(
        "--cache-dir",
        help="cache folder shared by all callers (default: $RESHARD_CACHE, else ~/.cache/reshard/transformed)",
    )
    p.add_argument("--world-size", type=_positive_int, help="wait for the strategy files of this many ranks")
    p.add_argument("--output-format", choices=("ckpt", "safetensors"), help="default: the source's")
    p.add_argument("--timeout", type=float, help="seconds to wait for the strategy files (default 3600)")
    p.add_argument("--local-ranks", type=_parse_ranks, help="this node's ranks (e.g. 0-7), converted together")
    p.add_argument("--max-cache-bytes", help="evict the oldest unused entries beyond this size (e.g. 500GB)")
    p.add_argument("--quiet", action="store_true", help="no notes on stderr")
    _add_name_flags(p)
    p.set_defaults(func=cmd_auto_transform)

    p = sub.add_parser("rank-list", help="source ranks a destination rank needs")
    p.add_argument("rank", type=_rank_number, help="a destination rank")
    p.add_argument(
        "--src-strategy",
        "--src_ckpt_strategy",
        dest="src_strategy",
        help="source strategy (default: MindFormers' output/strategy folder; None: full weights)",
    )
    p.add_argument("--dst-strategy", "--dst_ckpt_strategy", dest="dst_strategy")
    p.add_argument("--src", help="the source checkpoint: a MindFormers Checkpoint 2.0 needs no --src-strategy")
    p.add_argument("--files", action="store_true", help="print the source files the rank reads (needs --src)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON record on stdout (a list)")
    _add_iteration_flag(p)
    p.set_defaults(func=cmd_rank_list)
    for command in sub.choices.values():
        command.epilog = command.epilog or EXIT_CODES
    cli_help.teach(parser, EXIT_CODES)  # descriptions, examples, defaults of every subcommand
    return parser


def _run(args: argparse.Namespace) -> object:
    _BARS.clear()
    _ASSUMED_KEYS.clear()
    if args.func in _OWN_CONSOLES:
        _rich_raises_broken_pipe()
    try:
        return args.func(args)
    finally:
        for bar in _BARS:
            bar.stop()


def interrupted(exc: KeyboardInterrupt, finished: bool = False) -> int:
    """The one line an interrupted command prints, and its exit code (128 + signal, as Unix tools).

    ``finished``: the signal came after the command had done its work (``reshard.entry``).
    """
    from reshard.manifest import PROGRESS_ATTRIBUTE

    signum = interrupts.signal_of(exc)
    progress = getattr(exc, PROGRESS_ATTRIBUTE, None)
    if progress is None:
        progress = interrupts.completed_run()  # a signal after the run committed, while reporting or exiting
    if progress is None:
        detail = "the command had finished" if finished else "no output file was written"
    elif progress.complete:
        detail = (
            f"{progress.completed} of {progress.total} files completed; "
            "the output is complete (--resume has nothing to do)"
        )
    elif progress.resumable:
        detail = (
            f"{progress.completed} of {progress.total} files completed; run the same command with --resume to continue"
        )
    else:
        detail = (
            f"{progress.completed} of {progress.total} files completed; without a manifest (--no-manifest) "
            "--resume cannot tell them apart: run the command again"
        )
    print(interrupts.line(signum, detail), file=sys.stderr)
    return 128 + signum


# Commands that print through rich consoles of their own (inspect.py, demo.py); every other rich
# console on stdout comes from ``_console``, which patches it. Other runs never import rich (40 ms).
_OWN_CONSOLES = (cmd_inspect, cmd_demo)


def _rich_raises_broken_pipe() -> None:
    """rich answers a closed stdout with ``SystemExit(1)``; reshard wants its own quiet exit (141)."""
    from rich.console import Console

    def on_broken_pipe(self: Console) -> None:
        raise BrokenPipeError

    Console.on_broken_pipe = on_broken_pipe  # type: ignore[method-assign]


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): say nothing, exit like a tool killed by SIGPIPE.

    stdout now points at /dev/null, so the interpreter's last flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


_VALUE_FLAGS = ("--file-suffix", "--file_suffix")  # values such as -1_4 start with a dash


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--file-suffix -1_4`` -> ``--file-suffix=-1_4``: argparse would take ``-1_4`` for a flag."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        if items[i] in _VALUE_FLAGS and i + 1 < len(items) and items[i + 1].startswith("-"):
            out.append(f"{items[i]}={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


def _error_line(exc: ReshardError) -> str:
    from reshard.errors import CryptoError

    text = one_line(str(exc))
    if isinstance(exc, CryptoError) and _ASSUMED_KEYS:
        text += f" ({'; '.join(_ASSUMED_KEYS)})"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in this process (``reshard.entry.main`` is the one that starts a process)."""
    try:
        with interrupts.handling():
            return _main(argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    words = _join_dash_values(sys.argv[1:] if argv is None else argv)
    cli_help.check_argv(parser, words)  # no command: the overview; a misspelling: "did you mean"
    interrupts.reached("parse")
    args = parser.parse_args(words)
    try:
        args.started = time.monotonic()
        status = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        raise
    except ReshardError as exc:
        print(f"reshard: error: {_error_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return interrupted(exc)
    except Exception as exc:  # a bug: still one line, unless debugging
        if os.environ.get("RESHARD_DEBUG"):
            raise
        print(
            f"reshard: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(RESHARD_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_BUG
    return status if isinstance(status, int) else 0


__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_BUG",
    "EXIT_CODES",
    "EXIT_USAGE",
    "Signalled",
    "build_parser",
    "cmd_auto_transform",
    "cmd_convert",
    "cmd_demo",
    "cmd_inspect",
    "cmd_merge_strategies",
    "cmd_rank_list",
    "cmd_show",
    "cmd_split",
    "cmd_transform",
    "cmd_transform_ckpt",
    "cmd_unify",
    "cmd_verify",
    "interrupted",
    "main",
    "print_plan",
    "summary",
]


if __name__ == "__main__":
    sys.exit(main())  # not reached: the top of the module hands ``python -m reshard.cli`` to reshard.entry
