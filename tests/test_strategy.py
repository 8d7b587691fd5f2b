"""Unit tests of strategy files: byte vectors, round trips, list maps, layout map, merge, errors."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import FormatError, LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.formats.strategy import (
    DEFAULT_OP_NAME,
    MERGED_CURRENT_STAGE,
    StrategyFile,
    StrategyItem,
    encode_strategy,
    find_strategy_files,
    load_strategy,
    make_strategy,
    merge_pipeline_strategies,
    merge_strategy_files,
    message_classes,
    read_strategy,
    write_strategy,
)
from reshard.layout import ParamLayout, StagedLayout, device_num, layout_map, split_stage_name, stage_count

# docs/formats.md §8.1: current_stage=0, op "op" stage 0 strategy [2,1], param w dev [2] tmap [0,-1].
MINIMAL_VECTOR = bytes.fromhex(
    "0800120e0a026f70120808001204080208011a220a0177121d0a020802120d080008ffffffffffffffffff011a002200280030003800"
)


def minimal() -> StrategyFile:
    return make_strategy({"w": ParamLayout((2,), (0, -1))}, ops={"op": [[2, 1]]}, current_stage=0)


def p1_stages() -> tuple[StrategyFile, StrategyFile]:
    """docs/formats.md §8.2 P1: a shared embedding with a different layout in each of two stages."""
    s0 = make_strategy({"emb": ParamLayout((2,), (0, -1)), "w0": ParamLayout((2,), (-1, 0))}, stage=0)
    s1 = make_strategy({"emb": ParamLayout((2,), (-1, 0)), "w1": ParamLayout((2,), (0, -1))}, stage=1)
    return s0, s1


def write_stages(directory: Path, files: dict[str, StrategyFile]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, sf in files.items():
        write_strategy(directory / name, sf)
    return directory


def content(sf: StrategyFile) -> tuple:
    """Everything but the path (and the format, which follows the file name)."""
    return sf.current_stage, sf.strategy_items, sf.layouts, sf.tensor_shapes


# ------------------------------------------------------------------ byte vector and round trips


def test_minimal_vector_is_byte_identical(tmp_path: Path) -> None:
    assert encode_strategy(minimal()) == MINIMAL_VECTOR
    write_strategy(tmp_path / "s.ckpt", minimal())
    assert (tmp_path / "s.ckpt").read_bytes() == MINIMAL_VECTOR


def test_minimal_vector_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "s.ckpt"
    path.write_bytes(MINIMAL_VECTOR)
    sf = read_strategy(path)
    assert sf.path == str(path) and sf.format == "protobuf" and sf.current_stage == 0
    assert sf.strategy_items == [StrategyItem("op", 0, [[2, 1]])]
    assert sf.layouts == {"w": ParamLayout((2,), (0, -1))}
    assert sf.stage == 0


def test_written_file_is_not_private(tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "s.ckpt"
    write_strategy(path, minimal())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~_umask()
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o777 & ~_umask()
    assert [p.name for p in path.parent.iterdir()] == ["s.ckpt"]  # no temporary file left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_message_classes_live_in_a_private_pool() -> None:
    from google.protobuf import descriptor_pool

    cls = message_classes()["ParallelStrategyMap"]
    assert cls.DESCRIPTOR.full_name == "mindspore.straspb.ParallelStrategyMap"
    assert cls.DESCRIPTOR.file.pool is not descriptor_pool.Default()
    assert cls.DESCRIPTOR.file.name == "node_strategy.proto"


def test_make_strategy_defaults() -> None:
    sf = make_strategy({"w": ParamLayout((2,), (0,))}, stage=3)
    assert sf.stage == 3 and sf.current_stage == 1 and sf.path is None and sf.format == "protobuf"
    assert sf.strategy_items == [StrategyItem(DEFAULT_OP_NAME, 3, [[1]])]
    assert make_strategy({}).stage == 0
    assert StrategyFile(None, "json", 0, [], {}).stage is None


entries = st.integers(-1, 3)
flat_maps = st.lists(entries, min_size=0, max_size=4).map(tuple)
list_maps = st.lists(
    st.one_of(entries, st.lists(entries, min_size=1, max_size=3).map(tuple)), min_size=1, max_size=4
).map(tuple)
layouts_st = st.builds(
    ParamLayout,
    dev_matrix=st.lists(st.integers(1, 8), min_size=1, max_size=4).map(tuple),
    tensor_map=st.one_of(flat_maps, list_maps),
    opt_shard_step=st.integers(-1, 8),
    opt_shard_size=st.integers(-1, 8),
    field=st.integers(0, 4),
    split_shape=st.lists(st.integers(0, 2**40), max_size=3).map(tuple),
    indices_offset=st.lists(st.integers(0, 2**40), max_size=3).map(tuple),
)
names = st.text(st.characters(blacklist_characters="-", blacklist_categories=("Cs",)), min_size=1, max_size=8)


def canonical(layout: ParamLayout) -> ParamLayout:
    """What reading gives back: a list map with every entry an int is stored flat."""
    if not layout.is_list_map:
        return layout
    tmap = tuple(e if isinstance(e, tuple) else (e,) for e in layout.tensor_map)
    return ParamLayout(**{**layout.__dict__, "tensor_map": tmap})


@settings(max_examples=60, deadline=None)
@given(
    layouts=st.dictionaries(names, layouts_st, max_size=5),
    stage=st.integers(0, 7),
    ops=st.dictionaries(names, st.lists(st.lists(st.integers(1, 8), max_size=3), max_size=3), max_size=3),
)
def test_protobuf_round_trip(tmp_path_factory: pytest.TempPathFactory, layouts, stage, ops) -> None:
    path = tmp_path_factory.mktemp("rt") / "s.ckpt"
    sf = make_strategy(layouts, stage=stage, ops=ops or None)
    write_strategy(path, sf)
    back = read_strategy(path)
    assert back.layouts == {k: canonical(v) for k, v in layouts.items()}
    assert back.strategy_items == sf.strategy_items
    assert list(back.layouts) == list(layouts)
    assert encode_strategy(back) == path.read_bytes()


@settings(max_examples=40, deadline=None)
@given(
    layouts=st.dictionaries(names, layouts_st.filter(lambda lay: not lay.is_list_map), max_size=5),
    stage=st.integers(0, 7),
    with_shapes=st.booleans(),
)
def test_json_round_trip(tmp_path_factory: pytest.TempPathFactory, layouts, stage, with_shapes) -> None:
    path = tmp_path_factory.mktemp("rt") / "s.json"
    shapes = {k: (4,) * len(v.tensor_map) for k, v in layouts.items()} if with_shapes else None
    sf = make_strategy(layouts, stage=stage, tensor_shapes=shapes)
    write_strategy(path, sf)
    back = read_strategy(path)
    assert back.format == "json"
    assert content(back) == content(sf)
    assert list(back.layouts) == list(layouts)
    assert encode_strategy(back, "json") == path.read_bytes()


def test_json_layout_of_split_params(tmp_path: Path) -> None:
    lay = ParamLayout((2,), (0, -1), split_shape=(1, 3), indices_offset=(0, 1))
    sf = make_strategy({"w": lay, "v": ParamLayout((2,), (-1,))}, tensor_shapes={"w": [4, 4]})
    obj = json.loads(encode_strategy(sf, "json"))
    assert obj["parallel_layout_item"] == {
        "w": {
            "dev_matrix": [2],
            "tensor_map": [0, -1],
            "tensor_shape": [4, 4],
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
            "param_split_shape": [1, 3],
            "indices_offset": [0, 1],
        },
        "v": {
            "dev_matrix": [2],
            "tensor_map": [-1],
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
        },
    }


def test_format_argument_overrides_extension(tmp_path: Path) -> None:
    write_strategy(tmp_path / "s.strategy", minimal(), format="json")
    assert json.loads((tmp_path / "s.strategy").read_text())["current_stage"] == 0
    with pytest.raises(UsageError, match="unknown strategy format"):
        write_strategy(tmp_path / "s.ckpt", minimal(), format="yaml")


# ------------------------------------------------------------------ list maps


def parsed(data: bytes):
    msg = message_classes()["ParallelStrategyMap"]()
    msg.ParseFromString(data)
    return msg


def test_list_map_writes_one_tensor_map_per_dim() -> None:
    sf = make_strategy({"w": ParamLayout((2, 2, 2), ((2, 1), -1))})
    maps = parsed(encode_strategy(sf)).parallel_layout_item[0].parallel_layouts.tensor_map
    assert [list(m.dim) for m in maps] == [[2, 1], [-1]]


def test_list_map_1d_gets_extra_empty_tensor_map(tmp_path: Path) -> None:
    sf = make_strategy({"b": ParamLayout((2, 2), ((1, 0),))})
    maps = parsed(encode_strategy(sf)).parallel_layout_item[0].parallel_layouts.tensor_map
    assert [list(m.dim) for m in maps] == [[1, 0], []]
    write_strategy(tmp_path / "s.ckpt", sf)
    assert read_strategy(tmp_path / "s.ckpt").layouts["b"].tensor_map == ((1, 0),)


def test_list_map_single_axis_entries_stay_tuples(tmp_path: Path) -> None:
    """Several TensorMaps -> tuple of tuples (1-tuples kept); a 1-D list map of one axis too."""
    sf = make_strategy({"w": ParamLayout((4,), ((0,), (-1,))), "b": ParamLayout((4,), ((0,),))})
    write_strategy(tmp_path / "s.ckpt", sf)
    got = read_strategy(tmp_path / "s.ckpt").layouts
    assert got["w"].tensor_map == ((0,), (-1,)) and got["b"].tensor_map == ((0,),)


def test_list_map_cannot_be_json(tmp_path: Path) -> None:
    sf = make_strategy({"w": ParamLayout((2, 2), ((1, 0), -1))})
    with pytest.raises(UnsupportedError, match="list tensor map"):
        write_strategy(tmp_path / "s.json", sf)
    assert not any(tmp_path.iterdir())


def test_list_map_empty_entry_is_refused() -> None:
    with pytest.raises(LayoutError, match="entry is empty"):
        encode_strategy(make_strategy({"w": ParamLayout((2,), ((), (0,)))}))


# ------------------------------------------------------------------ layout map (P1) and stages


def test_p1_merge_and_layout_map(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    src = write_stages(tmp_path / "src", {"stage0.ckpt": s0, "stage1.ckpt": s1})
    merged_path = merge_pipeline_strategies(src, tmp_path / "out" / "merged.ckpt")
    merged = read_strategy(merged_path)
    assert list(merged.layouts) == ["0-emb", "0-w0", "1-emb", "1-w1"]
    assert merged.current_stage == MERGED_CURRENT_STAGE == 1
    lmap = layout_map(merged)
    assert list(lmap) == ["emb", "w0", "w1"]
    assert lmap["emb"] == StagedLayout(s0.layouts["emb"], (0, 1))
    assert lmap["w0"].stages == (0,) and lmap["w1"].stages == (1,)
    assert stage_count(merged) == 2 and device_num(merged) == 2
    # rank-aware: ranks 0,1 (rank // 2 == 0) keep stage 0's layout, ranks 2,3 stage 1's
    for rank, stage_layout in [(0, s0), (1, s0), (2, s1), (3, s1), (7, s1)]:
        assert layout_map(merged, rank)["emb"].layout == stage_layout.layouts["emb"]


def test_layout_map_duplicate_rules() -> None:
    lay = {s: ParamLayout((2,), (s,)) for s in range(4)}
    big = ParamLayout((8,), (9,))
    # first item stage 2, then 1, then 3: without rank the smallest stage wins
    sf = make_strategy({"2-e": lay[2], "1-e": lay[1], "3-e": lay[3]})
    assert layout_map(sf)["e"] == StagedLayout(lay[1], (2, 1, 3))
    # with rank: rank // n uses the dev matrix of the later occurrence; last stage > 0 wins
    assert layout_map(sf, 0)["e"].layout == lay[2]  # no stage 0 anywhere: the first one stays
    assert layout_map(sf, 2)["e"].layout == lay[3]
    sf = make_strategy({"1-e": lay[1], "0-e": lay[0], "2-e": big})
    assert layout_map(sf, 1)["e"].layout == lay[0]
    assert layout_map(sf, 3)["e"].layout == lay[1]  # 3 // 2 > 0 keeps stage 1; 3 // 8 == 0 skips big
    assert layout_map(sf, 9)["e"].layout == big
    # an unprefixed name is stage 0 and counts as a duplicate of "0-x"
    sf = make_strategy({"x": lay[0], "0-x": lay[1]})
    assert layout_map(sf)["x"] == StagedLayout(lay[1], (0, 0))


def test_split_stage_name() -> None:
    assert split_stage_name("12-model.w") == (12, "model.w")
    assert split_stage_name("model.w") == (0, "model.w")
    for bad in ["a-b", "0-a-b", "-x", "1-", "+1-x"]:
        with pytest.raises(LayoutError, match="cannot be used"):
            split_stage_name(bad, "f.ckpt")


def test_layout_map_bad_names() -> None:
    sf = make_strategy({"0-a-b": ParamLayout((2,), (0,))})
    sf.path = "s.ckpt"
    with pytest.raises(LayoutError, match=r"^s\.ckpt: parameter name '0-a-b'"):
        layout_map(sf)


def test_stage_count_and_device_num_errors() -> None:
    gap = make_strategy({"0-a": ParamLayout((2,), (0,)), "2-b": ParamLayout((2,), (0,))})
    with pytest.raises(LayoutError, match=r"stages \[0, 2\]"):
        stage_count(gap)
    with pytest.raises(LayoutError, match="no parameter layouts"):
        stage_count(make_strategy({}))
    with pytest.raises(LayoutError, match="no parameter layouts"):
        device_num(make_strategy({}))
    with pytest.raises(LayoutError, match="empty device matrix"):
        device_num(make_strategy({"a": ParamLayout((), (0,))}))
    assert device_num(make_strategy({"a": ParamLayout((2, 4), (0,)), "b": ParamLayout((16,), (0,))})) == 8
    with pytest.raises(LayoutError, match="zero dimension"):
        layout_map(make_strategy({"0-a": ParamLayout((2,), (0,)), "1-a": ParamLayout((0,), (0,))}), 1)


def test_duplicate_names_in_file_keep_first_position_last_value(tmp_path: Path) -> None:
    msg = parsed(encode_strategy(make_strategy({"a": ParamLayout((2,), (0,)), "b": ParamLayout((2,), (-1,))})))
    extra = msg.parallel_layout_item.add()
    extra.CopyFrom(msg.parallel_layout_item[0])
    extra.parallel_layouts.dev_matrix[0].dim[0] = 4
    (tmp_path / "d.ckpt").write_bytes(msg.SerializeToString())
    sf = read_strategy(tmp_path / "d.ckpt")
    assert list(sf.layouts) == ["a", "b"] and sf.layouts["a"].dev_matrix == (4,)


# ------------------------------------------------------------------ merge


def test_merge_order_is_sorted_names(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    src = write_stages(tmp_path / "src", {"b.ckpt": s0, "a.ckpt": s1})
    assert find_strategy_files(src) == [str(src / "a.ckpt"), str(src / "b.ckpt")]
    merged = read_strategy(merge_pipeline_strategies(src, tmp_path / "m.ckpt"))
    assert list(merged.layouts) == ["1-emb", "1-w1", "0-emb", "0-w0"]
    assert layout_map(merged)["emb"].stages == (1, 0)
    assert layout_map(merged)["emb"].layout == s0.layouts["emb"]  # smallest stage wins


def test_merge_skips_identical_files_and_second_file_of_a_stage(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    other0 = make_strategy({"zzz": ParamLayout((2,), (0,))}, stage=0)
    plain = write_stages(tmp_path / "plain", {"a.ckpt": s0, "b.ckpt": s1})
    noisy = write_stages(tmp_path / "noisy", {"a.ckpt": s0, "a_copy.ckpt": s0, "b.ckpt": s1, "c.ckpt": other0})
    expected = merge_strategy_files(find_strategy_files(plain))
    assert merge_strategy_files(find_strategy_files(noisy)) == expected
    merge_pipeline_strategies(noisy, tmp_path / "m.ckpt")
    assert (tmp_path / "m.ckpt").read_bytes() == expected[1]


def test_merge_protobuf_bytes_concatenate_items(tmp_path: Path) -> None:
    """Merged bytes = current_stage 1, every strategy item, every renamed layout item, in order."""
    s0, s1 = p1_stages()
    src = write_stages(tmp_path / "src", {"a.ckpt": s0, "b.ckpt": s1})
    fmt, data = merge_strategy_files(find_strategy_files(src))
    assert fmt == "protobuf"
    expected = StrategyFile(
        None,
        "protobuf",
        1,
        s0.strategy_items + s1.strategy_items,
        {f"{sf.stage}-{k}": v for sf in (s0, s1) for k, v in sf.layouts.items()},
    )
    assert data == encode_strategy(expected)


def test_merge_json_text(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    s0.strategy_items.append(StrategyItem("shared_op", 0, [[1]]))
    s1.strategy_items.append(StrategyItem("shared_op", 1, [[2]]))
    s0.tensor_shapes["emb"] = (8, 4)
    src = write_stages(tmp_path / "src", {"a.json": s0, "b.json": s1})
    raw = json.loads((src / "a.json").read_text())
    raw["parallel_layout_item"]["w0"]["extra_key"] = [1]  # unknown keys pass through
    raw["parallel_out_strategy_item"] = {"x": 1}  # unknown top-level keys are dropped
    (src / "a.json").write_text(json.dumps(raw))
    out = merge_pipeline_strategies(src, tmp_path / "out" / "m.json")
    text = Path(out).read_text()
    obj = json.loads(text)
    assert text == json.dumps(obj)  # json.dump default separators, no indent
    assert list(obj) == ["current_stage", "parallel_strategy_item", "parallel_layout_item"]
    assert obj["current_stage"] == 1
    assert obj["parallel_strategy_item"] == {
        DEFAULT_OP_NAME: {"stage": 1, "parallel_strategy": [[1]]},
        "shared_op": {"stage": 1, "parallel_strategy": [[2]]},
    }
    assert list(obj["parallel_layout_item"]) == ["0-emb", "0-w0", "1-emb", "1-w1"]
    assert obj["parallel_layout_item"]["0-w0"]["extra_key"] == [1]
    assert obj["parallel_layout_item"]["0-emb"]["tensor_shape"] == [8, 4]
    merged = read_strategy(out)
    assert merged.format == "json" and stage_count(merged) == 2


def test_merge_never_merges_its_own_output(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    src = write_stages(tmp_path / "src", {"a.ckpt": s0, "b.ckpt": s1})
    first = Path(merge_pipeline_strategies(src, src / "merged.ckpt")).read_bytes()
    again = Path(merge_pipeline_strategies(src, src / "merged.ckpt")).read_bytes()  # no "0-0-emb"
    assert first == again
    assert sorted(p.name for p in src.iterdir()) == ["a.ckpt", "b.ckpt", "merged.ckpt"]
    # a stale merged file under another name is passed over (with a note), never merged
    (src / "old_merged.ckpt").write_bytes(first)
    notes: list[str] = []
    assert Path(merge_pipeline_strategies(src, tmp_path / "m.ckpt", notes)).read_bytes() == first
    assert notes == [
        "ignored merged.ckpt: the per-stage files were used",
        "ignored old_merged.ckpt: the per-stage files were used",
    ]
    # merged files alone are refused clearly rather than merged
    alone = write_stages(tmp_path / "alone", {})
    (alone / "old_merged.ckpt").write_bytes(first)
    (alone / "other_merged.ckpt").write_bytes(first)
    with pytest.raises(FormatError, match=r"contains '-'.*already merged"):
        merge_pipeline_strategies(alone, tmp_path / "m2.ckpt")


def test_merge_output_directory_is_created_with_normal_mode(tmp_path: Path) -> None:
    s0, _ = p1_stages()
    src = write_stages(tmp_path / "src", {"a.ckpt": s0})
    out = tmp_path / "new" / "m.ckpt"
    assert merge_pipeline_strategies(src, out) == str(out)
    assert stat.S_IMODE(os.stat(out.parent).st_mode) == 0o777 & ~_umask()


def test_load_strategy_merges_directories_in_memory(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    for ext in ("ckpt", "json"):
        src = write_stages(tmp_path / ext, {f"a.{ext}": s0, f"b.{ext}": s1})
        before = sorted(os.listdir(src))
        in_memory = load_strategy(src)
        assert sorted(os.listdir(src)) == before
        on_disk = read_strategy(merge_pipeline_strategies(src, tmp_path / f"m.{ext}"))
        assert content(in_memory) == content(on_disk)
        assert in_memory.path == str(src) and in_memory.format == on_disk.format
        assert content(load_strategy(src / f"a.{ext}")) == content(read_strategy(src / f"a.{ext}"))


# ------------------------------------------------------------------ bad input


def _check(exc_type: type[ReshardError], path: Path, match: str, func=read_strategy) -> None:
    with pytest.raises(exc_type, match=match) as info:
        func(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "missing required fields: current_stage"),
        (b"\xff\xff\xff", "not a protobuf strategy file"),
        (b"\x08\x01\x1a\x02\x0a\x00", "missing required fields: parallel_layout_item"),
        (b"\x08\x01\x1a\x07\x0a\x01w\x12\x02\x28\x00", "missing required fields"),
        (MINIMAL_VECTOR[:-3], "not a protobuf strategy file|missing required"),
    ],
)
def test_bad_protobuf(tmp_path: Path, data: bytes, match: str) -> None:
    (tmp_path / "s.ckpt").write_bytes(data)
    _check(FormatError, tmp_path / "s.ckpt", match)


def test_protobuf_layout_without_dev_matrix(tmp_path: Path) -> None:
    msg = parsed(MINIMAL_VECTOR)
    del msg.parallel_layout_item[0].parallel_layouts.dev_matrix[:]
    (tmp_path / "s.ckpt").write_bytes(msg.SerializeToString())
    _check(FormatError, tmp_path / "s.ckpt", "has no dev_matrix")


GOOD_LAYOUT = {"dev_matrix": [2], "tensor_map": [0], "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}


def _json_with(layout: dict | None = None, **top) -> str:
    obj = {"current_stage": 0, "parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": [[2]]}}}
    obj["parallel_layout_item"] = {"w": layout if layout is not None else GOOD_LAYOUT}
    obj.update(top)
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not a JSON strategy file"),
        ("[1, 2]", "must hold an object"),
        ("\xff", "not a JSON strategy file"),
        (json.dumps({"current_stage": 0}), "missing parallel_layout_item"),
        (_json_with(parallel_layout_item=[1]), "parallel_layout_item must be an object"),
        (_json_with(parallel_strategy_item=[1]), "parallel_strategy_item must be an object"),
        (_json_with(parallel_strategy_item={"op": {"parallel_strategy": []}}), "has no stage"),
        (_json_with(parallel_strategy_item={"op": {"stage": 1.0}}), "op.stage must be an integer"),
        (_json_with(parallel_strategy_item={"op": {"stage": 0, "parallel_strategy": [["2"]]}}), "list of int"),
        (_json_with(parallel_strategy_item={"op": {"stage": 0, "parallel_strategy": 3}}), "list of lists"),
        (_json_with(current_stage="1"), "current_stage must be an integer"),
        (_json_with([1]), "layout of 'w' must be an object"),
        (_json_with({**GOOD_LAYOUT, "field": None}), "w.field must be an integer"),
        (_json_with({**GOOD_LAYOUT, "opt_weight_shard_size": True}), "opt_weight_shard_size must be an integer"),
        (_json_with({k: v for k, v in GOOD_LAYOUT.items() if k != "dev_matrix"}), "has no dev_matrix"),
        (_json_with({k: v for k, v in GOOD_LAYOUT.items() if k != "field"}), "has no field"),
        (_json_with({**GOOD_LAYOUT, "dev_matrix": [2.0]}), "dev_matrix must be a list of integers"),
        (_json_with({**GOOD_LAYOUT, "tensor_map": [[0], [-1]]}), "flat tensor maps only"),
        (_json_with({**GOOD_LAYOUT, "tensor_map": 0}), "tensor_map must be a list"),
        (_json_with({**GOOD_LAYOUT, "tensor_shape": "4x4"}), "tensor_shape must be a list"),
        (_json_with({**GOOD_LAYOUT, "param_split_shape": [1, "2"]}), "param_split_shape must be a list"),
    ],
)
def test_bad_json(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "s.json").write_text(text, encoding="latin-1")
    _check(FormatError, tmp_path / "s.json", match)


def test_json_optional_parts(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps({"parallel_layout_item": {"w": GOOD_LAYOUT}}))
    sf = read_strategy(tmp_path / "s.json")
    assert sf.current_stage == 0 and sf.strategy_items == [] and sf.stage is None
    assert sf.layouts == {"w": ParamLayout((2,), (0,))}


def test_read_missing_or_directory(tmp_path: Path) -> None:
    _check(FormatError, tmp_path / "nope.ckpt", "cannot read strategy file")
    _check(UsageError, tmp_path, "is a directory")
    _check(FormatError, tmp_path / "nope", "cannot read strategy file", func=load_strategy)


def test_write_refuses_unstorable_values(tmp_path: Path) -> None:
    for lay in [ParamLayout((-2,), (0,)), ParamLayout((2,), (2**31,)), ParamLayout((2,), (0,), field=2**40)]:
        with pytest.raises(LayoutError, match="cannot store strategy"):
            write_strategy(tmp_path / "s.ckpt", make_strategy({"w": lay}))
    assert not any(tmp_path.iterdir())
    (tmp_path / "d.ckpt").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        write_strategy(tmp_path / "d.ckpt", minimal())


def test_merge_errors(tmp_path: Path) -> None:
    s0, s1 = p1_stages()
    _check(UsageError, tmp_path / "missing", "not a directory", func=find_strategy_files)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    (tmp_path / "empty" / "sub.ckpt").mkdir()
    _check(UsageError, tmp_path / "empty", "no strategy files", func=find_strategy_files)
    mixed = write_stages(tmp_path / "mixed", {"a.ckpt": s0, "b.json": s1})
    _check(UsageError, mixed, r"all \.ckpt or all \.json", func=find_strategy_files)
    _check(UsageError, mixed, r"all \.ckpt or all \.json", func=load_strategy)
    with pytest.raises(UsageError, match=r"all \.ckpt or all \.json"):
        merge_strategy_files([mixed / "a.ckpt", mixed / "b.json"])
    with pytest.raises(UsageError, match="no strategy files"):
        merge_strategy_files([])
    for ext in ("ckpt", "json"):
        no_ops = write_stages(tmp_path / f"noops_{ext}", {f"a.{ext}": make_strategy(s0.layouts, ops={})})
        _check(FormatError, no_ops / f"a.{ext}", "strategy file is empty", func=lambda p: merge_strategy_files([p]))
        no_layouts = write_stages(tmp_path / f"nolay_{ext}", {f"a.{ext}": make_strategy({})})
        _check(FormatError, no_layouts / f"a.{ext}", "strategy file is empty", func=load_strategy_dir)
        dashed = make_strategy({"layer-1.w": ParamLayout((2,), (0,))})
        dashed_dir = write_stages(tmp_path / f"dash_{ext}", {f"a.{ext}": dashed})
        _check(FormatError, dashed_dir / f"a.{ext}", "'layer-1.w' contains '-'", func=load_strategy_dir)
        broken = tmp_path / f"broken_{ext}"
        broken.mkdir()
        (broken / f"a.{ext}").write_bytes(b"\xff{")
        _check(FormatError, broken / f"a.{ext}", "not a", func=load_strategy_dir)
    src = write_stages(tmp_path / "ok", {"a.ckpt": s0})
    with pytest.raises(UsageError, match=r"must not end with \.json"):
        merge_pipeline_strategies(src, tmp_path / "m.json")
    src = write_stages(tmp_path / "okj", {"a.json": s0})
    with pytest.raises(UsageError, match=r"must end with \.json"):
        merge_pipeline_strategies(src, tmp_path / "m.ckpt")
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m.ckpt").exists()


def load_strategy_dir(file_in_dir: Path) -> StrategyFile:
    return load_strategy(file_in_dir.parent)
