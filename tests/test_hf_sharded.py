"""Hugging Face sharded safetensors, written (``--hf``) and read (a folder holding
``model.safetensors.index.json``, or that file) wherever a full model goes in or comes out.

The shards must load with the ``safetensors`` library and hold the unified tensors; the sharding
decision must be ``huggingface_hub``'s (compared with the library itself, installed by the test
extra, and with a hand-computed expectation); round trips through the Hugging Face layout must give back
the original rank files; bad indexes fail with one line and exit code 2, writing nothing.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reshard import api
from reshard.errors import FormatError, UsageError
from reshard.formats import hf_index
from reshard.formats.strategy import load_strategy
from reshard.plan import Copy, TensorPlan, TransformPlanner, plan_hf_shards
from reshard.plan.convert import _plan_transform_full_bulk, _plan_transform_full_reference
from reshard.text import parse_size

from .trust_helpers import make_job, run_cli, snapshot, temp_files

SMALL_SHARD = 3000  # bytes: the small job (~21 KiB of unified tensors) gets several shards
TOO_SMALL = 700  # smaller than the 1 KiB embedding / lm_head tensors: they get shards of their own


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The synthetic 8-rank job, its MindSpore-unified twin and its Hugging Face twin."""
    paths = make_job(str(tmp_path_factory.mktemp("hfjob")))
    root = paths["root"]
    api.unify(paths["r8st"], paths["s8"], f"{root}/uni", destination=api.Destination(manifest=False))
    api.unify(paths["r8st"], paths["s8"], f"{root}/hf", output=api.OutputSpec(format="hf", max_shard_size=SMALL_SHARD))
    return {**paths, "uni": f"{root}/uni", "hf": f"{root}/hf"}


def load_folder(folder: str, pattern: str) -> dict[str, np.ndarray]:
    """Every tensor of the matching files, each name once."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(folder, pattern))):
        for name, value in load_file(path).items():
            assert name not in out, name
            out[name] = value
    return out


def rank_file(folder: str, rank: int) -> str:
    (path,) = glob.glob(os.path.join(folder, f"rank_{rank}", "*.safetensors"))
    return path


def assert_same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


def source_order(r8st: str, names: set[str]) -> list[str]:
    """Names in the order they first appear in the rank files (rank order): unify --hf's order."""
    order: dict[str, None] = {}
    for rank in range(8):
        for name in api.source_file(rank_file(r8st, rank)).tensors:
            if name in names:
                order.setdefault(name)
    return list(order)


def expected_groups(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """The rule as huggingface_hub documents it, written out independently of reshard's code."""
    shards: list[list[str]] = []
    current: list[str] = []
    total = 0
    for name, size in sizes:
        if size > limit:
            shards.append([name])
        elif total + size > limit:
            shards.append(current)
            current, total = [name], size
        else:
            current.append(name)
            total += size
    return [*shards, current] if current else shards


def hub_groups(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """``huggingface_hub``'s own decision for these sizes (its generic splitter: no torch needed)."""
    from huggingface_hub import serialization

    factory = serialization.split_state_dict_into_shards_factory
    size_kw = "get_storage_size" if "get_storage_size" in inspect.signature(factory).parameters else "get_tensor_size"
    split = factory(
        dict(sizes), max_shard_size=limit, filename_pattern="model{suffix}.safetensors", **{size_kw: lambda size: size}
    )
    return [list(names) for names in split.filename_to_tensors.values()]


# ------------------------------------------------------------------------------------ the rules


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1000", 1000),
        ("1.5GB", 1_500_000_000),
        ("3kb", 3000),
        ("64 KiB", 65536),
        ("10B", 10),
        (123, 123),
    ],
)
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1", "0", "1.5", "five"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


@pytest.mark.parametrize(
    ("sizes", "limit", "groups"),
    [
        # huggingface_hub's docstring: [6, 6, 2, 6, 2, 2] GB at 10 GB -> [6], [6+2], [6+2+2]
        ([6, 6, 2, 6, 2, 2], 10, [[0], [1, 2], [3, 4, 5]]),
        # a tensor over the limit gets a shard of its own, appended before the shard still open
        ([3, 10, 3], 5, [[1], [0], [2]]),
        ([5, 5, 5], 5, [[0], [1], [2]]),  # "exceed" is strict: a shard may be exactly the limit
        ([1, 2, 3], 100, [[0, 1, 2]]),
    ],
)
def test_shard_groups_hand_computed(sizes: list[int], limit: int, groups: list[list[int]]) -> None:
    named = [(f"t{i}", s) for i, s in enumerate(sizes)]
    assert hf_index.shard_groups(named, limit) == [[f"t{i}" for i in g] for g in groups]
    assert hub_groups(named, limit) == [[f"t{i}" for i in g] for g in groups]


def test_index_text_as_save_pretrained() -> None:
    text = hf_index.index_text(12, {"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"})
    assert text == (
        '{\n  "metadata": {\n    "total_size": 12\n  },\n  "weight_map": {\n'
        '    "a": "model-00001-of-00002.safetensors",\n    "b": "model-00002-of-00002.safetensors"\n'
        "  }\n}\n"
    )


def test_plan_hf_shards_single_and_strings() -> None:
    from reshard import dtypes

    t = TensorPlan("w", dtypes.FLOAT32, (2,), (Copy(0, "w", (0,), (0,), (2,), True),), 8)
    files, texts = plan_hf_shards([t], "/out", 100)
    assert [f.path for f in files] == ["/out/model.safetensors"] and texts == ()
    assert files[0].metadata == (("format", "pt"),)
    with pytest.raises(Exception, match="string"):
        plan_hf_shards([TensorPlan("s", dtypes.STR, (0,), (), 4, b"abcd")], "/out", 100)


# ------------------------------------------------------------------------------------ writing


def test_unify_hf_shards_load_with_safetensors_and_hold_the_unified_tensors(job: dict[str, str]) -> None:
    hf, uni = job["hf"], job["uni"]
    shards = sorted(glob.glob(os.path.join(hf, "model-*.safetensors")))
    assert len(shards) > 2
    assert_same_tensors(load_folder(hf, "model-*.safetensors"), load_folder(uni, "part*.safetensors"))
    assert_same_tensors(
        load_file(os.path.join(hf, "hyper_param.safetensors")), load_file(os.path.join(uni, "hyper_param.safetensors"))
    )
    for path in shards:
        assert api.open_checkpoint(path).metadata == {"format": "pt"}  # what transformers accepts


def test_unify_hf_index_is_huggingface_hubs_decision(job: dict[str, str]) -> None:
    hf = job["hf"]
    with open(os.path.join(hf, hf_index.INDEX_NAME), encoding="utf-8") as fh:
        text = fh.read()
    unified = load_folder(job["uni"], "part*.safetensors")
    sizes = [(n, unified[n].nbytes) for n in source_order(job["r8st"], set(unified))]
    groups = hub_groups(sizes, SMALL_SHARD)
    assert groups == expected_groups(sizes, SMALL_SHARD) == hf_index.shard_groups(sizes, SMALL_SHARD)
    count = len(groups)
    weight_map = {n: f"model-{j + 1:05d}-of-{count:05d}.safetensors" for j, g in enumerate(groups) for n in g}
    expected = {"metadata": {"total_size": sum(s for _, s in sizes)}, "weight_map": weight_map}
    assert text == json.dumps(expected, indent=2, sort_keys=True) + "\n"
    for group in groups:  # each shard holds exactly its group
        assert sorted(load_file(os.path.join(hf, weight_map[group[0]]))) == sorted(group)
    assert sorted(os.listdir(hf)) == sorted(
        [*set(weight_map.values()), hf_index.INDEX_NAME, "hyper_param.safetensors", "reshard-manifest.json"]
    )


def test_single_shard_is_model_safetensors_without_index(job: dict[str, str], tmp_path) -> None:
    out = tmp_path / "one"
    proc = run_cli("unify", job["r8st"], str(out), "--src-strategy", job["s8"], "--hf", "--keep-training-state")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["hyper_param.safetensors", "model.safetensors", "reshard-manifest.json"]
    assert_same_tensors(load_file(str(out / "model.safetensors")), load_folder(job["uni"], "part*.safetensors"))
    back = tmp_path / "back"  # and it reads back as a full model
    assert run_cli("split", str(out), str(back), "--dst-strategy", job["s8"]).returncode == 0
    for rank in range(8):
        assert_same_tensors(load_file(rank_file(str(back), rank)), load_file(rank_file(job["r8st"], rank)))


def test_tensor_over_the_limit_gets_its_own_shard(job: dict[str, str], tmp_path) -> None:
    out = tmp_path / "big"
    proc = run_cli(
        "unify", job["r8st"], str(out), "--src-strategy", job["s8"], "--hf", "--keep-training-state",
        "--max-shard-size", str(TOO_SMALL),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shards = sorted(glob.glob(str(out / "model-*.safetensors")))
    oversized = 0
    for path in shards:
        tensors = load_file(path)
        size = sum(t.nbytes for t in tensors.values())
        if size > TOO_SMALL:
            oversized += 1
            assert len(tensors) == 1, path
    assert oversized >= 4  # embedding and lm_head, and their two Adam moments
    assert_same_tensors(load_folder(str(out), "model-*.safetensors"), load_folder(job["uni"], "part*.safetensors"))


def test_transform_to_full_hf_and_convert_full_ckpt_hf(job: dict[str, str], tmp_path) -> None:
    with api.open_checkpoint(job["full"]) as full:
        model = {name: np.array(full.array(name)) for name in full}
    out = tmp_path / "t"
    proc = run_cli(
        "transform",
        "--src",
        job["r8st"],
        "--src-strategy",
        job["s8"],
        "--dst",
        str(out),
        "--hf",
        "--keep-training-state",
        "--max-shard-size",
        "2KB",
    )
    assert proc.returncode == 0, proc.stderr
    assert os.path.isfile(out / hf_index.INDEX_NAME)
    assert_same_tensors(load_folder(str(out), "model-*.safetensors"), model)
    conv = tmp_path / "c"
    proc = run_cli(
        "convert", job["full"], str(conv), "--to", "safetensors", "--hf", "--keep-training-state",
        "--max-shard-size", "4KiB",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(load_folder(str(conv), "model-*.safetensors"), model)


def test_manifest_covers_the_shards_and_the_index(job: dict[str, str]) -> None:
    hf = job["hf"]
    with open(os.path.join(hf, "reshard-manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    recorded = {o["path"]: o for o in manifest["outputs"]}
    expected = sorted(n for n in os.listdir(hf) if n != "reshard-manifest.json")
    assert sorted(recorded) == expected and hf_index.INDEX_NAME in recorded
    for name, record in recorded.items():
        path = os.path.join(hf, name)
        algorithm = next(k for k in record if k not in ("path", "bytes", "fingerprint"))
        if algorithm == "sha256":
            with open(path, "rb") as fh:
                expected = (os.path.getsize(path), hashlib.sha256(fh.read()).hexdigest())
        else:  # the manifest's own checksum function for other algorithms
            from reshard.execute.digest import file_digest

            expected = file_digest(path, algorithm)
        assert (record["bytes"], record[algorithm]) == expected, name


@pytest.mark.parametrize(
    "args",
    [
        ["unify", "{r8st}", "{out}", "--src-strategy", "{s8}", "--max-shard-size", "5GB"],  # size without --hf
        ["unify", "{r8st}", "{out}", "--src-strategy", "{s8}", "--hf", "--split", "1/2"],
        ["unify", "{r8st}", "{out}", "--src-strategy", "{s8}", "--hf", "--max-shard-size", "5 parsecs"],
        ["transform", "--src", "{r8st}", "--dst", "{out}", "--src-strategy", "{s8}", "--dst-strategy", "{s4}", "--hf"],
        ["convert", "{r8}", "{out}", "--to", "safetensors", "--hf"],  # rank folders, not one full file
    ],
    ids=["size-without-hf", "hf-with-split", "bad-size", "hf-with-dst-strategy", "convert-folder"],
)
def test_bad_hf_options(job: dict[str, str], tmp_path, args: list[str]) -> None:
    out = tmp_path / "out"
    proc = run_cli(*[a.format(out=out, **job) for a in args])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert not out.exists()


# ------------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("via_index_file", [False, True], ids=["folder", "index-file"])
def test_round_trip_ranks_hf_ranks(job: dict[str, str], tmp_path, via_index_file: bool) -> None:
    src = os.path.join(job["hf"], hf_index.INDEX_NAME) if via_index_file else job["hf"]
    back = tmp_path / "back"
    proc = run_cli("split", src, str(back), "--dst-strategy", job["s8"])
    assert proc.returncode == 0, proc.stderr
    moved = tmp_path / "moved"  # transform from the full model, no source strategy
    proc = run_cli("transform", "--src", src, "--dst", str(moved), "--dst-strategy", job["s8"])
    assert proc.returncode == 0, proc.stderr
    for rank in range(8):
        original = load_file(rank_file(job["r8st"], rank))
        assert_same_tensors(load_file(rank_file(str(back), rank)), original)
        assert_same_tensors(load_file(rank_file(str(moved), rank)), original)


def test_transform_from_hf_equals_transform_from_the_full_file(job: dict[str, str], tmp_path) -> None:
    """A sharded full model is planned like the same tensors in one file (4-rank target, ckpt out)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert (
        run_cli(
            "transform", "--src", job["hf"], "--dst", str(a), "--dst-strategy", job["s4"], "--output-format", "ckpt"
        ).returncode
        == 0
    )
    api.transform(job["full"], str(b), None, job["s4"], destination=api.Destination(manifest=False))
    for rank in range(4):
        with (
            api.open_checkpoint(str(a / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")) as x,
            api.open_checkpoint(str(b / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")) as y,
        ):
            assert sorted(x) == sorted(y)
            for name in y:
                assert np.array_equal(x.array(name), y.array(name)), name


def test_bulk_plan_equals_reference_loop(job: dict[str, str]) -> None:
    files, mapping, _ = api.unified_index(job["hf"])
    for strategy, count in ((job["s8"], 8), (job["s4"], 4)):
        planner = TransformPlanner({}, None, load_strategy(strategy))
        args = (planner, files, mapping, "/out", "checkpoint_", "safetensors", list(range(count)))
        bulk = _plan_transform_full_bulk(*args)
        assert bulk is not None and bulk == _plan_transform_full_reference(*args)


def test_verify_and_inspect_read_the_sharded_model(job: dict[str, str]) -> None:
    for side in (job["hf"], os.path.join(job["hf"], hf_index.INDEX_NAME)):
        proc = run_cli("verify", job["full"], side, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["summary"]["match"] == len(api.source_file(job["full"]).tensors)
    proc = run_cli("inspect", job["hf"], "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["kind"] == "checkpoint" and len(info["files"]) == len(glob.glob(f"{job['hf']}/*.safetensors"))
    assert {r["name"] for r in info["tensors"]} == set(api.source_file(job["full"]).tensors)


def _broken(job: dict[str, str], root: str, case: str) -> str:
    """A copy of the Hugging Face folder with one defect."""
    folder = os.path.join(root, f"hf-{case}")
    shutil.copytree(job["hf"], folder)
    index_path = os.path.join(folder, hf_index.INDEX_NAME)
    with open(index_path, encoding="utf-8") as fh:
        index = json.load(fh)
    weight_map = index["weight_map"]
    first = sorted(set(weight_map.values()))[0]
    if case == "missing-shard":
        os.remove(os.path.join(folder, first))
    elif case == "name-not-in-shard":
        weight_map["model.ghost.weight"] = first
    elif case == "tensor-in-two-shards":
        twin = next(n for n, f in weight_map.items() if f == first)
        save_file(
            {twin: np.zeros(2, np.float32), "extra": np.ones(2, np.float32)},
            os.path.join(folder, "model-extra.safetensors"),
        )
        weight_map["extra"] = "model-extra.safetensors"
    if case == "malformed-json":
        with open(index_path, "w", encoding="utf-8") as fh:
            fh.write('{"metadata": {"total_size": 1}, "weight_map": {"a": ')
    else:
        with open(index_path, "w", encoding="utf-8") as fh:
            json.dump(index, fh)
    return folder


BROKEN = {  # case -> what the one line must say
    "missing-shard": "missing",
    "name-not-in-shard": "model.ghost.weight",
    "tensor-in-two-shards": "two shards",
    "malformed-json": "malformed JSON",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_index_split_one_line_exit_2_nothing_written(job: dict[str, str], tmp_path, case: str) -> None:
    folder = _broken(job, str(tmp_path), case)
    before = snapshot(folder)
    out = tmp_path / "out"
    proc = run_cli("split", folder, str(out), "--dst-strategy", job["s8"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert BROKEN[case] in lines[0] and folder in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and snapshot(folder) == before and not temp_files(str(tmp_path))


@pytest.mark.parametrize("command", ["transform", "verify", "inspect"])
def test_bad_index_other_commands(job: dict[str, str], tmp_path, command: str) -> None:
    folder = _broken(job, str(tmp_path), "missing-shard")
    out = tmp_path / "out"
    args = {
        "transform": ["transform", "--src", folder, "--dst", str(out), "--dst-strategy", job["s8"]],
        "verify": ["verify", job["full"], folder],
        "inspect": ["inspect", folder],
    }[command]
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "shard named by model.safetensors.index.json is missing" in lines[0], proc.stderr
    assert not out.exists()


def test_weight_map_reader_errors(tmp_path) -> None:
    path = tmp_path / hf_index.INDEX_NAME
    for text, message in [
        ("[1, 2]", "no weight_map"),
        ('{"weight_map": {"a": 3}}', "not a file name"),
        ('{"weight_map": {"a": "../x.safetensors"}}', "outside"),
        ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "twice"),
        ('{"weight_map": ', "malformed JSON"),
    ]:
        path.write_text(text, encoding="utf-8")
        with pytest.raises(FormatError, match=message) as info:
            hf_index.read_weight_map(str(path))
        assert str(path) in str(info.value)
