"""The few text rules every part of reshard shares: byte sizes in and out, and one-line messages.

Why a module of its own: sizes are read by the command line (``--max-memory``), by the API
(``max_shard_size``) and printed by several faces, and error messages are flattened to one line
in readers, executors and the command. When each place had its own parser, ``2GB`` meant 2 GiB in
one and 2 * 10**9 in the other. This module imports nothing of reshard but its errors, so any
layer may use it.

**Sizes** (``parse_size``) have one meaning everywhere, the GNU coreutils convention (``dd``,
``sort -S``): ``KB MB GB TB`` are decimal (``5GB`` = 5 * 10**9, as Hugging Face means it);
``KiB MiB GiB TiB`` and the bare suffixes ``K M G T`` are binary (``2G`` = 2 * 2**30); ``B`` or
no suffix is a byte count. Units are case-insensitive, a fractional value is truncated to whole
bytes (``1.5GB``), and zero or a negative size is refused. Sizes are printed in binary units
(``format_size``: ``1.13 GiB``).

**Both faces' spellings.** A message that tells the user to overwrite or resume is raised for the
command and the Python API alike, so it names both: ``OVERWRITE`` and ``RESUME``.
"""

from __future__ import annotations

import re

from reshard.errors import UsageError

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
OVERWRITE = "--overwrite (Destination(overwrite=True) in Python)"
RESUME = "--resume (Destination(resume=True) in Python)"
SIZE_HINT = "e.g. 512M, 2GiB, 5GB or a byte count; KB/MB/GB are decimal, K/M/G and KiB/MiB/GiB binary"
_SIZE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII)
_PRINTED_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_size(text: str | int, what: str = "the size") -> int:
    """Bytes of ``text`` (``5GB``, ``512M``, ``2GiB``, ``1000``) or of a positive int.

    Raises ``UsageError`` (one line naming ``what``) for text that is no size, a fractional
    number of bytes, zero or a negative size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None or match.group(3).lower() not in SIZE_UNITS:
            raise UsageError(f"not a size: {text!r} ({SIZE_HINT})")
        sign, number, unit = match.group(1), match.group(2), SIZE_UNITS[match.group(3).lower()]
        if number.isdigit():
            value = int(number) * unit  # exact for whole numbers
        elif unit == 1:
            raise UsageError(f"not a whole number of bytes: {text!r} ({SIZE_HINT})")
        else:
            value = int(float(number) * unit)  # truncated, as huggingface_hub reads 1.5GB
        value = -value if sign == "-" else value
    if value <= 0:
        raise UsageError(f"{what} must be more than 0, not {text!r}")
    return value


def format_size(n: float) -> str:
    """``512 B``, ``1.50 KiB``, ``1.13 GiB``: binary units, two decimals above bytes."""
    for unit in _PRINTED_UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} {_PRINTED_UNITS[-1]}"


def one_line(text: str) -> str:
    """``text`` with its line breaks escaped: data from the user (a parameter name) must not split
    the one line an error or a note is."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def indefinite(value: object) -> str:
    """``value`` after its indefinite article as it is read aloud: ``an 8``, ``an 11``, ``an 18``, ``an 80``,
    ``an 8192``, ``an [8, 128]``; ``a 4``, ``a 16``, ``a 128``, ``a [4, 4]`` (a message counts ranks,
    dimensions, bytes: "an 8-rank job"). The number read is the first in ``str(value)``.

    Example:
        from reshard.text import indefinite
        assert f"{indefinite(8)}-rank job" == "an 8-rank job"
    """
    text = str(value)
    digits = re.match(r"[\[(]*(\d+)", text)
    if digits is None:
        return f"a {text}"
    number = digits.group(1).lstrip("0") or "0"
    head = number[: len(number) % 3 or 3]  # the leading group of three: 18 of 18 000, 8 of 8 192
    vowel = head.startswith("8") or head in ("11", "18")
    return f"{'an' if vowel else 'a'} {text}"


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an exception's message, white space folded (libraries such as
    Ray and protobuf raise multi-line messages); the exception's class name when it has none."""
    for line in str(exc).splitlines():
        folded = " ".join(line.split())
        if folded:
            return folded
    return type(exc).__name__


__all__ = [
    "OVERWRITE",
    "RESUME",
    "SIZE_HINT",
    "SIZE_UNITS",
    "first_line",
    "format_size",
    "indefinite",
    "one_line",
    "parse_size",
]
