"""``reshard.mindspore.parallel`` without MindSpore: the one-import switch, the package layout that
keeps every old import working, ``Parameter``, refusals and bad input (one-line ``ReshardError``s,
nothing written, inputs untouched). The comparisons with MindSpore are in
``tests/test_ms_parallel_oracle.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import reshard.mindspore as ms
import reshard.mindspore.parallel as rmp
from reshard import demo
from reshard.errors import FormatError, LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L
from tests.msjobs import tree_files
from tests.oracle import ROOT

PYTHON_API = ROOT / "docs" / "python-api.md"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("demo") / "demo"
    demo.main(str(folder))
    return folder


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


# --------------------------------------------------------------------------------------------
# the switch with one import

# A MindSpore script as users write it; only its import line changes.
MINDSPORE_SCRIPT = """
from mindspore.parallel import (build_searched_strategy, convert_checkpoint_by_rank, convert_checkpoints,
                                load_segmented_checkpoints, rank_list_for_convert)

src, dst = "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt"
convert_checkpoints("demo/ckpt_8ranks", "converted", "checkpoint_", src, dst)
for rank in range(4):
    ranks = rank_list_for_convert(rank, src, dst)
    files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in ranks}
    convert_checkpoint_by_rank(rank, files, f"by_rank/rank_{rank}/checkpoint_{rank}.ckpt", src, dst)
params = load_segmented_checkpoints("converted/rank_0")
print(len(build_searched_strategy(dst)), len(params))
"""


def test_a_mindspore_script_runs_with_one_import_changed(demo_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "demo").symlink_to(demo_dir)
    before = tree_files(str(demo_dir))
    script = MINDSPORE_SCRIPT.replace("from mindspore.parallel import", "from reshard.mindspore.parallel import")
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert tree_files(str(demo_dir)) == before, "the demo's files must not change"
    # the same files as the top-level drop-in's transform_checkpoints / transform_checkpoint_by_rank
    ms.transform_checkpoints(
        str(demo_dir / "ckpt_8ranks"),
        str(tmp_path / "reference"),
        "checkpoint_",
        str(demo_dir / "merged/src_strategy.ckpt"),
        str(demo_dir / "merged/dst_strategy.ckpt"),
    )
    assert tree_files(str(tmp_path / "converted")) == tree_files(str(tmp_path / "reference"))
    assert tree_files(str(tmp_path / "by_rank")) == tree_files(str(tmp_path / "reference"))
    strategies, params = proc.stdout.split()
    assert int(strategies) > 0 and int(params) > 0


def test_the_python_api_page_example_runs(demo_dir: Path, tmp_path: Path) -> None:
    text = PYTHON_API.read_text(encoding="utf-8")
    block = text.split("`reshard.mindspore.parallel` mirrors", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "demo").symlink_to(demo_dir)
    proc = _run(block, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "ms_4ranks")) == [f"rank_{r}" for r in range(4)]


def test_old_import_paths_and_ms_parallel_work() -> None:
    code = textwrap.dedent(
        """
        import reshard.mindspore
        from reshard import mindspore as ms
        from reshard.mindspore import (build_searched_strategy, ckpt_to_safetensors, load_checkpoint,
            load_distributed_checkpoint, merge_pipeline_strategys, rank_list_for_transform, safetensors_to_ckpt,
            save_checkpoint, transform_checkpoint_by_rank, transform_checkpoints, unified_safetensors)
        assert ms.parallel.convert_checkpoints  # as ms.parallel works after `import mindspore as ms`
        assert ms.parallel.transform_checkpoints is ms.transform_checkpoints
        import reshard.mindspore.parallel as p
        assert p is ms.parallel
        print("ok")
        """
    )
    proc = _run(code, ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_shared_names_are_the_same_objects() -> None:
    for name in rmp.__all__:
        if hasattr(ms, name):
            assert getattr(ms, name) is getattr(rmp, name), name
    assert rmp.convert_checkpoints is not rmp.transform_checkpoints  # its own name and docstring, as in MindSpore


# --------------------------------------------------------------------------------------------
# what needs a running job


def test_functions_that_need_a_running_job_raise_unsupported() -> None:
    for call in (
        lambda: rmp.sync_pipeline_shared_parameters(object()),
        lambda: rmp.sync_pipeline_shared_parameters(None),
        lambda: rmp.set_op_strategy_config(),
        lambda: rmp.set_op_strategy_config("LOAD", "/tmp/x.json"),
    ):
        with pytest.raises(UnsupportedError, match="reshard has no"):
            call()


# MindSpore 2.10's public names of mindspore.parallel (dir()) that reshard does not provide
# (tests/test_ms_parallel_oracle.py checks the list against MindSpore), and a word of what each message offers.
NOT_PROVIDED = {
    "shard": "build_searched_strategy",
    "Layout": "strategy files",
    "parameter_broadcast": "transform_checkpoints",
    "set_algo_parameters": "no parallel context",
    "get_algo_parameters": "no parallel context",
    "reset_algo_parameters": "no parallel context",
    "algo_parameter_config": "no parallel context",
    "nn": "no networks",
    "function": "transform_checkpoints",
    "data_access_adapter": "reads files itself",
    "checkpoint_transform": "import its checkpoint functions from it directly",
    "checkpoint_convert": "import its checkpoint functions from it directly",
    "transform_safetensors": "import its checkpoint functions from it directly",
}


@pytest.mark.parametrize("name", sorted(NOT_PROVIDED))
def test_not_mirrored_names_say_they_are_not_supported(name: str) -> None:
    """``from reshard.mindspore.parallel import shard`` raises reshard's error, not a bare ImportError."""
    with pytest.raises(UnsupportedError) as info:
        exec(f"from reshard.mindspore.parallel import {name}", {})
    message = str(info.value)
    assert message.startswith(f"mindspore.parallel.{name} is not supported by reshard: ") and "\n" not in message
    assert NOT_PROVIDED[name] in message
    with pytest.raises(UnsupportedError, match=f"mindspore.parallel.{name} is not supported"):
        getattr(rmp, name)
    assert name not in dir(rmp) and name not in rmp.__all__


def test_unknown_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'transform_chekpoints'"):
        rmp.transform_chekpoints  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'absolute_import'"):
        exec("from reshard.mindspore.parallel import absolute_import", {})  # MindSpore's __future__ leftover
    assert not hasattr(rmp, "__path__") and not hasattr(rmp, "nope")


def test_load_segmented_checkpoints_refuses_a_network(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="no networks"):
        rmp.load_segmented_checkpoints(str(tmp_path), net=object())


# --------------------------------------------------------------------------------------------
# Parameter


def test_parameter_behaves_like_mindspores_for_scripts() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = ms.Parameter(array, "w")
    assert p.data is array and p.asnumpy() is array
    assert (p.name, p.shape, p.dtype, p.requires_grad, p.layerwise_parallel) == ("w", (2, 3), array.dtype, True, False)
    assert repr(p) == "Parameter (name=w, shape=(2, 3), dtype=Float32, requires_grad=True)"
    assert str(ms.Parameter(np.ones(2, ml_dtypes.bfloat16), "b", requires_grad=False)).endswith(
        "dtype=BFloat16, requires_grad=False)"
    )
    first, second = ms.Parameter(array), ms.Parameter(array)
    assert re.fullmatch(r"Parameter#\d+", first.name) and first.name != second.name
    assert ms.Parameter(np.float32(2.5), "s").shape == ()


@pytest.mark.parametrize(
    "args",
    [([1, 2], "w"), (np.ones(2), 3), (np.ones(2), "w", "yes"), (np.ones(2), "w", True, 1)],
)
def test_parameter_bad_input(args: tuple) -> None:
    with pytest.raises(UsageError):
        ms.Parameter(*args)


# --------------------------------------------------------------------------------------------
# merge_sliced_parameter


def test_merge_sliced_parameter_places_blocks_by_rank(tmp_path: Path) -> None:
    full = np.arange(64, dtype=np.float32).reshape(8, 8)
    write_strategy(str(tmp_path / "s.ckpt"), make_strategy({"w": L((2, 2), (0, 1))}))
    strategy = ms.build_searched_strategy(str(tmp_path / "s.ckpt"))
    # dev (2, 2), map (0, 1): rank (a, b) holds rows 4b.., columns 4a.. (docs/formats.md §3.1)
    slices = [ms.Parameter(full[4 * (r % 2) : 4 * (r % 2) + 4, 4 * (r // 2) : 4 * (r // 2) + 4], "w") for r in range(4)]
    merged = rmp.merge_sliced_parameter(slices, strategy)
    assert np.array_equal(merged.asnumpy(), full) and merged.name == "w"


def test_merge_sliced_parameter_keeps_dtypes_but_bf16() -> None:
    halves = [ms.Parameter(np.ones((1, 2), np.float16), "h")] * 2
    assert rmp.merge_sliced_parameter(halves).dtype == np.float16
    bf = [ms.Parameter(np.ones((1, 2), ml_dtypes.bfloat16), "b")] * 2
    assert rmp.merge_sliced_parameter(bf).dtype == np.float32  # as MindSpore


class Named:
    """A slice whose ``data`` is neither a numpy array nor has ``asnumpy()``."""

    def __init__(self, name: str, data: object) -> None:
        self.name, self.data = name, data


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: rmp.merge_sliced_parameter([np.ones(2), np.ones(2)]), UsageError, "wrap arrays"),
        (lambda: rmp.merge_sliced_parameter([Named("w", [1.0, 2.0])]), UsageError, "must be a Parameter"),
        (lambda: rmp.merge_sliced_parameter((ms.Parameter(np.ones(2), "w"),)), UsageError, "must be a list"),
        (lambda: rmp.merge_sliced_parameter([]), UsageError, "not be empty"),
        (lambda: rmp.merge_sliced_parameter([ms.Parameter(np.ones(2), "w")], ["w"]), UsageError, "must be a dict"),
        (lambda: rmp.merge_sliced_parameter([ms.Parameter(np.ones(2), "w")], {"w": 3}), UsageError, "ParallelLayouts"),
        (lambda: rmp.merge_sliced_parameter([ms.Parameter(np.ones(2), "w")], {"v": 3}), UsageError, "not a key"),
        (lambda: rmp.merge_sliced_parameter([ms.Parameter(np.float32(1), "w")] * 2), UsageError, "scalar"),
    ],
)
def test_merge_sliced_parameter_bad_input(call, error: type[ReshardError], words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_merge_with_field_needs_2d_slices(tmp_path: Path) -> None:
    path = str(tmp_path / "s.ckpt")
    write_strategy(path, make_strategy({"e": L((2,), (-1,), field=3)}))
    strategy = ms.build_searched_strategy(path)
    with pytest.raises(LayoutError, match="field 3"):
        rmp.merge_sliced_parameter([ms.Parameter(np.ones(6), "e")] * 2, strategy)


# --------------------------------------------------------------------------------------------
# load_segmented_checkpoints and restore_group_info_list: bad input


def test_load_segmented_checkpoints_merges_and_leaves_files_alone(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"x": np.ones(2, np.float32), "y": np.zeros(3, np.int32)})
    save_ckpt(tmp_path / "b.ckpt", {"z": np.full(2, 7, np.float16)})
    before = tree_files(str(tmp_path))
    loaded = rmp.load_segmented_checkpoints(str(tmp_path))
    assert sorted(loaded) == ["x", "y", "z"] and loaded["z"].dtype == np.float16
    assert rmp.load_segmented_checkpoints(tmp_path, filter_prefix="x").keys() >= {"y", "z"}  # a PathLike too
    assert tree_files(str(tmp_path)) == before


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda d: 3, UsageError),
        (lambda d: str(d / "missing"), UsageError),
        (lambda d: str(d / "a.ckpt"), UsageError),
    ],
)
def test_load_segmented_checkpoints_bad_input(tmp_path: Path, make, error: type[ReshardError]) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"x": np.ones(2, np.float32)})
    with pytest.raises(error) as caught:
        rmp.load_segmented_checkpoints(make(tmp_path))
    assert "\n" not in str(caught.value)


def test_load_segmented_checkpoints_corrupt_segment(tmp_path: Path) -> None:
    (tmp_path / "bad.ckpt").write_bytes(b"\x0a\xff\xff\xff\xff garbage")
    with pytest.raises(FormatError):
        rmp.load_segmented_checkpoints(str(tmp_path))


@pytest.mark.parametrize(
    ("content", "error"),
    [(None, UsageError), (b"", UsageError), (b"\xff\xff\xff\xff", FormatError)],
)
def test_restore_group_info_list_bad_input(tmp_path: Path, content: bytes | None, error: type[ReshardError]) -> None:
    path = tmp_path / "group_info.pb"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error) as caught:
        rmp.restore_group_info_list(str(path))
    assert "\n" not in str(caught.value)
    with pytest.raises(UsageError):
        rmp.restore_group_info_list(path)  # type: ignore[arg-type]  # MindSpore takes only str
