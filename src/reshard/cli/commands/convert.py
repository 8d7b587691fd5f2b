"""``reshard convert SRC [DST] --to FORMAT``: .ckpt <-> .safetensors file by file, or re-encrypt .ckpt.

Without DST the output goes into a new folder beside the source, never inside it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from reshard.cli import calls
from reshard.cli.flags import (
    DestinationFlags,
    KeyFlags,
    OutputFlags,
    ReadFlags,
    RunFlags,
    WriteFlags,
    add_json,
    flag,
    section,
)
from reshard.cli.report import Printing, finish
from reshard.cli.tensor_flags import TensorFlags, input_paths
from reshard.errors import UsageError
from reshard.ops.options import format_choices

NAME = "convert"
KEYS = KeyFlags()
READ = ReadFlags(KEYS, src_format=False, iteration=None)
OUTPUT = OutputFlags(formats=format_choices(NAME), to=True, iteration=True)
DESTINATION = DestinationFlags("replace existing outputs")
WRITE = WriteFlags(KEYS)
RUN = RunFlags()
TENSORS = TensorFlags()


def add(sub: Any) -> None:
    p = sub.add_parser(
        NAME, help="convert .ckpt <-> .safetensors, or re-encrypt / decrypt .ckpt (a file or rank* folders)"
    )
    p.add_argument("src", help="a checkpoint file, or a folder of rank* folders")
    p.add_argument(
        "dst",
        nargs="?",
        help="output folder (default: a new folder beside the source, SRC_safetensors / SRC_ckpt / SRC_hf; "
        "never the source's own folders)",
    )
    OUTPUT.add(p)
    flag(
        section(p, "input"),
        "--file-regex",
        legacy=["--file_name_regex"],
        dest="file_regex",
        help="only files matching this regex",
    )
    flag(section(p, "names and dtypes"), "--name-map", legacy=["--name_map"], help="JSON file: old name -> new name")
    add_json(p)
    READ.add(p)
    DESTINATION.add(p)
    WRITE.add(p)
    RUN.add(p)
    KEYS.add(p)
    TENSORS.add(p)
    p.set_defaults(func=run, reads=("src",))  # read ahead while starting (reshard.readahead)


def load_name_map(path: str) -> dict[str, str]:
    """``--name-map``: a JSON object of old name -> new name."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read JSON: {exc}", path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UsageError("expected a JSON object of old name -> new name", path)
    return data


def default_destination(src: str, to: str, hf: bool) -> str:
    """Where ``convert SRC`` without DST writes: a new folder beside the source, never inside it
    (``ckpt_8ranks`` -> ``ckpt_8ranks_safetensors``, ``full/model.ckpt`` -> ``full/model_safetensors``)."""
    path = src.rstrip(os.sep) or os.sep
    if os.path.basename(path) in ("", ".", ".."):  # "." has no name to put a suffix on
        path = os.path.abspath(path)
    stem = path if os.path.isdir(path) else os.path.splitext(path)[0]
    return f"{stem}_{'hf' if hf else to}"


def run(args: argparse.Namespace) -> None:
    name_map = load_name_map(args.name_map) if args.name_map else None
    hf = OUTPUT.hf_asked(args)
    dst, beside = args.dst, None
    if dst is None:
        dst = default_destination(args.src, args.to, hf)
        beside = f"no destination given: wrote into {dst}, a new folder beside the source"
    read, write = READ.options(args), WRITE.options(args)
    destination = DESTINATION.options(args)
    run_options = RUN.options(args, destination.dry_run)
    tensors = TENSORS.build(args, input_paths(args.src), args.overwrite, hf, OUTPUT.keep_training_state(args))
    report = calls.convert(
        args.src,
        dst,
        args.to,
        name_map=name_map,
        file_regex=args.file_regex,
        output=OUTPUT.options(args),
        destination=destination,
        tensors=tensors.options,
        read=read,
        write=write,
        run=run_options,
    )
    if beside is not None and not destination.dry_run:
        report.notes.insert(0, beside)
    finish(report, Printing(args.quiet, args.json, destination.dry_run, hf, tensors, args.started), dst)


__all__ = ["add", "default_destination", "load_name_map", "run"]
