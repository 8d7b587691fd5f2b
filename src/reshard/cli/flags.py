"""The command's flag groups: each class adds its flags to a parser and builds its options object.

One class per concern, so that a flag is spelt, explained and read in one place, whatever command
has it: ``ReadFlags`` → ``ReadOptions`` (which file, which iteration, crc trailers, with
``KeyFlags`` for decryption), ``OutputFlags`` → ``OutputSpec``, ``DestinationFlags`` →
``Destination``, ``WriteFlags`` → ``WriteOptions``, ``RunFlags`` → ``RunOptions``; the names and
dtypes group is ``reshard.cli.tensor_flags``. A class reads back only the flags it added (the
constructor says which), so no command probes the parsed arguments for flags it may not have.

Help comes in sections (``SECTIONS``): every flag lands in the section of its group, every flag
has a help string (``tests/test_cli_help_groups.py``), and spellings kept for compatibility are
accepted but never shown: MindFormers' and MindSpore's underscore spellings silently, renamed
flags with one note on stderr (``reshard: note: --iteration is now --src-iteration``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from reshard.cli import progress
from reshard.cli.values import memory_size, positive_int, source_iteration
from reshard.errors import UsageError
from reshard.execute.digest import ALGORITHMS, DEFAULT_ALGORITHM
from reshard.execute.options import DEFAULT_MAX_MEMORY, RunOptions, WriteOptions, default_workers
from reshard.formats import registry
from reshard.formats.rank_dirs import PICKS
from reshard.ops.options import Destination, OutputSpec
from reshard.text import one_line

if TYPE_CHECKING:
    from reshard.sources.options import ReadOptions

# The help's sections, in this order on every page (argparse leaves out a section with no flag).
SECTIONS = ("input", "output", "layout", "names and dtypes", "run", "keys")
RENAMED = "renamed"  # the namespace attribute holding the notes of renamed spellings used


def section(parser: argparse.ArgumentParser, title: str) -> Any:
    """The argument group ``title`` of ``parser`` (all of ``SECTIONS`` are made on first use, in order)."""
    groups: dict[str, Any] | None = parser.__dict__.get("_reshard_sections")
    if groups is None:
        groups = {name: parser.add_argument_group(name) for name in SECTIONS}
        parser.__dict__["_reshard_sections"] = groups
    return groups[title]


class _Alias(argparse.Action):
    """Another spelling of ``target``, out of the help: a legacy one is silent, a renamed one says so."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, target: argparse.Action, renamed: Sequence[str], **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.target, self.renamed = target, tuple(renamed)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        if option in self.renamed:
            note = f"{option} is now {self.target.option_strings[0]}"
            setattr(namespace, RENAMED, [*getattr(namespace, RENAMED, ()), note])
        self.target(parser, namespace, values, option)


def flag(
    group: Any, *names: str, legacy: Sequence[str] = (), renamed: Sequence[str] = (), **kwargs: Any
) -> argparse.Action:
    """Add the flag ``names`` (the first is the documented spelling) with hidden ``legacy`` and
    ``renamed`` spellings, which store into the same place; ``help`` is required."""
    if not kwargs.get("help"):
        raise ValueError(f"{names[0]}: every flag has a help string")
    action = group.add_argument(*names, **kwargs)
    hidden = [*legacy, *renamed]
    if hidden:
        group.add_argument(
            *hidden,
            action=_Alias,
            target=action,
            renamed=renamed,
            dest=action.dest,
            nargs=action.nargs,
            const=action.const,
            type=action.type,
            choices=action.choices,
            metavar=action.metavar,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    return action


def print_renamed(args: argparse.Namespace, quiet: bool) -> None:
    """The notes of renamed spellings the command line used (nothing with ``--quiet``)."""
    for note in [] if quiet else getattr(args, RENAMED, ()):
        print(f"reshard: note: {note}", file=sys.stderr)


def say_notes(notes: Sequence[str], quiet: bool) -> None:
    """Notes on stderr, one line each (nothing with ``--quiet``)."""
    if quiet:
        return
    for note in notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)


# ------------------------------------------------------------------------------------ keys

_ASSUMED_KEYS: list[str] = []  # "--dec-key-file k.txt read as hex (...)": said again when decryption fails


def assumed_keys() -> list[str]:
    """How this command read key files whose text could be hex or raw (appended to a crypto error)."""
    return _ASSUMED_KEYS


class KeyFlags:
    """``--dec-key-file`` / ``--dec-key-env`` / ``--dec-mode`` (sources) and the ``--enc-...`` ones
    (outputs), and ``--key-format``. Keys never appear on the command line (shell history, ``ps``)."""

    def __init__(self, read: bool = True, write: bool = True) -> None:
        self.read, self.write = read, write

    def add(self, parser: argparse.ArgumentParser) -> None:
        from reshard.formats.crypto import MODES

        g = section(parser, "keys")
        if self.read:
            flag(
                g, "--dec-key-file", legacy=["--dec_key_file"], help="key of encrypted .ckpt sources (raw bytes or hex)"
            )
            flag(
                g,
                "--dec-key-env",
                legacy=["--dec_key_env"],
                metavar="VAR",
                help="environment variable holding it in hex",
            )
            flag(g, "--dec-mode", legacy=["--dec_mode"], choices=MODES, help="cipher of the sources (default AES-GCM)")
        flag(
            g,
            "--key-format",
            choices=("raw", "hex"),
            help="how to read a key file: raw bytes, or hex digits (default: hex when the file holds "
            "exactly 32, 48 or 64 hex digits, raw otherwise; 32 hex characters are also a valid "
            "raw AES-256 key, so name the format for those)"
            if self.read
            else "how to read a key file (default: as for transform: hex when it holds exactly 32, 48 or "
            "64 hex digits, raw otherwise)",
        )
        if self.write:
            flag(g, "--enc-key-file", legacy=["--enc_key_file"], help="encrypt .ckpt outputs with this key file")
            flag(
                g,
                "--enc-key-env",
                legacy=["--enc_key_env"],
                metavar="VAR",
                help="... or the key in this variable (hex)",
            )
            flag(g, "--enc-mode", legacy=["--enc_mode"], choices=MODES, help="cipher of the outputs (default AES-GCM)")

    def key(self, args: argparse.Namespace, side: str) -> bytes | None:
        """The key of ``side`` (``dec``/``enc``) the flags name (None when neither file nor variable is)."""
        from reshard.formats import crypto

        if not (self.read if side == "dec" else self.write):
            return None
        key_file, env = vars(args)[f"{side}_key_file"], vars(args)[f"{side}_key_env"]
        if key_file is None and env is None:
            if vars(args)[f"{side}_mode"]:
                raise UsageError(f"--{side}-mode needs a key: give --{side}-key-file or --{side}-key-env")
            return None
        if key_file is not None and args.key_format is None and crypto.ambiguous_key_file(key_file):
            _ASSUMED_KEYS.append(
                f"--{side}-key-file {key_file} was read as hex (32 hex digits: a 16-byte key); "
                "if it is a 32-byte raw key, pass --key-format raw"
            )
        return crypto.load_key(key_file, env, args.key_format or "auto")

    def mode(self, args: argparse.Namespace, side: str) -> str:
        given = vars(args)[f"{side}_mode"] if (self.read if side == "dec" else self.write) else None
        return given or "AES-GCM"


# ------------------------------------------------------------------------------------ input


class ReadFlags:
    """How sources are read → ``ReadOptions``: which file of a rank folder (``files``), which format
    when both are there (``src_format``), a Checkpoint 2.0's iteration (``iteration``), crc trailers
    (``crc``), and decryption (``keys``, whose flags the command adds once for reading and writing)."""

    def __init__(
        self,
        keys: KeyFlags | None,
        files: bool = True,
        src_format: bool = True,
        iteration: str | None = "",
        crc: bool = True,
        crc_renamed: Sequence[str] = (),
        iteration_renamed: Sequence[str] = ("--iteration",),
    ) -> None:
        """``iteration``: None for no ``--src-iteration``, else what its help adds (" (on either side)")."""
        self.keys, self.files, self.src_format, self.iteration = keys, files, src_format, iteration
        self.crc, self.crc_renamed, self.iteration_renamed = crc, crc_renamed, iteration_renamed

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "input")
        if self.files:
            self._add_file_flags(g)
        if self.iteration is not None:
            flag(
                g,
                "--src-iteration",
                legacy=["--src_iteration"],
                renamed=self.iteration_renamed,
                dest="read_iteration",
                metavar="N",
                type=source_iteration,
                help=f"the iteration of a MindFormers Checkpoint 2.0 to read{self.iteration} (default: the tracker's)",
            )
        if self.crc:
            flag(
                g,
                "--no-check-crc",
                legacy=["--no_check_crc"],
                renamed=self.crc_renamed,
                dest="check_crc",
                action="store_false",
                default=True,
                help="skip verifying the crc trailer of .ckpt sources that have one (checked by default: "
                "one extra read of each)",
            )
            g.add_argument(  # the old opt-in flag: now the default, still accepted
                "--check-crc", "--check_crc", dest="check_crc", action="store_true", help=argparse.SUPPRESS
            )

    def _add_file_flags(self, g: Any) -> None:
        flag(
            g,
            "--file-suffix",
            legacy=["--file_suffix"],
            dest="file_suffix",
            metavar="SUFFIX",
            help="the file of each rank folder whose name ends in SUFFIX, e.g. -1_4 (MindFormers' -{epoch}_{step}) "
            "or 1_4; auto: the newest -{epoch}_{step} every rank folder holds",
        )
        flag(
            g,
            "--pick",
            choices=tuple(PICKS),
            help="when a rank folder holds several checkpoints: the last name "
            "(MindSpore) or the newest file (MindFormers by rank); default: MindSpore's rule, said in a note",
        )
        if self.src_format:
            flag(
                g,
                "--src-format",
                legacy=["--src_format"],
                dest="src_format",
                choices=registry.names(),
                help="read these files when the rank folders hold files of several formats (.ckpt and .safetensors)",
            )

    def options(self, args: argparse.Namespace) -> ReadOptions:
        from reshard.sources.options import ReadOptions

        keys = self.keys
        return ReadOptions(
            dec_key=keys.key(args, "dec") if keys is not None else None,
            dec_mode=keys.mode(args, "dec") if keys is not None else "AES-GCM",
            verify_crc=args.check_crc if self.crc else True,
            file_suffix=args.file_suffix if self.files else None,
            pick=args.pick if self.files else None,
            src_format=args.src_format if self.files and self.src_format else None,
            iteration=args.read_iteration if self.iteration is not None else None,
        )


# ------------------------------------------------------------------------------------ output

HF_HELP = (
    "write the full model as Hugging Face shards + model.safetensors.index.json, model weights only "
    "(optimizer moments, global_step ... are dropped as with --weights-only)"
)


class OutputFlags:
    """What the outputs are → ``OutputSpec``: ``--output-format`` (``formats``; or convert's ``--to``),
    ``--prefix``, ``--hf`` with its shard size, and a Checkpoint 2.0's ``--dst-iteration``,
    ``--common-json``, ``--optimizer-prefix``."""

    def __init__(
        self,
        formats: Sequence[str] = (),
        default: str | None = None,
        format_help: str = "",
        to: bool = False,
        prefix: bool = False,
        hf: bool = True,
        checkpoint2: bool = False,
        dcp_ranks: bool = False,
        iteration: bool = False,
    ) -> None:
        self.formats, self.default, self.format_help, self.to = tuple(formats), default, format_help, to
        self.prefix, self.hf, self.checkpoint2, self.dcp_ranks = prefix, hf, checkpoint2, dcp_ranks
        self.iteration = iteration or checkpoint2  # --dst-iteration alone: torch_dist's run folder

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "output")
        if self.to:
            flag(g, "--to", required=True, choices=self.formats, help=f"the format to write: {', '.join(self.formats)}")
        elif self.formats:
            flag(
                g,
                "--output-format",
                legacy=["--output_format"],
                dest="output_format",
                default=self.default,
                choices=self.formats,
                help=self.format_help,
            )
        if self.prefix:
            flag(
                g,
                "--prefix",
                help="output name prefix (default checkpoint_; with checkpoint2: none, else MindFormers' "
                "<prefix>-model-...)",
            )
        if self.hf:
            self._add_hf_flags(g)
        if self.iteration:
            self._add_iteration_flag(g)
        if self.checkpoint2:
            self._add_checkpoint2_flags(g)
        if self.dcp_ranks:
            from reshard.cli.values import positive_int

            flag(
                g,
                "--dcp-ranks",
                dest="dcp_ranks",
                metavar="N",
                type=positive_int,
                help="with --output-format dcp or torch_dist: N data files, dim 0 of every tensor cut as "
                "torch.chunk does (default: rank folders' own slices, a --dst-strategy's rank boxes, or 1 for a "
                "full model)",
            )

    def _add_hf_flags(self, g: Any) -> None:
        flag(g, "--hf", action="store_true", help=HF_HELP)
        flag(
            g,
            "--keep-training-state",
            legacy=["--keep_training_state"],
            dest="keep_training_state",
            action="store_true",
            help="with --hf: keep optimizer moments, global_step ... in the shards too (transformers ignores them)",
        )
        flag(
            g,
            "--max-shard-size",
            legacy=["--max_shard_size"],
            dest="max_shard_size",
            metavar="SIZE",
            help="with --hf: largest shard, e.g. 5GB (the default), 500MB, 2GiB or bytes (KB/MB/GB are "
            "decimal as on the Hub, K/M/G and KiB/MiB/GiB binary)",
        )

    def _add_iteration_flag(self, g: Any) -> None:
        from reshard.cli.values import output_iteration

        cp2 = (
            "with --output-format checkpoint2: the iteration number, iteration_<N 8 digits>/ (default: a "
            "Checkpoint 2.0 source's own, else 0); "
            if self.checkpoint2
            else ""
        )
        torch_dist = "--to torch_dist" if self.to else "--output-format torch_dist"
        flag(
            g,
            "--dst-iteration",
            legacy=["--dst_iteration"],
            renamed=["--iteration"] if self.checkpoint2 else [],
            dest="iteration",
            metavar="N",
            type=output_iteration,
            help=f"{cp2}with {torch_dist}: a Megatron-LM run folder, iter_<N 7 digits>/ and "
            "latest_checkpointed_iteration.txt",
        )

    def _add_checkpoint2_flags(self, g: Any) -> None:
        flag(
            g,
            "--common-json",
            legacy=["--common_json"],
            dest="common_json",
            metavar="FILE",
            help="with --output-format checkpoint2: a JSON object of common.json's values (epoch_num, step_num, "
            "global_step, loss_scale, global_batch_size, consumed_samples, ckpt_status; the rest null)",
        )
        flag(
            g,
            "--optimizer-prefix",
            legacy=["--optimizer_prefix"],
            dest="optimizer_prefixes",
            action="append",
            metavar="PREFIX",
            help="with --output-format checkpoint2: names starting with PREFIX go to the opt- files too "
            "(repeatable; adam_m., adam_v., accu_grads., global_step, learning_rate ... always do)",
        )

    def hf_asked(self, args: argparse.Namespace) -> bool:
        return bool(args.hf) if self.hf else False

    def keep_training_state(self, args: argparse.Namespace) -> bool:
        return bool(args.keep_training_state) if self.hf else False

    def chosen_format(self, args: argparse.Namespace) -> str | None:
        if self.to:
            return str(args.to)
        return args.output_format if self.formats else None

    def options(self, args: argparse.Namespace) -> OutputSpec:
        """``--hf`` is the format ``hf`` (safetensors laid out as a Hugging Face folder)."""
        fmt = self.chosen_format(args)
        if self.hf_asked(args):
            if fmt == "checkpoint2":
                raise UsageError(
                    "a Checkpoint 2.0 is not a Hugging Face model: give --hf or --output-format checkpoint2"
                )
            if fmt == "ckpt" and not self.to:  # convert's --to ckpt --hf is refused by the operation
                raise UsageError(
                    "Hugging Face output is a full safetensors model: give no destination strategy and no ckpt "
                    "output format"
                )
            fmt = "hf"
        spec = OutputSpec(format=fmt, max_shard_size=args.max_shard_size if self.hf else None)
        if self.prefix:
            spec = _replace(spec, prefix=args.prefix)
        if self.dcp_ranks:
            spec = _replace(spec, dcp_ranks=args.dcp_ranks)
        if self.iteration and not self.checkpoint2:
            spec = _replace(spec, iteration=args.iteration)
        if self.checkpoint2:
            common = _load_common(args.common_json) if args.common_json else None
            spec = _replace(
                spec, iteration=args.iteration, common=common, optimizer_prefixes=tuple(args.optimizer_prefixes or ())
            )
        return spec


def _replace(spec: OutputSpec, **changes: Any) -> OutputSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


def _load_common(path: str) -> dict[str, object]:
    """A JSON object of common.json values (a MindFormers common.json itself will do)."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--common-json: cannot read JSON: {exc}", path) from None
    if not isinstance(data, dict):
        raise UsageError('--common-json: expected a JSON object such as {"global_step": 100}', path)
    from reshard.formats.checkpoint2 import check_common

    check_common(data, path)  # its refusals name this file
    return data


class DestinationFlags:
    """How a run treats its destination → ``Destination``: ``--overwrite`` (its help says what it
    replaces), and for commands that run (``run``) ``--dry-run``, ``--resume``, ``--no-manifest``."""

    def __init__(self, overwrite_help: str, run: bool = True) -> None:
        self.overwrite_help, self.run = overwrite_help, run

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "output")
        flag(g, "--overwrite", action="store_true", help=self.overwrite_help)
        if not self.run:
            return
        flag(g, "--dry-run", legacy=["--dry_run"], action="store_true", help="print the plan, write nothing")
        flag(
            g,
            "--resume",
            action="store_true",
            help="continue an interrupted run: keep its verified files, redo the rest",
        )
        flag(
            g,
            "--no-manifest",
            action="store_true",
            help="skip reshard-manifest.json and the journal (saves hashing the outputs; no --resume)",
        )

    def options(self, args: argparse.Namespace, dry_run: bool = False) -> Destination:
        if not self.run:
            return Destination(overwrite=args.overwrite, dry_run=dry_run)
        return Destination(
            overwrite=args.overwrite, resume=args.resume, dry_run=dry_run or args.dry_run, manifest=not args.no_manifest
        )


class WriteFlags:
    """What outputs' bytes hold → ``WriteOptions``: ``--checksum`` of the manifest, and with ``keys``
    the crc trailer (``--crc``) and encryption."""

    def __init__(self, keys: KeyFlags | None) -> None:
        self.keys = keys

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "output")
        if self.keys is not None:
            flag(g, "--crc", action="store_true", help="append a crc trailer to .ckpt outputs (MindSpore crc_check)")
        flag(
            g,
            "--checksum",
            choices=ALGORITHMS,
            default=DEFAULT_ALGORITHM,
            help="checksum of each output in the manifest: xxh128 (default, xxhsum -H2; 6x faster than blake3 "
            "here), blake3 (b3sum) or sha256 (sha256sum)",
        )

    def options(self, args: argparse.Namespace) -> WriteOptions:
        keys = self.keys
        return WriteOptions(
            write_crc=args.crc if keys is not None else False,
            enc_key=keys.key(args, "enc") if keys is not None else None,
            enc_mode=keys.mode(args, "enc") if keys is not None else "AES-GCM",
            checksum=args.checksum,
        )


# ------------------------------------------------------------------------------------ run

PLACEMENT_HELP = (
    "a JSON file saying which node holds which files, or auto (ask every node); "
    "outputs are written on the node holding most of their input, only needed byte ranges cross nodes"
)


def add_quiet(parser: argparse.ArgumentParser, help: str = "no notes and no progress on stderr (errors still print)"):
    flag(section(parser, "run"), "-q", "--quiet", action="store_true", help=help)


def add_progress(parser: argparse.ArgumentParser, what: str = "progress") -> None:
    flag(
        section(parser, "run"),
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{what} on stderr: a bar on a terminal, a plain line every 5 s in a log or pipe "
        "(default: the bar, on a terminal only)",
    )


def add_placement(parser: argparse.ArgumentParser, lead: str) -> None:
    flag(section(parser, "run"), "--placement", metavar="FILE|auto", help=lead + PLACEMENT_HELP)


class RunFlags:
    """How a run executes → ``RunOptions`` (``RayOptions`` with ``--executor ray``): threads, the
    staging bound, progress, ``--quiet`` and the Ray executor's flags."""

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "run")
        flag(
            g,
            "--workers",
            type=positive_int,
            default=default_workers(),
            help="worker threads: parallel output files, or tensors of a one-file output "
            "(default: one per core, at least 4, at most 8; --dequantize/--quantize use at most one per core)",
        )
        flag(
            g,
            "--max-memory",
            legacy=["--max_memory"],
            type=memory_size,
            default=DEFAULT_MAX_MEMORY,
            help="bound on staging bytes in flight, e.g. 512M or 2G (K/M/G and KiB/MiB/GiB are binary, "
            "KB/MB/GB decimal: 2GB = 2*10^9)",
        )
        add_progress(parser)
        add_quiet(parser)
        flag(
            g,
            "--executor",
            choices=("local", "ray"),
            default="local",
            help="run output files on this machine's threads or as Ray tasks (pip install reshard[ray])",
        )
        flag(
            g,
            "--ray-address",
            help="with --executor ray: the cluster to join, HOST:PORT (default: RAY_ADDRESS or a new local cluster)",
        )
        flag(
            g,
            "--shared-disk",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="with --executor ray: nodes see the same paths (else sources/outputs travel through Ray)",
        )
        add_placement(parser, "with --executor ray: sources are on the nodes' own disks; ")

    def options(self, args: argparse.Namespace, dry_run: bool) -> RunOptions:
        """The run options; progress is off for a dry run and with ``--quiet``."""
        hooks = progress.hooks(args.progress, args.quiet or dry_run)
        if args.executor == "ray":  # Ray imported only when the run starts
            from reshard.execute.options import RayOptions

            on_nodes: Callable[[Any], None] | None = None if args.quiet else _print_nodes
            return RayOptions(
                workers=args.workers,
                max_memory=args.max_memory,
                address=args.ray_address,
                shared_disk=args.shared_disk,
                placement=args.placement,
                on_nodes=on_nodes,
                **hooks,
            )
        if args.placement is not None:
            raise UsageError("--placement applies to --executor ray only")
        if args.ray_address is not None or args.shared_disk is False:
            given = "--ray-address" if args.ray_address is not None else "--no-shared-disk"
            raise UsageError(f"{given} applies to --executor ray only")
        return RunOptions(workers=args.workers, max_memory=args.max_memory, **hooks)


def _print_nodes(done: Any) -> None:
    """``--placement``: the bytes that will cross nodes, said once before any byte moves."""
    if not done.received:
        print(f"reshard: note: {done.schedule.summary(done.names)}", file=sys.stderr)


JSON_HELP = (  # every writing command's --json: one JSON record of its result on stdout, nothing else there
    "print one JSON record on stdout: the plan with --dry-run, else what the run wrote "
    "(destination, files with their bytes, files a --resume kept, notes, the name report)"
)


def add_json(parser: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    flag(section(parser, "output"), "--json", action="store_true", help=help)


__all__ = [
    "JSON_HELP",
    "RENAMED",
    "SECTIONS",
    "DestinationFlags",
    "KeyFlags",
    "OutputFlags",
    "ReadFlags",
    "RunFlags",
    "WriteFlags",
    "add_json",
    "add_placement",
    "add_progress",
    "add_quiet",
    "assumed_keys",
    "flag",
    "print_renamed",
    "say_notes",
    "section",
]
