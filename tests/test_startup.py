"""Start-up does only what the run needs (issue 19): which modules a process loads, not how long it takes.

A dependency's release once added a second to every reshard process (``ml_dtypes`` 0.7.0 takes about
1 s to import, and ``reshard --version`` imported it through the whole API). These tests run each
case in a fresh interpreter and read its ``sys.modules`` at exit, so they hold whatever the installed
versions and however loaded the machine: ``--version`` and every ``--help`` load no numpy; importing
the CLI or the drop-in loads no optional dependency; moving fp32 or bf16 bytes (transform, convert,
unify) loads no ``ml_dtypes``, and only a cast does. The timings themselves are the bench's
(``bench/run.py --startup``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard import dtypes

# Loaded only when a run needs them: bf16/fp8 numbers, encryption, human output, rules files, PNG
# pictures, the cluster executor, checksums.
OPTIONAL = ("ml_dtypes", "cryptography", "rich", "yaml", "matplotlib", "ray", "xxhash", "blake3")
# and the executor's parts a run loads only when it needs them: the cluster, the (de)quantizer
WATCHED = ("numpy", *OPTIONAL, "reshard.execute.ray", "reshard.execute.ray_nodes", "reshard.execute.dequant")

# Runs the ``reshard`` command (or imports a module) in this interpreter and prints, at exit, which
# of the watched packages it loaded. ``atexit`` sees --help/--version, which end in SystemExit.
_PROBE = """
import atexit, json, sys
watched = {watched!r}
def _report():
    print("LOADED=" + json.dumps([m for m in watched if m in sys.modules]), file=sys.__stderr__)
atexit.register(_report)
mode, rest = sys.argv[1], sys.argv[2:]
if mode == "import":
    __import__(rest[0])
else:
    from reshard import cli
    sys.exit(cli.main(rest))
"""


def loaded(*argv: str, cwd: str | None = None, exit_code: int = 0, watched: tuple[str, ...] = WATCHED) -> list[str]:
    """The ``watched`` modules a fresh process loaded for ``argv`` (``import MODULE`` or ``cli ARGS...``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS",)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(watched=watched), *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("LOADED=")]
    assert proc.returncode == exit_code and lines, f"{argv}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return list(json.loads(lines[-1].removeprefix("LOADED=")))


def test_import_cli_loads_nothing_heavy() -> None:
    assert loaded("import", "reshard.cli") == []


def test_import_dropin_loads_no_optional_dependency() -> None:
    assert loaded("import", "reshard.mindspore") == []  # each name's module is imported on its first use
    assert loaded("import", "reshard.mindspore.parallel") == ["numpy"]


def test_import_dropin_loads_neither_numpy_nor_the_api() -> None:
    """``import reshard.mindspore`` (or ``from reshard import mindspore as ms``) loads none of its
    modules; ``ms.save_checkpoint`` loads numpy and the readers but not the operations, and the
    conversions load ``reshard.api`` / ``reshard.ops`` only inside the functions that run one."""
    probe = (
        "import sys\n"
        "from reshard import mindspore as ms\n"
        "heavy = ('numpy', 'reshard.api', 'reshard.ops.transform', 'reshard.mindspore.dropin')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "ms.save_checkpoint\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "ms.transform_checkpoints\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.splitlines() == [
        "[]",
        "['numpy']",
        "['numpy', 'reshard.mindspore.dropin']",
    ]


DROPIN_AT_LOOKUP = (
    "reshard",
    "reshard.errors",
    "reshard.mindspore",
    "reshard.mindspore.arguments",
    "reshard.mindspore.dropin",
    "reshard.readahead",
)


@pytest.mark.parametrize(
    "name", ["transform_checkpoints", "unified_safetensors", "load_distributed_checkpoint", "ckpt_to_safetensors"]
)
def test_the_dropin_whole_model_functions_load_no_numpy(name: str) -> None:
    """Looking up a whole-model function loads its module and the argument checks only: no numpy
    (``load_checkpoint`` does; a transform loads it on a worker thread with its first strided tensor,
    as the command), no planner, no reader, so a call starts reading its source before those load."""
    probe = (
        "import sys\nfrom reshard import mindspore as ms\n"
        f"ms.{name}\nprint(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('reshard')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    # nothing but the argument checks and the read-ahead: the call starts reading, then loads the planners
    assert out.stdout.strip() == str(sorted(DROPIN_AT_LOOKUP))


def test_dropin_modules_import_the_api_only_inside_functions() -> None:
    """Structural: no module of ``reshard.mindspore`` imports ``reshard.api`` or ``reshard.ops``'
    operations at module level (the run path is loaded by the function that runs one)."""
    import ast

    package = Path(__file__).resolve().parents[1] / "src" / "reshard" / "mindspore"
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only (an `if TYPE_CHECKING:` block is not run)
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                assert name != "reshard.api" and not name.startswith(("reshard.api.", "reshard.ops.run")), (
                    path.name,
                    name,
                )
                assert name not in ("reshard.ops.transform", "reshard.ops.unify", "reshard.ops.convert"), (
                    path.name,
                    name,
                )


def test_import_api_loads_no_optional_dependency() -> None:
    assert loaded("import", "reshard.api") == []  # numpy loads with the first array a run makes


def test_the_read_ahead_starts_before_typing_argparse_and_re() -> None:
    """Structural: what loads before the read-ahead starts (``reshard.entry``, ``reshard.cli``'s module)
    is the standard library's least: no ``typing``, ``argparse``, ``gettext`` or ``re`` (4-8 ms warm
    before the disk gets its first request), unless the interpreter had them already."""
    probe = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import reshard.entry, reshard.cli\n"
        "print(sorted({'typing', 'argparse', 'gettext', 're'} & (set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_version_loads_no_numpy() -> None:
    assert loaded("cli", "--version") == []


def test_every_help_loads_no_numpy() -> None:
    from reshard import cli

    commands = sorted(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert "transform" in commands
    assert loaded("cli", "--help") == []
    assert loaded("cli", exit_code=2) == []  # the overview (a usage error: no command)
    for command in commands:
        assert loaded("cli", command, "--help") == [], command


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's files, plus its 8-rank checkpoint cast to bf16 (weights bf16, optimizer states fp32)."""
    root = tmp_path_factory.mktemp("startup")
    subprocess.run(
        [sys.executable, "-m", "reshard.cli", "demo", "--dir", str(root / "demo")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    demo = root / "demo"
    assert loaded(
        "cli",
        "transform",
        "--src",
        "ckpt_8ranks",
        "--dst",
        str(root / "bf16_8"),
        "--src-strategy",
        "merged/src_strategy.ckpt",
        "--dst-strategy",
        "merged/src_strategy.ckpt",
        "--dtype",
        "bf16",
        "-q",
        cwd=str(demo),
    ) == ["numpy", "ml_dtypes", "xxhash"]  # a cast needs bf16's numbers: the one case that loads ml_dtypes
    return root


def _transform(demo: Path, src: str, dst: Path) -> list[str]:
    return loaded(
        "cli",
        "transform",
        "--src",
        src,
        "--dst",
        str(dst),
        "--src-strategy",
        "merged/src_strategy.ckpt",
        "--dst-strategy",
        "merged/dst_strategy.ckpt",
        "-q",
        cwd=str(demo / "demo"),
    )


def test_fp32_transform_loads_only_numpy_and_its_checksum(demo: Path) -> None:
    assert _transform(demo, "ckpt_8ranks", demo / "fp32_4") == ["numpy", "xxhash"]


def test_bf16_byte_moves_load_no_ml_dtypes(demo: Path) -> None:
    bf16 = str(demo / "bf16_8")
    assert _transform(demo, bf16, demo / "bf16_4") == ["numpy", "xxhash"]
    convert = ["cli", "convert", bf16, str(demo / "bf16_st"), "--to", "safetensors", "-q"]
    assert loaded(*convert) == ["xxhash"]  # every tensor copied whole, kernel-side: not even numpy
    unify = [
        "cli",
        "unify",
        str(demo / "bf16_st"),
        str(demo / "bf16_full"),
        "--src-strategy",
        "merged/src_strategy.ckpt",
    ]
    assert loaded(*unify, cwd=str(demo / "demo")) == ["numpy", "xxhash"]
    # and the bytes are right: verify compares numbers, so it may load ml_dtypes
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard.cli",
            "verify",
            bf16,
            str(demo / "bf16_4"),
            "--a_strategy",
            "merged/src_strategy.ckpt",
            "--b_strategy",
            "merged/dst_strategy.ckpt",
        ],
        cwd=str(demo / "demo"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SAME" in check.stdout


def test_dtype_table_rows_match_the_real_types() -> None:
    """Each row's numpy name and item size (stated so byte moves need no ml_dtypes) are the real type's."""
    for d in dtypes.ALL:
        assert d.numpy.itemsize == d.itemsize, d
        assert d.carrier.itemsize == d.itemsize, d
        assert d is dtypes.STR or (d.carrier.kind in "biufc" and d.carrier.isbuiltin), d
        if d not in (dtypes.INT4, dtypes.STR):
            assert d.numpy.name == d.numpy_name, d
            assert dtypes.from_numpy(d.numpy) is d, d
            assert dtypes.from_numpy(d.numpy.newbyteorder(">")) is d or d.itemsize == 1, d
    assert dtypes.BFLOAT16.carrier == np.uint16 and dtypes.FLOAT32.carrier == np.float32


def test_byte_view_of_bf16_is_its_bits(tmp_path: Path) -> None:
    """``TensorIndex.items`` hands out bf16 as uint16 holding the same bits ``array`` gives as numbers."""
    import ml_dtypes

    from reshard.formats import safetensors

    values = np.array([[1.5, -2.0], [3.25, 65280.0]], dtype=ml_dtypes.bfloat16)
    path = str(tmp_path / "m.safetensors")
    safetensors.save_safetensors(path, {"w": values})
    index = safetensors.read_safetensors(path)
    try:
        assert index.items("w").dtype == np.uint16
        assert np.array_equal(index.items("w"), values.view(np.uint16))
        assert np.array_equal(index.array("w"), values)
    finally:
        index.close()


# What a merge of plain tensors needs none of: the tensor-surgery vocabulary (no filter, map or preset),
# OpenSSL (the manifest's XXH128 and the replica check's samples), the modules of a lock's host name and
# time stamp, and of an encrypted file's temporary copy. Each cost 1-4 ms of every run's start.
SPARED = (
    "reshard.naming.ops",
    "reshard.naming.presets",
    "reshard.naming.megatron",
    "reshard.naming.shapes",
    "hashlib",
    "hmac",
    "secrets",
    "socket",
    "datetime",
    "tempfile",
    "pathlib",
)


def test_a_merge_loads_no_surgery_and_no_openssl(demo: Path) -> None:
    """Structural: the CLI's merge to one file loads none of ``SPARED`` that numpy alone does not (the
    demo's merge assembles one tensor with numpy, which loads ``datetime``; a site hook of the
    machine's may load ``pathlib`` or ``tempfile`` before any reshard code runs)."""
    before = set(loaded("import", "numpy", watched=SPARED))
    merge = ["transform", "--src", "ckpt_8ranks", "--dst", str(demo / "spared_full")]
    merge += ["--src-strategy", "merged/src_strategy.ckpt", "-q"]
    assert set(loaded("cli", *merge, cwd=str(demo / "demo"), watched=SPARED)) <= before


def test_a_run_of_byte_copies_loads_no_numpy(demo: Path) -> None:
    """Structural (issue 19): numpy loads with the first tensor the executor assembles (a column split,
    a cast); a convert, whose tensors are all copied whole, never imports it. The demo's 8 -> 4
    transform assembles its embedding (laid out differently in each stage), so it does."""
    convert = ["cli", "convert", str(demo / "demo" / "ckpt_8ranks"), str(demo / "bytes_st"), "--to", "safetensors"]
    assert loaded(*convert, "-q") == ["xxhash"]
    assert loaded(*convert[:-3], str(demo / "bytes_nomanifest"), "--to", "safetensors", "--no-manifest", "-q") == []


def test_a_convert_loads_no_strategy_reader_and_no_dcp_planner(demo: Path) -> None:
    """Structural (issue 19): a ``.ckpt`` -> safetensors convert reads no strategy file and writes no DCP
    folder, so protobuf, the DCP readers and the DCP planner stay unloaded (``reshard.lazy``)."""
    probe = (
        "import sys\n"
        "from reshard import cli\n"
        "code = cli.main(sys.argv[1:])\n"
        "heavy = ('google.protobuf', 'reshard.formats.dcp.metadata', 'reshard.ops.chunked')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "sys.exit(code)\n"
    )
    argv = ["convert", str(demo / "demo" / "ckpt_8ranks"), str(demo / "lazy_st"), "--to", "safetensors", "-q"]
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"
