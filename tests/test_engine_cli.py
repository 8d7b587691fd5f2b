"""Filters, --rename rules, surgery and the name report end to end, through the CLI and the API.

Every run is checked against the demo's own bytes: a filtered or renamed output holds exactly the
tensors it should, with the source's values, and every name the run touched is in the report.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from reshard import api, demo
from reshard.errors import UnsupportedError, UsageError
from reshard.naming import (
    EXCLUDE,
    INCLUDE,
    Join,
    ModelMap,
    NameFilter,
    NameOptions,
    Rename,
    Split,
    Stack,
    Unstack,
)
from reshard.sources.files import open_checkpoint
from tests.trust_helpers import run_cli

STATE = ("adam_m.", "adam_v.", "global_step", "learning_rate")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("demo") / "demo"
    demo.main(str(folder))
    return folder


def load(folder: Path | str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(f"{folder}/**/*.*", recursive=True)):
        if path.endswith((".ckpt", ".safetensors")):
            index = open_checkpoint(path)
            for name in index.entries:
                out[name] = np.array(index.array(name))
    return out


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture(scope="module")
def full(d: Path) -> dict[str, np.ndarray]:
    return load(d / "full")


RULES_YAML = """\
- match: 'model\\.layers\\.(\\d+)\\.(.*)'
  replace: 'decoder.layers.\\1.\\2'
- {match: 'lm_head\\.weight', replace: 'output_layer.weight'}
"""
BACK_JSON = [
    {"match": r"decoder\.layers\.(\d+)\.(.*)", "replace": r"model.layers.\1.\2"},
    {"match": r"output_layer\.weight", "replace": "lm_head.weight"},
]


def test_weights_only_from_ranks_to_full(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(d / "ckpt_8ranks"), "--src-strategy", str(d / "strategy_8"), "--dst", str(out),
        "--weights-only", "--names-report", str(tmp_path / "names.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = load(out)
    assert set(got) == {n for n in full if not n.startswith(STATE)}
    for name, value in got.items():
        np.testing.assert_array_equal(value, full[name])
    dropped = {n for n in full if n.startswith(STATE)}
    # stderr: the counts, then the names grouped by the rule that dropped them (a few each)
    assert f"{len(dropped)} dropped by a filter" in proc.stderr
    assert f"dropped   {len(dropped)} (--weights-only): " in proc.stderr and "more)" in proc.stderr
    assert f"every name is in {tmp_path / 'names.json'}" in proc.stderr
    report = json.loads((tmp_path / "names.json").read_text())
    assert {"name": "global_step", "rule": "--weights-only"} in report["dropped"]
    assert {e["name"] for e in report["dropped"]} == dropped and report["counts"]["dropped"] == len(dropped)


def test_weights_only_with_a_destination_strategy_keeps_layouts(d: Path, tmp_path: Path) -> None:
    """The strategies still name the optimizer states the filter dropped: they are passed over, not an error."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    common = ["--src", str(d / "ckpt_8ranks"), "--src-strategy", str(d / "strategy_8"), "--dst-strategy"]
    common.append(str(d / "merged" / "dst_strategy.ckpt"))
    assert run_cli("transform", *common, "--dst", str(ref)).returncode == 0
    proc = run_cli("transform", *common, "--dst", str(out), "--weights-only")
    assert proc.returncode == 0, proc.stderr
    for rank in range(4):
        got, want = load(out / f"rank_{rank}"), load(ref / f"rank_{rank}")
        assert set(got) == {n for n in want if not n.startswith(STATE)}
        for name, value in got.items():
            np.testing.assert_array_equal(value, want[name])


def test_include_exclude_order_last_rule_wins(d: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli(
        "convert", str(d / "full" / "model.ckpt"), str(out), "--to", "safetensors",
        "--include", "model.layers.*", "--exclude", "*.attention.*", "--include", "*.wq.weight",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = set(load(out))
    assert "model.layers.0.attention.wq.weight" in names  # the last rule (include) wins
    assert "model.layers.0.attention.wk.weight" not in names  # excluded
    assert "model.layers.0.ffn_norm.weight" in names
    assert not any(n.startswith(("lm_head", "model.tok")) for n in names)
    assert {n for n in names if n.startswith("adam")} == {n for n in names if n.startswith("adam") and "wq" in n}
    assert "(matches no --include)" in proc.stderr


def test_plan_shows_the_filtered_plan_and_the_report_in_json(d: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "plan", "--src", str(d / "ckpt_8ranks"), "--src-strategy", str(d / "strategy_8"), "--dst", str(tmp_path / "o"),
        "--include", "lm_head.*", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [t["name"] for f in doc["files"] for t in f["tensors"]] == ["lm_head.weight"]
    assert doc["names"]["counts"]["dropped"] == 118 and not (tmp_path / "o").exists()


def test_unify_hf_index_never_mentions_dropped_or_old_names(d: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES_YAML)
    out = tmp_path / "hf"
    proc = run_cli(
        "unify", str(d / "st_8ranks"), str(out), "--src-strategy", str(d / "strategy_8"), "--hf", "--max-shard-size",
        "300KB", "--weights-only", "--rename", str(rules),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "output_layer.weight" in names and "decoder.layers.0.attention.wq.weight" in names
    assert not any(n.startswith(("model.layers", "adam", "lm_head")) for n in names)
    held = {n for path in out.glob("model-*.safetensors") for n in open_checkpoint(str(path)).entries}
    assert held == names
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in load(out).values() if t.ndim) - sum(
        v.nbytes for n, v in load(out).items() if n not in names
    )


def test_rename_there_and_back_is_byte_identical(d: Path, tmp_path: Path) -> None:
    there, back = tmp_path / "rules.yaml", tmp_path / "back.json"
    there.write_text(RULES_YAML)
    back.write_text(json.dumps(BACK_JSON))
    src = d / "full" / "model.ckpt"
    one = tmp_path / "one"
    two = tmp_path / "two"
    assert run_cli("convert", str(src), str(one), "--to", "safetensors").returncode == 0
    names = tmp_path / "names.json"
    proc = run_cli(
        "convert", str(src), str(tmp_path / "renamed"), "--to", "safetensors", "--rename", str(there),
        "--names-report", str(names),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "renamed   " in proc.stderr and "more renamed" in proc.stderr  # the first ten, and how many more
    assert {"from": "lm_head.weight", "to": "output_layer.weight"} in json.loads(names.read_text())["renamed"]
    renamed = tmp_path / "renamed" / "model.safetensors"
    assert "output_layer.weight" in open_checkpoint(str(renamed)).entries
    proc = run_cli("transform", "--src", str(renamed), "--dst", str(two), "--rename", str(back), "--strict")
    assert proc.returncode != 0  # adam_m.* etc. match no rule: --strict refuses them
    assert "--strict" in proc.stderr and not two.exists()
    proc = run_cli("transform", "--src", str(renamed), "--dst", str(two), "--rename", str(back))
    assert proc.returncode == 0, proc.stderr
    a = (one / "model.safetensors").read_bytes()
    b = (two / "rank_0" / "checkpoint_0.safetensors").read_bytes()
    assert a == b


def surgery_map() -> ModelMap:
    return ModelMap(
        (
            Join((r"(.*)\.wq\.weight", r"(.*)\.wk\.weight", r"(.*)\.wv\.weight"), r"\1.wqkv.weight", 0, "heads"),
            Stack(r"model\.layers\.(?P<expert>\d+)\.attention\.wo\.weight", "stacked.wo", 1),
            Stack(r"model\.layers\.(?P<expert>\d+)\.feed_forward\.w2\.weight", "stacked.w2", 0),
            Rename(r"model\.(.*)", r"m.\1"),
        ),
        {"heads": 4},
        "test map",
    )


def inverse_map() -> ModelMap:
    return ModelMap(
        (
            Unstack(r"stacked\.wo", "model.layers.{expert}.attention.wo.weight", 1),
            Unstack(r"stacked\.w2", "model.layers.{expert}.feed_forward.w2.weight", 0),
            Split(
                r"(.*)\.wqkv\.weight", (r"\1.wq.weight", r"\1.wk.weight", r"\1.wv.weight"), 0, ("d", "d", -1), "heads"
            ),
            Rename(r"m\.(.*)", r"model.\1"),
        ),
        {"heads": 4, "d": 128},
        "inverse",
    )


def check_surgery(out: dict[str, np.ndarray], full: dict[str, np.ndarray]) -> None:
    layers = sum(1 for n in full if n.startswith("model.layers.") and n.endswith("attention.wo.weight"))
    for layer in range(layers):
        q, k, v = (full[f"model.layers.{layer}.attention.w{x}.weight"].reshape(4, 32, -1) for x in "qkv")
        want = np.concatenate([q, k, v], 1).reshape(384, -1)
        np.testing.assert_array_equal(out[f"model.layers.{layer}.attention.wqkv.weight"], want)
        np.testing.assert_array_equal(
            out[f"m.layers.{layer}.ffn_norm.weight"], full[f"model.layers.{layer}.ffn_norm.weight"]
        )
    wo = np.stack([full[f"model.layers.{n}.attention.wo.weight"] for n in range(layers)], 1)
    w2 = np.stack([full[f"model.layers.{n}.feed_forward.w2.weight"] for n in range(layers)], 0)
    np.testing.assert_array_equal(out["stacked.wo"], wo)
    np.testing.assert_array_equal(out["stacked.w2"], w2)


def test_surgery_after_planning_from_sharded_ranks(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    names = NameOptions(model_map=surgery_map())
    report = api.transform(
        str(d / "ckpt_8ranks"), str(tmp_path / "o"), str(d / "strategy_8"), None, tensors=api.TensorOptions(names=names)
    )
    check_surgery(load(tmp_path / "o"), full)
    assert report.names is not None
    assert {op for op, _, _ in report.names.surgery} == {"join", "stack"}


def test_surgery_before_planning_and_back(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    mapped, back = tmp_path / "mapped", tmp_path / "back"
    api.transform(
        str(d / "full" / "model.ckpt"),
        str(mapped),
        None,
        None,
        tensors=api.TensorOptions(names=NameOptions(model_map=surgery_map())),
    )
    check_surgery(load(mapped), full)
    api.transform(
        str(mapped / "rank_0"),
        str(back),
        None,
        None,
        tensors=api.TensorOptions(names=NameOptions(model_map=inverse_map())),
    )
    got = load(back)
    assert set(got) == set(full)
    for name, value in full.items():
        np.testing.assert_array_equal(got[name], value)


def test_surgery_then_a_destination_strategy(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    """From a full model the map comes first: the strategy plans the mapped tensors (unknown ones whole)."""
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    strategy = str(d / "merged" / "dst_strategy.ckpt")
    keep_names = ModelMap((Join((r"(.*)\.wq\.weight", r"(.*)\.wk\.weight"), r"\1.wqk.weight", 0),), name="m")
    api.transform(str(d / "full" / "model.ckpt"), str(plain), None, strategy)
    api.transform(
        str(d / "full" / "model.ckpt"),
        str(mapped),
        None,
        strategy,
        tensors=api.TensorOptions(names=NameOptions(model_map=keep_names)),
    )
    for rank in range(4):
        got, want = load(mapped / f"rank_{rank}"), load(plain / f"rank_{rank}")
        for name, value in got.items():
            if name.endswith("wqk.weight"):
                base = name[: -len("wqk.weight")]
                np.testing.assert_array_equal(
                    value, np.concatenate([full[base + "wq.weight"], full[base + "wk.weight"]])
                )
            else:
                np.testing.assert_array_equal(value, want[name])


def test_surgery_to_a_sharded_destination_from_ranks_is_refused(d: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="needs full tensors"):
        api.transform(
            str(d / "ckpt_8ranks"),
            str(tmp_path / "o"),
            str(d / "strategy_8"),
            str(d / "merged" / "dst_strategy.ckpt"),
            tensors=api.TensorOptions(names=NameOptions(model_map=surgery_map())),
        )
    assert not (tmp_path / "o").exists()


def test_unify_renamed_then_split_renamed_back(d: Path, tmp_path: Path) -> None:
    """A unified model under other names, split with the map back: the strategy plans the mapped names."""
    unified, out, ref = tmp_path / "unified", tmp_path / "out", tmp_path / "ref"
    strategy = str(d / "merged" / "dst_strategy.ckpt")
    there = ModelMap((Rename(r"model\.(.*)", r"hf.\1"),), name="there")
    back = ModelMap((Rename(r"hf\.(.*)", r"model.\1"),), name="back")
    api.unify(
        str(d / "st_8ranks"),
        str(d / "strategy_8"),
        str(unified),
        tensors=api.TensorOptions(names=NameOptions(model_map=there)),
    )
    assert any(n.startswith("hf.") for n in load(unified))
    api.unify(str(d / "st_8ranks"), str(d / "strategy_8"), str(tmp_path / "plain"))
    api.split(str(tmp_path / "plain"), strategy, str(ref))
    names = NameOptions(NameFilter(((EXCLUDE, "adam_*"),)), back)
    report = api.split(str(unified), strategy, str(out), tensors=api.TensorOptions(names=names))
    assert report.names is not None and report.names.dropped
    for rank in range(4):
        got, want = load(out / f"rank_{rank}"), load(ref / f"rank_{rank}")
        assert set(got) == {n for n in want if not n.startswith("adam_")}
        for name, value in got.items():
            np.testing.assert_array_equal(value, want[name])


def test_guard_for_a_map_of_another_family(d: Path, tmp_path: Path) -> None:
    foreign = ModelMap((Rename(r"transformer\.h\.(.*)", r"x.\1"), Rename(r"lm_head\.weight", "y")), name="preset gpt2")
    names = NameOptions(model_map=foreign, guard_family=True)
    with pytest.raises(UsageError, match="preset gpt2 matches only 1 of 119 tensor names"):
        api.transform(
            str(d / "full" / "model.ckpt"), str(tmp_path / "o"), None, None, tensors=api.TensorOptions(names=names)
        )
    assert not (tmp_path / "o").exists()


def test_checkpoint2_output_refuses_a_map_but_takes_filters(d: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"Checkpoint 2\.0"):
        api.transform(
            str(d / "ckpt_8ranks"),
            str(tmp_path / "o"),
            str(d / "strategy_8"),
            str(d / "merged" / "dst_strategy.ckpt"),
            output=api.OutputSpec(format="checkpoint2"),
            tensors=api.TensorOptions(names=NameOptions(model_map=surgery_map())),
        )
    report = api.transform(
        str(d / "ckpt_8ranks"),
        str(tmp_path / "cp2"),
        str(d / "strategy_8"),
        str(d / "merged" / "dst_strategy.ckpt"),
        output=api.OutputSpec(format="checkpoint2"),
        tensors=api.TensorOptions(names=NameOptions(NameFilter(weights_only=True))),
    )
    assert report.names is not None and not any(f.path.split(os.sep)[-1].startswith("opt") for f in report.plan.files)


# ------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written


def _bad_rules(tmp: Path, text: str, name: str = "rules.yaml") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


BAD_RULES = {
    "does not parse": ("- match: [unclosed\n", "rules.yaml", "not valid YAML"),
    "bad json": ('[{"match": "a",', "rules.json", "not valid JSON"),
    "not a list": ("match: a\nreplace: b\n", "rules.yaml", "non-empty list"),
    "extra key": ('[{"match": "a", "replace": "b", "x": 1}]', "rules.json", "exactly the keys"),
    "bad regex": ('[{"match": "(", "replace": "b"}]', "rules.json", "bad regular expression"),
    "bad group": ('[{"match": "a(.*)", "replace": "\\\\2"}]', "rules.json", "bad replacement"),
    "two to one": (
        '[{"match": "model\\\\.layers\\\\.\\\\d+\\\\.(.*)", "replace": "\\\\1"}]',
        "rules.json",
        "one output",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RULES))
def test_bad_rules_files(d: Path, tmp_path: Path, case: str) -> None:
    text, name, message = BAD_RULES[case]
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(d / "full" / "model.ckpt"), "--dst", str(out), "--rename",
        _bad_rules(tmp_path, text, name),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert files_under(out) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--include", "nothing.*"], "--include 'nothing.*' matches no tensor"),
        (["--exclude", "*"], "drop all 119 tensors"),
        (["--include", "adam_*", "--weights-only"], "drop all"),
        (["--strict"], "--strict needs --rename"),
        (["--rename", "/nonexistent/rules.yaml"], "cannot read rules file"),
    ],
)
def test_bad_filters(d: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    out = tmp_path / "out"
    for command in (
        ["transform", "--src", str(d / "ckpt_8ranks"), "--src-strategy", str(d / "strategy_8"), "--dst", str(out)],
        ["unify", str(d / "st_8ranks"), str(out), "--src-strategy", str(d / "strategy_8")],
        ["convert", str(d / "full" / "model.ckpt"), str(out), "--to", "safetensors"],
    ):
        proc = run_cli(*command, *flags)
        assert proc.returncode == 2, (command, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert files_under(out) == []


def test_filter_unit_rules() -> None:
    f = NameFilter(((INCLUDE, "a.*"), (EXCLUDE, "a.b*"), (INCLUDE, "a.bc")), weights_only=True)
    assert f.dropped_by("a.x") is None
    assert f.dropped_by("a.bd") == "--exclude 'a.b*'"
    assert f.dropped_by("a.bc") is None
    assert f.dropped_by("z") == "matches no --include"
    assert f.dropped_by("adam_m.a.x") == "--weights-only"


def test_unify_hf_packs_the_mapped_tensors(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    """Surgery happens before the shards are packed: sizes and the index are the mapped tensors'."""
    out = tmp_path / "hf"
    names = NameOptions(NameFilter(weights_only=True), surgery_map())
    api.unify(
        str(d / "st_8ranks"),
        str(d / "strategy_8"),
        str(out),
        output=api.OutputSpec(format="hf", max_shard_size="400KB"),
        tensors=api.TensorOptions(names=names),
    )
    got = load(out)
    check_surgery(got, full)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n in got if n not in ("global_step", "learning_rate")}
    for shard in out.glob("model-*.safetensors"):
        tensors = open_checkpoint(str(shard)).entries
        assert shard.stat().st_size <= 400_000 or len(tensors) == 1


def test_grouped_experts_like_mindformers_and_back(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    """MindFormers' ``weight1``: the experts' fc1 transposed and concatenated (here: layers as experts)."""
    layers = sum(1 for n in full if n.startswith("model.layers.") and n.endswith("feed_forward.w1.weight"))
    group = ModelMap(
        (Stack(r"model\.layers\.(?P<expert>\d+)\.feed_forward\.w1\.weight", "moe.weight1", 0, (1, 0), True),)
    )
    ungroup = ModelMap((Unstack(r"moe\.weight1", "model.layers.{expert}.feed_forward.w1.weight", 0, (1, 0), "n"),))
    grouped, back = tmp_path / "grouped", tmp_path / "back"
    api.transform(
        str(d / "ckpt_8ranks"),
        str(grouped),
        str(d / "strategy_8"),
        None,
        tensors=api.TensorOptions(names=NameOptions(model_map=group)),
    )
    want = np.concatenate([full[f"model.layers.{n}.feed_forward.w1.weight"].T for n in range(layers)], 0)
    np.testing.assert_array_equal(load(grouped)["moe.weight1"], want)
    ungroup = ModelMap(ungroup.ops, {"n": layers})
    api.transform(
        str(grouped / "rank_0"), str(back), None, None, tensors=api.TensorOptions(names=NameOptions(model_map=ungroup))
    )
    got = load(back)
    assert set(got) == set(full)
    for name, value in full.items():
        np.testing.assert_array_equal(got[name], value)


def test_hugging_face_folder_mapped_then_sliced_for_a_strategy(
    d: Path, tmp_path: Path, full: dict[str, np.ndarray]
) -> None:
    """A Hugging Face model: the map comes first, then the destination strategy slices its outputs."""
    hf, plain, mapped = tmp_path / "hf", tmp_path / "plain", tmp_path / "mapped"
    strategy = str(d / "merged" / "dst_strategy.ckpt")
    api.convert(str(d / "full" / "model.ckpt"), str(hf), api.OutputSpec(format="hf", max_shard_size="300KB"))
    join = ModelMap((Join((r"(.*)\.w1\.weight", r"(.*)\.w3\.weight"), r"\1.w13.weight", 0),), name="join")
    api.transform(str(hf), str(plain), None, strategy)
    report = api.transform(
        str(hf), str(mapped), None, strategy, tensors=api.TensorOptions(names=NameOptions(model_map=join))
    )
    assert report.names is not None and {op for op, _, _ in report.names.surgery} == {"join"}
    for rank in range(4):
        got, want = load(mapped / f"rank_{rank}"), load(plain / f"rank_{rank}")
        for name, value in got.items():
            if name.endswith("w13.weight"):
                base = name[: -len("w13.weight")]
                np.testing.assert_array_equal(
                    value, np.concatenate([full[base + "w1.weight"], full[base + "w3.weight"]])
                )
            else:
                np.testing.assert_array_equal(value, want[name])
        assert {n for n in want if not n.endswith(("w1.weight", "w3.weight"))} <= set(got)


def test_auto_transform_keys_its_cache_by_the_filters(d: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    common = [str(d / "ckpt_8ranks"), "--dst-strategy", str(d / "strategy_4"), "--src-strategy", str(d / "strategy_8")]
    common += ["--cache-dir", str(cache), "--rank-id", "0", "--quiet"]
    plain = run_cli("auto-transform", *common)
    weights = run_cli("auto-transform", *common, "--weights-only")
    assert plain.returncode == 0 and weights.returncode == 0, weights.stderr
    a, b = plain.stdout.strip(), weights.stdout.strip()
    assert os.path.dirname(os.path.dirname(a)) != os.path.dirname(os.path.dirname(b))  # two cache entries
    assert any(n.startswith("adam_") for n in open_checkpoint(a).entries)
    assert not any(n.startswith(STATE) for n in open_checkpoint(b).entries)
    entry = json.loads((Path(b).parent.parent / "entry.json").read_text())
    assert entry["names"]["weights_only"] is True


SURGERY_YAML = r"""
config: {heads: 4}
rules:
  - op: join
    inputs: ['(.*)\.wq\.weight', '(.*)\.wk\.weight', '(.*)\.wv\.weight']
    output: '\1.wqkv.weight'
    axis: 0
    groups: heads
  - {op: stack, match: 'model\.layers\.(?P<expert>\d+)\.attention\.wo\.weight', output: stacked.wo, axis: 1}
  - {op: stack, match: 'model\.layers\.(?P<expert>\d+)\.feed_forward\.w2\.weight', output: stacked.w2}
  - {match: 'model\.(.*)', replace: 'm.\1'}
"""


def test_a_rules_file_with_surgery_ops(d: Path, tmp_path: Path, full: dict[str, np.ndarray]) -> None:
    rules = tmp_path / "surgery.yaml"
    rules.write_text(SURGERY_YAML)
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(d / "ckpt_8ranks"), "--src-strategy", str(d / "strategy_8"), "--dst", str(out),
        "--output-format", "safetensors", "--rename", str(rules), "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: not even the name report
    check_surgery(load(out), full)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[{op: shuffle, match: a}]", "unknown op 'shuffle'"),
        ("[{op: split, match: a, outputs: [b, c], axis: 0}]", "(split) lacks sizes"),
        ("[{op: stack, match: a, output: b, colour: red}]", "unknown keys colour"),
        ("[{op: join, inputs: ['('], output: b, axis: 0}]", "bad regular expression"),
        ("[{op: unstack, match: a, output: b, fold: true}]", "unknown keys fold"),
        ("[{op: transpose, match: a, replace: b, perm: one}]", "perm must be a list of integers"),
        ("{rules: [{match: a, replace: b}], config: [1]}", "config is a mapping"),
    ],
)
def test_bad_surgery_rules(tmp_path: Path, text: str, message: str) -> None:
    from reshard.naming import parse_map

    with pytest.raises(UsageError, match=re.escape(message)):
        parse_map(text, "rules.yaml")
