"""What the README promises must work, on the demo's own files (issue 9), through the CLI.

The node-without-a-shared-disk recipe (``rank-list R`` then ``transform --ranks R`` with only the
ranks it names), ``inspect`` on everything the other commands read, strategy folders holding a
merged file, encrypting or decrypting in one ``convert`` step, and a full checkpoint (a file, a
folder holding one, a one-rank folder) being one full model for transform, verify and inspect.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.trust_helpers import run_cli as run
from tests.trust_helpers import snapshot

EMBEDDING = "model.tok_embeddings.embedding_weight"  # shared by both stages, a different layout in each


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("demo"))
    proc = run("demo", "--dir", root)
    assert proc.returncode == 0, proc.stderr
    return {
        "root": root,
        "full": f"{root}/full/model.ckpt",
        "full_dir": f"{root}/full",
        "r8": f"{root}/ckpt_8ranks",
        "st8": f"{root}/st_8ranks",
        "r4": f"{root}/ckpt_4ranks",
        "full_back": f"{root}/full_back",
        "s8": f"{root}/merged/src_strategy.ckpt",
        "s4": f"{root}/merged/dst_strategy.ckpt",
        "s8_dir": f"{root}/strategy_8",
        "s4_dir": f"{root}/strategy_4",
    }


@pytest.fixture(scope="module")
def full_run(demo: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 8 -> 4 transform of every rank, the reference for single-rank runs."""
    out = str(tmp_path_factory.mktemp("full_run") / "out")
    proc = run(
        "transform", "--src", demo["r8"], "--dst", out, "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"]
    )
    assert proc.returncode == 0, proc.stderr
    return out


def one_error(proc) -> str:  # type: ignore[no-untyped-def]
    """The single ``reshard: error:`` line of a failed run (exit code 2, no traceback)."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    return lines[0]


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank}", f"checkpoint_{rank}.ckpt")


def same_tensors(a: str, b: str, *flags: str) -> bool:
    proc = run("verify", a, b, "--json", *flags)
    assert proc.returncode in (0, 1), proc.stderr
    return bool(json.loads(proc.stdout)["ok"])


# ------------------------------------------------------------------------- node without a shared disk


def needed(demo: dict[str, str], rank: int) -> list[int]:
    proc = run("rank-list", str(rank), "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"], "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_node_copies_only_the_ranks_it_needs(demo: dict[str, str], full_run: str, tmp_path: Path, rank: int) -> None:
    node_src = tmp_path / "src"
    for r in needed(demo, rank):
        shutil.copytree(os.path.join(demo["r8"], f"rank_{r}"), node_src / f"rank_{r}")
    out = tmp_path / "out"
    proc = run(
        "transform",
        "--src",
        str(node_src),
        "--dst",
        str(out),
        "--src-strategy",
        demo["s8"],
        "--dst-strategy",
        demo["s4"],
        "--ranks",
        str(rank),
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == [f"rank_{rank}", "reshard-manifest.json"]
    assert Path(rank_file(str(out), rank)).read_bytes() == Path(rank_file(full_run, rank)).read_bytes()


def test_node_missing_a_needed_rank_names_it(demo: dict[str, str], tmp_path: Path) -> None:
    node_src = tmp_path / "src"
    ranks = needed(demo, 1)
    assert len(ranks) < 8  # the recipe's point: a partial copy
    for r in ranks:
        shutil.copytree(os.path.join(demo["r8"], f"rank_{r}"), node_src / f"rank_{r}")
    gone = ranks[1]
    shutil.rmtree(node_src / f"rank_{gone}")
    out = tmp_path / "out"
    args = ["--src", str(node_src), "--dst", str(out), "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"]]
    line = one_error(run("transform", *args, "--ranks", "1"))
    assert f"rank {gone} is needed by destination rank 1 but {node_src}/rank_{gone} is missing" in line, line
    assert not out.exists()
    line = one_error(run("transform", *args))  # without --ranks every rank must be there
    assert "no folder for rank(s)" in line and "describes 8 ranks" in line, line
    line = one_error(run("transform", *args, "--ranks", "0"))  # needs the stage's other ranks
    assert "is needed by destination rank 0" in line and "also missing" in line, line
    assert not out.exists()


def test_ranks_still_refuses_folders_the_strategy_does_not_describe(demo: dict[str, str], tmp_path: Path) -> None:
    node_src = tmp_path / "src"
    for r in needed(demo, 1):
        shutil.copytree(os.path.join(demo["r8"], f"rank_{r}"), node_src / f"rank_{r}")
    shutil.copytree(os.path.join(demo["r8"], "rank_1"), node_src / "rank_9")
    line = one_error(
        run(
            "transform",
            "--src",
            str(node_src),
            "--dst",
            str(tmp_path / "out"),
            "--src-strategy",
            demo["s8"],
            "--dst-strategy",
            demo["s4"],
            "--ranks",
            "1",
        )
    )
    assert "describes 8 rank(s)" in line and "rank folder(s) 9" in line, line


# ------------------------------------------------------------------------- inspect


def inspect_json(*args: str) -> dict:
    proc = run("inspect", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def embedding_row(rows: list[dict]) -> dict:
    return next(r for r in rows if r["name"] == EMBEDDING)


def full_shape(demo: dict[str, str], name: str = EMBEDDING) -> list[int]:
    return embedding_row(inspect_json(demo["full"])["tensors"])["shape"] if name == EMBEDDING else []


def test_inspect_rank_folders_use_each_ranks_stage(demo: dict[str, str]) -> None:
    want = full_shape(demo)
    info = inspect_json(demo["r8"], "--strategy", demo["s8"])
    rows = {int(r): embedding_row(part["tensors"]) for r, part in info["ranks"].items()}
    assert all(row["full_shape"] == want for row in rows.values()), {r: row["full_shape"] for r, row in rows.items()}
    assert rows[0]["layout"] != rows[4]["layout"]  # the stages lay the embedding out differently
    assert rows[0]["shape"] != rows[4]["shape"]
    # the same through the per-stage strategy folder, a single rank folder and a file in it
    assert embedding_row(inspect_json(demo["r8"], "--strategy", demo["s8_dir"])["ranks"]["5"]["tensors"]) == rows[5]
    single = inspect_json(os.path.join(demo["r8"], "rank_5"), "--strategy", demo["s8"])
    assert single["kind"] == "checkpoint" and single["rank"] == 5 and embedding_row(single["tensors"]) == rows[5]
    in_file = inspect_json(rank_file(demo["r8"], 6), "--strategy", demo["s8"])
    assert embedding_row(in_file["tensors"]) == rows[6]
    text = run("inspect", demo["r8"], "--strategy", demo["s8"], "--params")
    assert text.returncode == 0 and str(want) in text.stdout and "[1024, 64]" not in text.stdout


def test_inspect_strategy_files_show_their_stages(demo: dict[str, str]) -> None:
    for name, stage in (("ckpt_strategy_rank_0.ckpt", 0), ("ckpt_strategy_rank_4.ckpt", 1)):
        info = inspect_json(os.path.join(demo["s8_dir"], name))
        assert info["kind"] == "strategy" and {tuple(p["stages"]) for p in info["params"]} == {(stage,)}, name
    merged = embedding_row(inspect_json(demo["s8"])["params"])
    assert merged["stages"] == [0, 1] and set(merged["stage_layouts"]) == {"0", "1"}
    folder = inspect_json(demo["s8_dir"])
    assert folder["kind"] == "strategy" and embedding_row(folder["params"]) == merged


def test_inspect_reads_every_full_model_form(demo: dict[str, str], tmp_path: Path) -> None:
    names = {r["name"] for r in inspect_json(demo["full"])["tensors"]}
    unified = tmp_path / "unified"
    assert run("unify", demo["st8"], str(unified), "--src-strategy", demo["s8"]).returncode == 0
    for target in (demo["full_dir"], str(unified), demo["full_back"]):
        info = inspect_json(target)
        rows = info["tensors"] if info["kind"] == "checkpoint" else info["ranks"]["0"]["tensors"]
        assert {r["name"] for r in rows} == names, target


def test_inspect_encrypted_checkpoint_with_key(demo: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef")
    enc = tmp_path / "enc"
    assert (
        run(
            "convert", demo["full"], str(enc), "--to", "ckpt", "--enc-key-file", str(key), "--enc-mode", "AES-CBC"
        ).returncode
        == 0
    )
    target = str(enc / "model.ckpt")
    line = one_error(run("inspect", target))
    assert "--dec-key-file" in line
    plain = inspect_json(demo["full"])["tensors"]
    assert inspect_json(target, "--dec-key-file", str(key), "--dec-mode", "AES-CBC")["tensors"] == plain
    env = {**os.environ, "PROMISES_KEY": b"0123456789abcdef".hex()}
    proc = run("inspect", str(enc), "--dec-key-env", "PROMISES_KEY", "--dec-mode", "AES-CBC", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors"] == plain


def test_inspect_missing_and_empty(tmp_path: Path) -> None:
    assert "no such file or folder" in one_error(run("inspect", str(tmp_path / "nothing")))
    (tmp_path / "empty").mkdir()
    assert "is empty" in one_error(run("inspect", str(tmp_path / "empty")))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    assert "holds no checkpoint or strategy files" in one_error(run("inspect", str(tmp_path / "notes")))


# ------------------------------------------------------------------------- merged file in a strategy folder


def test_strategy_folder_with_merged_file(demo: dict[str, str], full_run: str, tmp_path: Path) -> None:
    folder = tmp_path / "strategy"
    shutil.copytree(demo["s8_dir"], folder)
    merged = folder / "merged_ckpt_strategy.ckpt"
    proc = run("merge-strategies", str(folder), str(merged))
    assert proc.returncode == 0, proc.stderr
    before = snapshot(str(folder))
    note = "reshard: note: ignored merged_ckpt_strategy.ckpt: the per-stage files were used"
    out = tmp_path / "out"
    proc = run(
        "transform", "--src", demo["r8"], "--dst", str(out), "--src-strategy", str(folder), "--dst-strategy", demo["s4"]
    )
    assert proc.returncode == 0, proc.stderr
    assert note in proc.stderr.splitlines()
    for r in range(4):
        assert Path(rank_file(str(out), r)).read_bytes() == Path(rank_file(full_run, r)).read_bytes()
    proc = run("rank-list", "1", "--src-strategy", str(folder), "--dst-strategy", demo["s4"], "--json")
    assert proc.returncode == 0 and note in proc.stderr.splitlines()
    assert json.loads(proc.stdout) == needed(demo, 1)
    proc = run("inspect", demo["r8"], "--strategy", str(folder), "--json")
    assert proc.returncode == 0 and note in proc.stderr.splitlines()
    proc = run("verify", demo["full"], demo["r8"], "--b-strategy", str(folder))
    assert proc.returncode == 0 and any(
        line.endswith(note[len("reshard: note: ") :]) for line in proc.stderr.splitlines()
    ), proc.stderr
    again = tmp_path / "again.ckpt"
    proc = run("merge-strategies", str(folder), str(again))
    assert proc.returncode == 0 and note in proc.stderr.splitlines(), proc.stderr
    assert again.read_bytes() == Path(demo["s8"]).read_bytes()
    assert snapshot(str(folder)) == before  # never deleted, never touched
    alone = tmp_path / "only_merged"
    alone.mkdir()
    shutil.copy2(merged, alone / merged.name)
    proc = run("rank-list", "1", "--src-strategy", str(alone), "--dst-strategy", demo["s4"], "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == needed(demo, 1) and "note" not in proc.stderr


# ------------------------------------------------------------------------- encrypt / decrypt in one step


def test_convert_encrypts_reencrypts_and_decrypts(demo: dict[str, str], tmp_path: Path) -> None:
    key_a = tmp_path / "a.key"
    key_a.write_bytes(b"A" * 16)
    env = {**os.environ, "PROMISES_KEY_B": (b"B" * 16).hex()}
    before = snapshot(demo["full_dir"])
    enc, re_enc, plain = tmp_path / "enc", tmp_path / "re_enc", tmp_path / "plain"
    proc = run("convert", demo["full"], str(enc), "--to", "ckpt", "--enc-key-file", str(key_a))
    assert proc.returncode == 0 and "wrote 1 file " in proc.stdout, proc.stderr
    assert (enc / "model.ckpt").read_bytes()[:4] != Path(demo["full"]).read_bytes()[:4]
    proc = run(
        "convert",
        str(enc),
        str(re_enc),
        "--to",
        "ckpt",
        "--dec-key-file",
        str(key_a),
        "--enc-key-env",
        "PROMISES_KEY_B",
        "--enc-mode",
        "SM4-CBC",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    proc = run(
        "convert",
        str(re_enc / "model.ckpt"),
        str(plain),
        "--to",
        "ckpt",
        "--dec-key-env",
        "PROMISES_KEY_B",
        "--dec-mode",
        "SM4-CBC",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (plain / "model.ckpt").read_bytes() == Path(demo["full"]).read_bytes()
    assert snapshot(demo["full_dir"]) == before


def test_convert_reencrypts_rank_folders(demo: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(b"K" * 16)
    out = tmp_path / "enc8"
    proc = run("convert", demo["r8"], str(out), "--to", "ckpt", "--enc-key-file", str(key), "--enc-mode", "AES-CBC")
    assert proc.returncode == 0 and "wrote 8 files" in proc.stdout, proc.stderr
    assert same_tensors(
        demo["r8"],
        str(out),
        "--a-strategy",
        demo["s8"],
        "--b-strategy",
        demo["s8"],
        "--dec-key-file",
        str(key),
        "--dec-mode",
        "AES-CBC",
    )


def test_convert_ckpt_to_ckpt_refusals(demo: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(b"K" * 16)
    before = snapshot(demo["root"])
    out = tmp_path / "out"
    assert "nothing to do" in one_error(run("convert", demo["full"], str(out), "--to", "ckpt"))
    assert "nothing to do" in one_error(run("convert", demo["r8"], str(out), "--to", "ckpt"))
    line = one_error(
        run("convert", demo["full"], demo["full_dir"], "--to", "ckpt", "--enc-key-file", str(key), "--overwrite")
    )
    assert "would replace an input" in line
    assert not out.exists() and snapshot(demo["root"]) == before


# ------------------------------------------------------------------------- a full model everywhere


def test_full_file_and_folder_transform_without_source_strategy(demo: dict[str, str], tmp_path: Path) -> None:
    outs = []
    for i, src in enumerate((demo["full"], demo["full_dir"], demo["full_back"])):
        out = tmp_path / f"r4_{i}"
        proc = run("transform", "--src", src, "--dst", str(out), "--dst-strategy", demo["s4"])
        assert proc.returncode == 0, proc.stderr
        assert same_tensors(demo["r4"], str(out), "--a-strategy", demo["s4"], "--b-strategy", demo["s4"])
        outs.append(out)
    for r in range(4):
        assert Path(rank_file(str(outs[0]), r)).read_bytes() == Path(rank_file(str(outs[1]), r)).read_bytes()
    copy = tmp_path / "copy"
    proc = run("transform", "--src", demo["full"], "--dst", str(copy))  # full -> full, no strategy at all
    assert proc.returncode == 0, proc.stderr
    assert Path(rank_file(str(copy), 0)).read_bytes() == Path(demo["full"]).read_bytes()


@pytest.mark.parametrize(
    "pair", [("full", "full_back"), ("full_back", "full"), ("full_dir", "full_back"), ("full_back", "full_dir")]
)
def test_verify_full_file_against_reshard_full_output(demo: dict[str, str], pair: tuple[str, str]) -> None:
    proc = run("verify", demo[pair[0]], demo[pair[1]], "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["summary"]["match"] == 119


def test_dropin_still_refuses_a_transform_without_strategies(demo: dict[str, str], tmp_path: Path) -> None:
    """reshard's transform copies a full model with no strategy at all; MindSpore's functions refuse
    it (checked against MindSpore 2.10), and so does the drop-in."""
    from reshard import mindspore as ms
    from reshard.errors import LayoutError

    with pytest.raises(LayoutError, match="none of the checkpoint's parameters"):
        ms.transform_checkpoints(demo["full_back"], str(tmp_path / "o"), "c", None, None)
    with pytest.raises(LayoutError, match="none of the checkpoint's parameters"):
        ms.transform_checkpoint_by_rank(0, {0: demo["full"]}, str(tmp_path / "o.ckpt"), None, None)
    assert not os.listdir(tmp_path)
