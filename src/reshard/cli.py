"""The ``reshard`` command.

Every user-facing failure is a ``ReshardError``: it becomes one line on stderr and exit code 2.
Anything else is a bug; it is still reported as one line (set ``RESHARD_DEBUG=1`` for the
traceback) so scripts never parse a Python stack. ``transform`` accepts MindFormers'
``transform_ckpt.py`` flags verbatim (``--src_ckpt_strategy`` ...) as well as hyphenated forms.

Keys never appear on the command line (shell history, ``ps``): ``--dec-key-file``/``--enc-key-file``
name a file, ``--dec-key-env``/``--enc-key-env`` an environment variable holding hex. ``verify``
exits 0 when both sides hold the same tensors, 1 when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

# numpy's OpenBLAS starts a spinning thread per core at import; reshard never multiplies matrices,
# and on a 2-core box those threads took 6.6% of a transform's CPU (perf). The command sets this
# before numpy loads (a value the user set wins); library users keep their own setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from reshard import api
from reshard.errors import ReshardError, UsageError
from reshard.execute import local
from reshard.execute.digest import ALGORITHMS, DEFAULT_ALGORITHM
from reshard.plan import Plan

EXIT_USAGE = 2
EXIT_BUG = 1


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _parse_memory(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    t = text.strip().lower().rstrip("ib").rstrip("b") if text.strip().lower()[-1:] == "b" else text.strip().lower()
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 2G)") from None


def _parse_ranks(text: str) -> list[int]:
    ranks: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = part.split("-")
                ranks.extend(range(int(a), int(b) + 1))
            elif part.strip():
                ranks.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rank list: {text!r} (try 0,1,4-7)") from None
    return ranks


def _console():  # imported lazily: rich is only needed for human output
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def print_plan(plan: Plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.to_json(), indent=1))
        return
    from rich.table import Table

    table = Table(title=f"plan: {plan.operation}")
    for col in ("output", "rank", "format", "tensors", "copies", "size"):
        table.add_column(col, justify="right" if col in ("tensors", "copies", "size", "rank") else "left")
    for f in plan.files:
        copies = f.copy_count
        rank = "" if f.rank is None else str(f.rank)
        table.add_row(f.path, rank, f.format, str(len(f.tensors)), str(copies), _size(f.nbytes))
    console = _console()
    console.print(table)
    s = plan.summary()
    console.print(
        f"{s['outputs']} files, {s['tensors']} tensors from {s['sources']} source files; "
        f"read {_size(plan.bytes_read)}, write {_size(plan.bytes_written)}, "
        f"largest tensor {_size(plan.largest_tensor)}"
    )


class _ProgressBar:
    """A rich progress bar over bytes written, on stderr, only when stderr is a terminal (or forced)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                 transient=True)
        self.task: Any = None

    def start(self, total: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("writing", total=total)

    def advance(self, nbytes: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=nbytes)

    def stop(self) -> None:
        self.progress.stop()


_BARS: list[_ProgressBar] = []


def _run_options(args: argparse.Namespace) -> local.Options:
    key = _key(args, "enc")
    show = getattr(args, "progress", None)
    if show is None:
        show = sys.stderr.isatty()
    hooks: dict[str, Any] = {}
    if show and not getattr(args, "dry_run", False):
        bar = _ProgressBar()
        _BARS.append(bar)
        hooks = {"on_start": bar.start, "progress": bar.advance}
    if getattr(args, "executor", "local") == "ray":  # Ray imported only when the run starts
        from reshard.execute.ray import RayOptions

        hooks.update(address=args.ray_address, shared_disk=args.shared_disk)
        options_class: type[local.Options] = RayOptions
    else:
        options_class = local.Options
    return options_class(workers=args.workers, max_memory=args.max_memory, crc_check=getattr(args, "crc", False),
                         enc_key=key, enc_mode=getattr(args, "enc_mode", None) or "AES-GCM",
                         checksum=getattr(args, "checksum", DEFAULT_ALGORITHM), **hooks)


def _read_options(args: argparse.Namespace) -> api.ReadOptions:
    return api.ReadOptions(dec_key=_key(args, "dec"), dec_mode=getattr(args, "dec_mode", None) or "AES-GCM",
                           crc_check=getattr(args, "check_crc", True))


def _key(args: argparse.Namespace, side: str) -> bytes | None:
    """The key named by ``--<side>-key-file`` / ``--<side>-key-env`` (None when neither is given)."""
    from reshard.formats import crypto

    key_file, env = getattr(args, f"{side}_key_file", None), getattr(args, f"{side}_key_env", None)
    if key_file is None and env is None:
        if getattr(args, f"{side}_mode", None):
            raise UsageError(f"--{side}-mode needs a key: give --{side}-key-file or --{side}-key-env")
        return None
    return crypto.load_key(key_file, env)


def _kwargs(args: argparse.Namespace) -> dict[str, bool]:
    return {"overwrite": args.overwrite, "resume": args.resume, "manifest": not args.no_manifest}


def _hf(args: argparse.Namespace) -> dict[str, Any]:
    """``--hf`` / ``--max-shard-size``: the API parses the size (``5GB``, ``500MB``, ``2GiB``, bytes)."""
    return {"hf": args.hf, "max_shard_size": args.max_shard_size}


def _add_hf_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", action="store_true",
                   help="write the full model as Hugging Face shards + model.safetensors.index.json")
    p.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", metavar="SIZE",
                   help="with --hf: largest shard, e.g. 5GB (default, decimal), 500MB, 2GiB or bytes")


def _notes(report: api.Report) -> None:
    for note in report.notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)


def _finish(report: api.Report, args: argparse.Namespace) -> None:
    _notes(report)
    if getattr(args, "dry_run", False) or getattr(args, "json", False):
        print_plan(report.plan, getattr(args, "json", False))
    else:
        p = report.plan
        print(f"wrote {len(p.files)} files ({_size(p.bytes_written)})")


# ------------------------------------------------------------------------------------ commands


def cmd_transform(args: argparse.Namespace) -> None:
    if not args.src:
        raise UsageError("give the source with --src_ckpt_dir")
    if not args.dst:
        raise UsageError("give the destination with --dst_ckpt_dir")
    report = api.transform(
        args.src, args.dst, _none(args.src_strategy), _none(args.dst_strategy), prefix=args.prefix,
        output_format=args.output_format, ranks=args.ranks, read=_read_options(args), run=_run_options(args),
        dry_run=args.dry_run or args.command == "plan", **_kwargs(args), **_hf(args),
    )
    if args.command == "plan":
        args.dry_run = True
    _finish(report, args)


def _none(value: str | None) -> str | None:
    return None if value in (None, "", "None", "none") else value


def cmd_unify(args: argparse.Namespace) -> None:
    split = tuple(int(x) for x in args.split.split("/")) if args.split else ()
    report = api.unify(args.src, args.strategy, args.dst, file_suffix=args.file_suffix,
                       split_dst_file=split, read=_read_options(args), run=_run_options(args), dry_run=args.dry_run,
                       **_kwargs(args), **_hf(args))  # type: ignore[arg-type]
    _finish(report, args)


def cmd_split(args: argparse.Namespace) -> None:
    name_map = _load_json(args.name_map) if args.name_map else None
    report = api.split(args.src, args.strategy, args.dst, ranks=args.ranks, output_format=args.output_format,
                       name_map=name_map, run=_run_options(args), dry_run=args.dry_run, **_kwargs(args))
    _finish(report, args)


def cmd_rank_list(args: argparse.Namespace) -> None:
    ranks = api.needed_ranks(args.rank, _none(args.src_strategy), _none(args.dst_strategy))
    print(json.dumps([int(r) for r in ranks]) if args.json else " ".join(str(r) for r in ranks))


def _load_json(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read JSON: {exc}", path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UsageError("expected a JSON object of old name -> new name", path)
    return data


def cmd_convert(args: argparse.Namespace) -> None:
    name_map = _load_json(args.name_map) if args.name_map else None
    report = api.convert(args.src, args.dst, args.to, name_map=name_map, file_regex=args.file_regex,
                         read=_read_options(args), run=_run_options(args), dry_run=args.dry_run, **_kwargs(args),
                         **_hf(args))
    _finish(report, args)


def cmd_verify(args: argparse.Namespace) -> int:
    from reshard import verify

    report = verify.verify(args.a, args.b, a_strategy=_none(args.a_strategy), b_strategy=_none(args.b_strategy),
                           read=_read_options(args), crc_check=not args.no_crc_check, atol=args.atol,
                           max_memory=args.max_memory)
    for note in report.notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        verify.print_report(report, _console())
    return 0 if report.ok else verify.EXIT_DIFFER


def cmd_merge_strategies(args: argparse.Namespace) -> None:
    from reshard.formats.strategy import merge_pipeline_strategies

    out = merge_pipeline_strategies(args.src, args.dst)
    print(f"wrote {out}")


def cmd_inspect(args: argparse.Namespace) -> None:
    from reshard import inspect as inspect_mod

    inspect_mod.main(args.path, as_json=args.json, strategy=args.strategy)


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
    p.add_argument("--workers", type=int, default=local.default_workers(),
                   help="worker threads: parallel output files, or tensors of a one-file output "
                        "(default: one per core, at least 4, at most 8)")
    p.add_argument("--max-memory", "--max_memory", type=_parse_memory, default=local.DEFAULT_MAX_MEMORY,
                   help="bound on staging bytes in flight (e.g. 512M, 2G)")
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep its verified files, redo the rest")
    p.add_argument("--no-manifest", action="store_true",
                   help="skip reshard-manifest.json and the journal (saves hashing the outputs; no --resume)")
    p.add_argument("--checksum", choices=ALGORITHMS, default=DEFAULT_ALGORITHM,
                   help="checksum of each output in the manifest: blake3 (default, b3sum; 4x faster here) or "
                        "sha256 (sha256sum)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="run output files on this machine's threads or as Ray tasks (pip install reshard[ray])")
    p.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS or a new local cluster)")
    p.add_argument("--shared-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="with --executor ray: nodes see the same paths (else sources/outputs travel through Ray)")


def _add_check_crc_flag(p: argparse.ArgumentParser) -> None:
    """The crc trailer of every .ckpt source is checked by default; ``--no-check-crc`` skips it."""
    p.add_argument("--no-check-crc", "--no_check_crc", dest="check_crc", action="store_false", default=True,
                   help="skip verifying the crc trailer of .ckpt sources that have one (checked by default: "
                        "one extra read of each)")
    p.add_argument("--check-crc", "--check_crc", dest="check_crc", action="store_true",
                   help=argparse.SUPPRESS)  # the old opt-in flag: now the default, still accepted


def _add_crypto_flags(p: argparse.ArgumentParser, read: bool = True, write: bool = True) -> None:
    from reshard.formats.crypto import MODES

    if read:
        p.add_argument("--dec-key-file", "--dec_key_file", help="key of encrypted .ckpt sources (raw bytes or hex)")
        p.add_argument("--dec-key-env", "--dec_key_env", metavar="VAR", help="environment variable holding it in hex")
        p.add_argument("--dec-mode", "--dec_mode", choices=MODES, help="cipher of the sources (default AES-GCM)")
    if write:
        p.add_argument("--enc-key-file", "--enc_key_file", help="encrypt .ckpt outputs with this key file")
        p.add_argument("--enc-key-env", "--enc_key_env", metavar="VAR", help="... or the key in this variable (hex)")
        p.add_argument("--enc-mode", "--enc_mode", choices=MODES, help="cipher of the outputs (default AES-GCM)")
        p.add_argument("--crc", action="store_true", help="append a crc trailer to .ckpt outputs (MindSpore crc_check)")


def _add_transform_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src_ckpt_dir", "--src-ckpt-dir", "--src", dest="src", help="rank_<r> folders or a full file")
    p.add_argument("--dst_ckpt_dir", "--dst-ckpt-dir", "--dst", dest="dst", help="output folder")
    p.add_argument("--src_ckpt_strategy", "--src-ckpt-strategy", "--src-strategy", dest="src_strategy",
                   help="source strategy file or folder of per-stage files (None: full weights)")
    p.add_argument("--dst_ckpt_strategy", "--dst-ckpt-strategy", "--dst-strategy", dest="dst_strategy",
                   help="destination strategy file or folder (None: full weights)")
    p.add_argument("--prefix", default="checkpoint_", help="output name prefix (default checkpoint_)")
    p.add_argument("--output_format", "--output-format", dest="output_format", choices=("ckpt", "safetensors"))
    p.add_argument("--ranks", type=_parse_ranks, help="only these destination ranks, e.g. 0,1,4-7")
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty destination")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``reshard: error: ...``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"reshard: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reshard", description="Convert, merge, split and reshard MindSpore checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", help="build an 8-rank example model and show what reshard does")
    p.add_argument("--dir", help="work folder (default: a temporary one)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("inspect", help="tensors of a checkpoint, a rank folder tree or a strategy file")
    p.add_argument("path")
    p.add_argument("--strategy", help="strategy file or folder, to show full shapes and layouts")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="convert .ckpt <-> .safetensors (a file or rank* folders)")
    p.add_argument("src")
    p.add_argument("dst", nargs="?", help="output folder (default: next to the input)")
    p.add_argument("--to", required=True, choices=("safetensors", "ckpt"))
    p.add_argument("--name-map", "--name_map", help="JSON file: old name -> new name")
    p.add_argument("--file-regex", "--file_name_regex", dest="file_regex", help="only files matching this regex")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--json", action="store_true")
    _add_write_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("merge-strategies", help="merge per-stage strategy files into one")
    p.add_argument("src", help="folder of per-stage strategy files")
    p.add_argument("dst", help="merged strategy file to write")
    p.set_defaults(func=cmd_merge_strategies)

    for name, help_text in (("transform", "move a checkpoint to another parallel layout"),
                            ("plan", "print the transform plan without writing anything")):
        p = sub.add_parser(name, help=help_text)
        _add_transform_flags(p)
        _add_write_flags(p)
        p.set_defaults(func=cmd_transform)

    p = sub.add_parser("unify", help="merge rank shards into full safetensors parts + param_name_map.json")
    p.add_argument("src", help="folder of rank_<r> folders (safetensors)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--strategy", "--src-strategy", required=True, help="source strategy file or folder")
    p.add_argument("--file-suffix", "--file_suffix", dest="file_suffix")
    p.add_argument("--split", help="produce only part group i of n, as i/n")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--json", action="store_true")
    _add_run_flags(p)
    _add_hf_flags(p)
    _add_check_crc_flag(p)
    p.set_defaults(func=cmd_unify)

    p = sub.add_parser("split", help="slice a unified model into per-rank files for a strategy")
    p.add_argument("src", help="unified folder (part files + param_name_map.json)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--strategy", "--dst-strategy", required=True, help="destination strategy file or folder")
    p.add_argument("--ranks", type=_parse_ranks)
    p.add_argument("--output-format", "--output_format", dest="output_format", default="safetensors",
                   choices=("ckpt", "safetensors"))
    p.add_argument("--name-map", "--name_map", help="JSON file: strategy name -> unified name")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--json", action="store_true")
    _add_run_flags(p)
    _add_crypto_flags(p, read=False)
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("verify", help="compare the full tensors of two checkpoints (exit 0 same, 1 differ)")
    p.add_argument("a", help="checkpoint file, unified folder, or rank_<r> folder tree (with --a-strategy)")
    p.add_argument("b", help="the other side, in any of those forms and either format")
    p.add_argument("--a-strategy", "--a_strategy", help="strategy file or folder of side A's rank folders")
    p.add_argument("--b-strategy", "--b_strategy", help="strategy file or folder of side B's rank folders")
    p.add_argument("--atol", type=float, default=0.0, help="count values within this absolute difference as equal")
    p.add_argument("--no-crc-check", action="store_true", help="skip checking .ckpt crc trailers")
    p.add_argument("--max-memory", "--max_memory", type=_parse_memory, default=256 * 1024**2,
                   help="bound on the tensor blocks compared at once (e.g. 256M)")
    p.add_argument("--json", action="store_true")
    _add_crypto_flags(p, write=False)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("rank-list", help="source ranks a destination rank needs")
    p.add_argument("rank", type=int)
    p.add_argument("--src-strategy", "--src_ckpt_strategy", dest="src_strategy", required=True)
    p.add_argument("--dst-strategy", "--dst_ckpt_strategy", dest="dst_strategy")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_rank_list)
    return parser


def one_line(text: str) -> str:
    """Line breaks that came from the user's data (e.g. a parameter name) must not split the line."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _run(args: argparse.Namespace) -> object:
    try:
        return args.func(args)
    finally:
        for bar in _BARS:
            bar.stop()


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP (schedulers, ``timeout``, a closed terminal), raised like Ctrl-C so that the
    same clean-up runs: temporary files removed, finished outputs journaled for ``--resume``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, _frame: object) -> None:
    for other in _STOP_SIGNALS:  # a second TERM/HUP while cleaning up must not cut the clean-up short
        signal.signal(other, signal.SIG_IGN)
    raise Signalled(signum)


_STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP behave like Ctrl-C (only possible from the main thread; elsewhere a no-op)."""
    for signum in _STOP_SIGNALS:
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
                signal.signal(signum, _raise_signalled)
        except ValueError:
            return


def interrupted(exc: KeyboardInterrupt) -> int:
    """The one line an interrupted command prints, and its exit code (128 + signal, as Unix tools)."""
    from reshard.manifest import PROGRESS_ATTRIBUTE

    signum = exc.signum if isinstance(exc, Signalled) else signal.SIGINT
    progress = getattr(exc, PROGRESS_ATTRIBUTE, None)
    if progress is None:
        detail = "no output file was written"
    elif progress.resumable:
        detail = (f"{progress.completed} of {progress.total} files completed; run the same command with --resume "
                  "to continue")
    else:
        detail = (f"{progress.completed} of {progress.total} files completed; without a manifest (--no-manifest) "
                  "--resume cannot tell them apart: run the command again")
    print(f"reshard: interrupted ({signal.Signals(signum).name}): {detail}", file=sys.stderr)
    return 128 + int(signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    install_signal_handlers()
    try:
        status = _run(args)
    except ReshardError as exc:
        print(f"reshard: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return interrupted(exc)
    except Exception as exc:  # a bug: still one line, unless debugging
        if os.environ.get("RESHARD_DEBUG"):
            raise
        print(f"reshard: internal error: {type(exc).__name__}: {one_line(str(exc))} "
              "(RESHARD_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_BUG
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
