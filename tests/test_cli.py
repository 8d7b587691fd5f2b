"""End-to-end tests of the ``reshard`` command: real processes, real files, exit codes, stderr."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from reshard import api
from reshard.synthetic import full_model
from tests.trust_helpers import SMALL as SHAPE
from tests.trust_helpers import make_job
from tests.trust_helpers import run_cli as run


def ranks_in(folder: object) -> list[str]:
    """The rank_<r> folders of an output (the manifest file sits beside them)."""
    return sorted(n for n in os.listdir(folder) if n.startswith("rank_"))


def snapshot(root: str) -> dict[str, tuple[str, int, float]]:
    """sha256, mode and mtime of every file below root: inputs must never change."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            st = os.stat(path)
            with open(path, "rb") as fh:
                out[path] = (hashlib.sha256(fh.read()).hexdigest(), st.st_mode, st.st_mtime)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An 8-rank pipelined checkpoint (dp2 mp2 pp2, opt shards), a 4-rank target strategy, and the
    embedding as .npy."""
    job = make_job(str(tmp_path_factory.mktemp("job")), SHAPE)
    np.save(f"{job['root']}/emb.npy", full_model(SHAPE)["model.tok_embeddings.embedding_weight"])
    return job


def test_transform_with_mindformers_flags(job: dict[str, str], tmp_path) -> None:
    before = snapshot(job["r8"])
    out = tmp_path / "r4"
    proc = run(
        "transform",
        "--src_ckpt_dir",
        job["r8"],
        "--dst_ckpt_dir",
        str(out),
        "--src_ckpt_strategy",
        job["s8"],
        "--dst_ckpt_strategy",
        job["s4"],
        "--prefix",
        "ck_",
    )
    assert proc.returncode == 0, proc.stderr
    assert ranks_in(out) == [f"rank_{r}" for r in range(4)]
    assert os.listdir(out / "rank_3") == ["ck_3.ckpt"]
    assert snapshot(job["r8"]) == before


def test_progress_bar_forced_on_a_pipe(job: dict[str, str], tmp_path) -> None:
    proc = run(
        "transform",
        "--src",
        job["r8"],
        "--dst",
        str(tmp_path / "p"),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        "--progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_transform_hyphenated_flags_strategy_folder_and_full(job: dict[str, str], tmp_path) -> None:
    out = tmp_path / "full"
    proc = run(
        "transform",
        "--src-ckpt-dir",
        job["r8"],
        "--dst-ckpt-dir",
        str(out),
        "--src-ckpt-strategy",
        job["s8dir"],
        "--dst-ckpt-strategy",
        "None",
        "--output-format",
        "safetensors",
    )
    assert proc.returncode == 0, proc.stderr
    with api.open_checkpoint(str(out / "rank_0" / "checkpoint_0.safetensors")) as index:
        emb = index.array("model.tok_embeddings.embedding_weight")
        assert np.array_equal(emb, np.load(f"{job['root']}/emb.npy"))


def test_by_rank_and_rank_list(job: dict[str, str], tmp_path) -> None:
    proc = run("rank-list", "2", "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--json")
    assert proc.returncode == 0, proc.stderr
    needed = json.loads(proc.stdout)
    assert needed == sorted(needed) and needed  # ascending for people; the API keeps MindSpore's order
    out = tmp_path / "one"
    proc = run(
        "transform",
        "--src",
        job["r8"],
        "--dst",
        str(out),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        "--ranks",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert ranks_in(out) == ["rank_2"]


def test_plan_prints_and_writes_nothing(job: dict[str, str], tmp_path) -> None:
    out = tmp_path / "never"
    proc = run(
        "plan",
        "--src",
        job["r8"],
        "--dst",
        str(out),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["outputs"] == 4 and plan["bytes_written"] > 0
    assert not out.exists()
    proc = run("plan", "--src", job["r8"], "--dst", str(out), "--src-strategy", job["s8"], "--dst-strategy", job["s4"])
    assert proc.returncode == 0 and "4 files" in proc.stdout


@pytest.mark.parametrize(
    ("placement", "error"),
    [
        (None, "cannot read the placement file"),
        ("{not json", "not JSON"),
        ('{"node_a": []}', "not a placement"),
        ('{"nodes": {"node_a": ["RANK0"]}}', "no node holds this source file"),  # a partial placement
        ("auto", "takes a placement file"),
    ],
    ids=["missing", "malformed", "misshapen", "partial", "auto"],
)
def test_plan_refuses_a_bad_placement_before_printing(
    job: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str], placement: str | None, error: str
) -> None:
    from reshard import cli

    path = "auto" if placement == "auto" else str(tmp_path / "nodes.json")
    if placement not in (None, "auto"):
        (tmp_path / "nodes.json").write_text(placement.replace("RANK0", os.path.join(job["r8"], "rank_0")))
    args = ["plan", job["r8"], str(tmp_path / "never"), "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    assert cli.main([*args, "--placement", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("reshard: error: ") and error in err
    (tmp_path / "nodes.json").write_text(json.dumps({"nodes": {"node_a": [job["r8"]]}}))  # whole: plan, then bytes
    assert cli.main([*args, "--placement", str(tmp_path / "nodes.json")]) == 0
    out, _ = capsys.readouterr()
    assert "4 files" in out and out.rstrip().splitlines()[-1].startswith("bytes across nodes: 0 ")
    assert not (tmp_path / "never").exists()


def test_inspect_file_folder_strategy(job: dict[str, str]) -> None:
    for target in (job["full"], job["r8"], job["s8"]):
        proc = run("inspect", target, "--json")
        assert proc.returncode == 0, proc.stderr
        json.loads(proc.stdout)
    proc = run("inspect", os.path.join(job["r8"], "rank_0", "checkpoint_0.ckpt"), "--strategy", job["s8"])
    assert proc.returncode == 0 and "global_step" in proc.stdout


def test_convert_round_trip_folder(job: dict[str, str], tmp_path) -> None:
    st, back = tmp_path / "st", tmp_path / "back"
    assert run("convert", job["r8"], str(st), "--to", "safetensors").returncode == 0
    assert run("convert", str(st), str(back), "--to", "ckpt").returncode == 0
    assert ranks_in(back) == [f"rank_{r}" for r in range(8)]


def test_unify_then_split_round_trip(job: dict[str, str], tmp_path) -> None:
    st = tmp_path / "st"
    assert run("convert", job["r8"], str(st), "--to", "safetensors").returncode == 0
    uni, back = tmp_path / "uni", tmp_path / "back"
    proc = run("unify", str(st), str(uni), "--src-strategy", job["s8"])
    assert proc.returncode == 0, proc.stderr
    assert {"part0.safetensors", "param_name_map.json", "hyper_param.safetensors"} <= set(os.listdir(uni))
    proc = run("split", str(uni), str(back), "--dst-strategy", job["s8"], "--output-format", "ckpt")
    assert proc.returncode == 0, proc.stderr
    assert ranks_in(back) == [f"rank_{r}" for r in range(8)]
    with (
        api.open_checkpoint(str(back / "rank_5" / "net.ckpt")) as a,
        api.open_checkpoint(os.path.join(job["r8"], "rank_5", "checkpoint_5.ckpt")) as b,
    ):
        for name in b:
            if name in a and not b.entries[name].is_string:
                assert np.array_equal(a.array(name), b.array(name)), name


def test_demo_runs(tmp_path) -> None:
    proc = run("demo", "--dir", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr
    assert "equal the original" in proc.stdout


BAD_CASES = [
    ("missing source", ["transform", "--src", "/nonexistent/x", "--dst", "{tmp}/o"]),
    ("no strategy for several ranks", ["transform", "--src", "{r8}", "--dst", "{tmp}/o"]),
    (
        "strategy not matching files",
        ["transform", "--src", "{r8}", "--dst", "{tmp}/o", "--src-strategy", "{s4}", "--dst-strategy", "{s8}"],
    ),
    ("garbage strategy", ["transform", "--src", "{r8}", "--dst", "{tmp}/o", "--src-strategy", "{garbage}"]),
    ("garbage checkpoint", ["inspect", "{garbage}"]),
    ("unknown flag", ["transform", "--bogus"]),
    (
        "rank out of range",
        [
            "transform",
            "--src",
            "{r8}",
            "--dst",
            "{tmp}/o",
            "--src-strategy",
            "{s8}",
            "--dst-strategy",
            "{s4}",
            "--ranks",
            "9",
        ],
    ),
    ("dst inside src", ["transform", "--src", "{r8}", "--dst", "{r8}/rank_0/out", "--src-strategy", "{s8}"]),
]


@pytest.mark.parametrize("args", [c[1] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_input_one_line_exit_2_nothing_written(job: dict[str, str], tmp_path, args: list[str]) -> None:
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x0a\xff\xff\xff\x0fnot a checkpoint")
    subst = {"tmp": str(tmp_path), "garbage": str(garbage), **job}
    before = snapshot(job["root"])
    proc = run(*[a.format(**subst) for a in args])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
    assert snapshot(job["root"]) == before


def test_version_in_both_entry_points() -> None:
    from reshard import __version__

    for argv in (["-m", "reshard.cli", "--version"], ["-m", "reshard", "--version"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.strip() == f"reshard {__version__}", proc
