"""The Python API's arguments: a wrong one is one reshard error saying what to fix, a ``pathlib.Path`` is a path.

A new user's walk found internal tracebacks instead (``'PosixPath' object has no attribute 'endswith'``,
``'int' object is not iterable``, ``'dict' object has no attribute 'enc_key'``, a bare ``KeyError``). Each
case below is one call a user may write; it must raise the reshard error named, one line, holding the
fragment, before anything is written. Then every path argument takes ``os.PathLike`` end to end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reshard import api
from reshard.errors import MissingTensorError, ReshardError, UsageError
from reshard.execute.options import RayOptions, RunOptions, WriteOptions
from reshard.execute.ray import check_running
from reshard.ops.options import Destination, TensorOptions
from reshard.sources import ReadOptions
from tests.trust_helpers import make_job, tree

KEY = b"0123456789abcdef"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


def _transform(job: dict[str, str], dst: str, **kwargs: Any) -> Any:
    return api.transform(job["r8"], dst, job["s8"], job["s4"], **kwargs)


# (id, the call given the job and a fresh destination, the error class, a fragment of its message)
Case = tuple[str, Callable[[dict[str, str], str], object], type[ReshardError], str]
CASES: list[Case] = [
    (
        "src int",
        lambda j, d: api.transform(123, d, j["s8"], j["s4"]),
        UsageError,
        "src must be a path (a str or os.PathLike",
    ),
    ("dst None", lambda j, d: api.transform(j["r8"], None, j["s8"], j["s4"]), UsageError, "dst must be a path"),
    (
        "strategy int",
        lambda j, d: api.transform(j["r8"], d, 8, j["s4"]),
        UsageError,
        "src_strategy must be a strategy path",
    ),
    (
        "output str",
        lambda j, d: _transform(j, d, output="safetensors"),
        UsageError,
        "use output=api.OutputSpec(format='safetensors')",
    ),
    (
        "ranks int",
        lambda j, d: _transform(j, d, ranks=0),
        UsageError,
        "ranks must be an iterable of rank numbers (ints >= 0) such as [0, 1], not int 0",
    ),
    ("ranks str", lambda j, d: _transform(j, d, ranks="0"), UsageError, "ranks must be an iterable of rank numbers"),
    (
        "ranks negative",
        lambda j, d: _transform(j, d, ranks=[0, -1]),
        UsageError,
        "ranks must hold rank numbers (ints >= 0), not int -1",
    ),
    ("ranks twice", lambda j, d: _transform(j, d, ranks=[1, 1]), UsageError, "ranks names rank 1 more than once"),
    (
        "workers str",
        lambda j, d: _transform(j, d, run=RunOptions(workers="2")),
        UsageError,
        "RunOptions.workers must be a whole number (at least 1), not str '2'",
    ),
    (
        "workers 0",
        lambda j, d: _transform(j, d, run=RunOptions(workers=0)),
        UsageError,
        "RunOptions.workers must be at least 1, not 0",
    ),
    (
        "write dict",
        lambda j, d: _transform(j, d, write={"enc_key": KEY}),
        UsageError,
        "write= takes WriteOptions(...) (from reshard.execute.options), not a dict: use write=WriteOptions(enc_key=",
    ),
    (
        "destination bool",
        lambda j, d: _transform(j, d, destination=True),
        UsageError,
        "destination= takes api.Destination(...), not bool True",
    ),
    (
        "names dict",
        lambda j, d: _transform(j, d, tensors=TensorOptions(names={"a": "b"})),
        UsageError,
        "TensorOptions.names must be a NameOptions",
    ),
    ("run swapped", lambda j, d: _transform(j, d, run=WriteOptions()), UsageError, "run= takes RunOptions(...)"),
    ("read swapped", lambda j, d: _transform(j, d, read=RunOptions()), UsageError, "not a RunOptions: give it as run="),
    ("tensors swapped", lambda j, d: _transform(j, d, tensors=Destination()), UsageError, "give it as destination="),
    (
        "enc_key str",
        lambda j, d: WriteOptions(enc_key="secret-key"),
        UsageError,
        "WriteOptions.enc_key must be bytes or None, not a str",
    ),
    ("dec_key int", lambda j, d: ReadOptions(dec_key=7), UsageError, "ReadOptions.dec_key must be bytes or None"),
    (
        "overwrite str",
        lambda j, d: Destination(overwrite="yes"),
        UsageError,
        "Destination.overwrite must be True or False, not str 'yes'",
    ),
    (
        "prefixes str",
        lambda j, d: api.OutputSpec(optimizer_prefixes="adam_"),
        UsageError,
        "OutputSpec.optimizer_prefixes must be a sequence",
    ),
    ("max_tasks 0", lambda j, d: RayOptions(max_tasks=0), UsageError, "RayOptions.max_tasks must be at least 1, not 0"),
    (
        "placement and no shared disk",
        lambda j, d: RayOptions(placement="auto", shared_disk=False),
        UsageError,
        "give one (--placement or --no-shared-disk)",
    ),
    (
        "progress not callable",
        lambda j, d: RunOptions(progress=True),
        UsageError,
        "RunOptions.progress must be a function or None",
    ),
    (
        "unify parts",
        lambda j, d: api.unify(j["r8st"], j["s8"], d, parts=api.OutputSpec()),
        UsageError,
        "parts= takes api.UnifyOptions(...)",
    ),
    ("unify src", lambda j, d: api.unify(b"r8st", j["s8"], d), UsageError, "src must be a path"),
    ("split ranks", lambda j, d: api.split(j["full"], j["s4"], d, ranks=3), UsageError, "ranks must be an iterable"),
    ("split write", lambda j, d: api.split(j["full"], j["s4"], d, write=ReadOptions()), UsageError, "give it as read="),
    (
        "convert to",
        lambda j, d: api.convert(j["full"], d, 5),
        UsageError,
        "to must be ckpt, safetensors, dcp or torch_dist, or an OutputSpec",
    ),
    ("convert dst", lambda j, d: api.convert(j["full"], 3, "safetensors"), UsageError, "dst must be a path"),
    (
        "recrypt destination",
        lambda j, d: api.recrypt(j["full"], d, destination={"overwrite": True}),
        UsageError,
        "use destination=api.Destination(overwrite=...)",
    ),
    (
        "by rank rank",
        lambda j, d: api.transform_by_rank("0", {0: j["full"]}, d + "/x.ckpt"),
        UsageError,
        "rank must be a whole number (at least 0), not str '0'",
    ),
    (
        "by rank files",
        lambda j, d: api.transform_by_rank(0, [j["full"]], d + "/x.ckpt"),
        UsageError,
        "files_map must be a dict of source rank -> file, not a list",
    ),
    (
        "needed ranks",
        lambda j, d: api.needed_ranks(-1, j["s8"], j["s4"]),
        UsageError,
        "rank_id must be at least 0, not -1",
    ),
    ("open_checkpoint", lambda j, d: api.open_checkpoint(42), UsageError, "path must be a path (a str or os.PathLike"),
    (
        "check_destination",
        lambda j, d: api.check_destination(d, [None], overwrite=False),
        UsageError,
        "a source must be a path",
    ),
    (
        "execute run",
        lambda j, d: api.execute(_dry(j, d), run={"workers": 2}),
        UsageError,
        "use run=RunOptions(workers=...)",
    ),
]


def _dry(job: dict[str, str], dst: str) -> Any:
    return _transform(job, dst, destination=Destination(dry_run=True)).plan


@pytest.mark.parametrize(("call", "error", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_one_reshard_error(
    job: dict[str, str],
    tmp_path: Path,
    call: Callable[[dict[str, str], str], object],
    error: type[ReshardError],
    fragment: str,
) -> None:
    dst = str(tmp_path / "out")
    with pytest.raises(error, match=re.escape(fragment)) as caught:
        call(job, dst)
    message = str(caught.value)
    assert "\n" not in message and "secret-key" not in message and repr(KEY) not in message, message
    assert not os.path.exists(dst) or not os.listdir(dst), "nothing is written for a refused argument"


def test_the_error_family_takes_any_path_argument() -> None:
    """Building an error for a wrong argument never raises instead (``os.fspath(123)`` did)."""
    assert str(UsageError("no such file or folder", 123)) == "123: no such file or folder"
    assert str(UsageError("bad", Path("a") / "b")) == os.path.join("a", "b") + ": bad"
    assert UsageError("bad", None).path is None


def test_path_arguments_work_end_to_end(job: dict[str, str], tmp_path: Path) -> None:
    """Every operation and ``open_checkpoint`` take ``pathlib.Path`` wherever they take a path, with the
    bytes of the ``str`` call."""
    p = {k: Path(v) for k, v in job.items()}
    api.transform(job["r8"], str(tmp_path / "str4"), job["s8"], job["s4"])
    report = api.transform(p["r8"], tmp_path / "path4", p["s8"], p["s4"], ranks=range(4))
    assert tree(str(tmp_path / "path4")).keys() == tree(str(tmp_path / "str4")).keys()
    assert all(isinstance(f.path, str) for f in report.plan.files)
    api.unify(p["r8st"], p["s8"], tmp_path / "unified")
    api.split(tmp_path / "unified", p["s4"], tmp_path / "split", ranks=(0, 1))
    assert sorted(os.listdir(tmp_path / "split")) == ["rank_0", "rank_1", "reshard-manifest.json"]
    api.convert(p["full"], tmp_path / "st", "safetensors")
    assert os.path.isfile(tmp_path / "st" / "model.safetensors")
    needed = api.needed_ranks(0, p["s8"], p["s4"])
    files = {r: Path(job["r8"]) / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in needed}
    api.transform_by_rank(0, files, tmp_path / "by_rank" / "checkpoint_0.ckpt", p["s8"], p["s4"])
    theirs_path = tmp_path / "str4" / "rank_0" / "checkpoint_0.ckpt"
    with (
        api.open_checkpoint(tmp_path / "by_rank" / "checkpoint_0.ckpt") as mine,
        api.open_checkpoint(theirs_path) as theirs,
    ):
        name = next(iter(theirs.entries))
        assert (mine.array(name) == theirs.array(name)).all()
    files_, mapping, _ = api.unified_index(tmp_path / "unified")
    assert mapping and files_
    assert RayOptions(placement=tmp_path / "nodes.json").placement == str(tmp_path / "nodes.json")


def test_a_missing_tensor_names_itself_and_the_file(job: dict[str, str]) -> None:
    """A ``MissingTensorError``: a ``UsageError`` (one line, exit 2 on the command) and a ``KeyError``."""
    with api.open_checkpoint(Path(job["full"])) as index:
        with pytest.raises(MissingTensorError, match=r"model\.ckpt: no tensor named 'no\.such' in this checkpoint"):
            index.array("no.such")
        name = next(n for n in index.entries if len(n) > 8)
        with pytest.raises(KeyError) as caught:
            index.value(name[:-1])
        assert isinstance(caught.value, UsageError)
        message = str(caught.value)  # the line itself, not quoted as a KeyError's text is
        assert message.startswith(job["full"]) and f"(did you mean {name!r}" in message, message


def test_overwrite_and_resume_hints_name_the_python_spelling(job: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(UsageError, match=re.escape("use --overwrite (Destination(overwrite=True) in Python)")):
        api.check_destination(tmp_path / "full", [Path(job["r8"])], overwrite=False)


def test_an_address_of_another_cluster_is_refused_once_ray_runs() -> None:
    """``ray.init`` holds for the process: an address naming another cluster is refused, not ignored."""
    here = SimpleNamespace(get_node_ip_address=lambda: "10.0.0.5")
    fake = SimpleNamespace(
        get_runtime_context=lambda: SimpleNamespace(gcs_address="10.0.0.5:6379"),
        util=SimpleNamespace(client=SimpleNamespace(ray=SimpleNamespace(is_connected=lambda: False)), **vars(here)),
    )
    for same in (None, "auto", "10.0.0.5:6379", "127.0.0.1:6379"):
        check_running(fake, same)
    for other in ("10.0.0.6:6379", "10.0.0.5:6380", "ray://10.0.0.5:10001"):
        with pytest.raises(UsageError, match=r"Ray is already initialized in this process \(to the cluster at "):
            check_running(fake, other)


def test_ray_address_after_init_is_refused(cluster: None, job: dict[str, str], tmp_path: Path) -> None:
    run = RayOptions(address="127.0.0.1:1")
    with pytest.raises(UsageError, match=r"so the run cannot go to 127\.0\.0\.1:1: give no address"):
        _transform(job, str(tmp_path / "ray"), run=run)
    assert not os.path.exists(tmp_path / "ray") or not os.listdir(tmp_path / "ray")
