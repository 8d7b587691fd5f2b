"""``--resume`` continues only a run planned the same way (``reshard.resume``), and leaves a finishing file
that already holds its bytes as it is.

The pure part (the plan's fingerprint, the journal's first line, the refusal) is tested on values;
the recorder's part through ``api.transform`` into DCP folders, interrupted by a ``KeyboardInterrupt``
from the executor as ``tests/test_dcp_resume.py`` does; the command's, there too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from reshard import api, lock, manifest
from reshard import resume as resume_check
from reshard.errors import UsageError
from reshard.execute import local
from reshard.execute.options import RunOptions
from reshard.formats.base import holds
from tests.trust_helpers import make_job, snapshot

# ------------------------------------------------------------------------------------ pure


def test_the_plan_fingerprint_follows_paths_layouts_and_finishing_bytes_not_their_order() -> None:
    layouts, texts = {"a.distcp": "L1", "b.distcp": "L2"}, {".metadata": b"meta", "x.json": "{}"}
    one = resume_check.plan_fingerprint(layouts, texts)
    assert one == resume_check.plan_fingerprint(dict(reversed(layouts.items())), dict(reversed(texts.items())))
    assert one != resume_check.plan_fingerprint({"a.distcp": "L1", "c.distcp": "L2"}, texts)  # another name
    assert one != resume_check.plan_fingerprint({"a.distcp": "L1", "b.distcp": "L3"}, texts)  # another layout
    assert one != resume_check.plan_fingerprint(layouts, {**texts, ".metadata": b"other"})  # other .metadata
    assert one != resume_check.plan_fingerprint(layouts, {".metadata": b"meta"})  # a finishing file fewer
    assert resume_check.plan_fingerprint({}, {"t": "é"}) == resume_check.plan_fingerprint({}, {"t": "é".encode()})


def test_the_journal_s_first_line_says_the_plan_and_is_no_output_record() -> None:
    line = resume_check.journal_header("fp", ["b", "a"])
    assert json.loads(line) == {"reshard_journal": 1, "plan": "fp", "outputs": ["a", "b"]}
    with pytest.raises(KeyError):  # what an earlier reshard does with it: skips it as a torn line
        manifest.OutputRecord.from_json(json.loads(line))
    earlier = resume_check.from_journal([line.encode(), b'{"path": "a"}'], ["a"])
    assert earlier == resume_check.EarlierRun("fp", frozenset({"a", "b"}))


@pytest.mark.parametrize("first", [b'{"path": "a", "bytes": 1, "xxh128": "00"}', b"{torn", b'{"reshard_journal": 9}'])
def test_a_journal_without_our_first_line_stands_for_its_finished_files(first: bytes) -> None:
    assert resume_check.from_journal([first], ["a"]) == resume_check.EarlierRun(None, frozenset({"a"}))
    assert resume_check.from_journal([], []) == resume_check.EarlierRun(None, frozenset())


def test_a_manifest_says_its_plan_and_outputs() -> None:
    doc = {"plan": "fp", "outputs": [{"path": "a"}, {"path": ".metadata"}, "junk"]}
    assert resume_check.from_manifest(doc) == resume_check.EarlierRun("fp", frozenset({"a", ".metadata"}), True)
    assert resume_check.from_manifest({"outputs": [{"path": "a"}]}).fingerprint is None  # an earlier reshard's


def test_the_refusal_names_what_would_stay_and_what_to_do() -> None:
    earlier = resume_check.EarlierRun("fp", frozenset({".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}))
    assert resume_check.refusal(earlier, "fp", earlier.outputs) is None
    why = resume_check.refusal(earlier, "other", {".metadata", "__0_0.distcp", "__1_0.distcp"})
    assert why is not None and "unfinished run" in why and "its output __2_0.distcp is not among this run's" in why
    assert "repeat that run's options" in why and "without --resume into a new or emptied destination" in why
    why = resume_check.refusal(earlier, "other", {"__0_0.distcp"})
    assert why is not None and "its outputs .metadata and 2 more are not among this run's" in why
    why = resume_check.refusal(earlier, "other", earlier.outputs)
    assert why is not None and "the same files with other contents" in why
    finished = resume_check.EarlierRun("fp", frozenset({"a"}), finished=True)
    assert "the finished run here" in (resume_check.refusal(finished, "other", {"a"}) or "")


def test_without_a_fingerprint_only_an_output_left_behind_refuses() -> None:
    older = resume_check.EarlierRun(None, frozenset({"__0_0.distcp", "__1_0.distcp"}))
    assert resume_check.refusal(older, "any", {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}) is None
    assert "__1_0.distcp is not among" in (resume_check.refusal(older, "any", {"__0_0.distcp"}) or "")


def test_holds_compares_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "t"
    assert not holds(path, b"")  # no file
    path.write_bytes(b"abc")
    assert holds(path, b"abc") and holds(path, "abc")
    assert not holds(path, b"abd") and not holds(path, b"abcd")


# ------------------------------------------------------------------------------------ the recorder


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("resplan")))


def _dcp(job: dict[str, str], dst: Path, ranks: int, resume: bool = False, **kw: Any) -> api.Report:
    output = api.OutputSpec(format="dcp", dcp_ranks=ranks)
    where = api.Destination(resume=resume)
    return api.transform(job["full"], str(dst), None, None, output=output, destination=where, **kw)


def _interrupted(job: dict[str, str], dst: Path, ranks: int, after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of ``ranks`` data files stopped (Ctrl-C) as its output number ``after`` starts; ``after ==
    ranks``: once every data file is in place, before ``.metadata``."""
    real_file, real_texts, calls = local.run_file, local.write_texts, {"n": 0}

    def run_file(*args: Any, **kwargs: Any) -> Any:
        if calls["n"] == after:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real_file(*args, **kwargs)

    def write_texts(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "run_file", run_file)
    monkeypatch.setattr(local, "write_texts", write_texts)
    with pytest.raises(KeyboardInterrupt):
        _dcp(job, dst, ranks, run=RunOptions(workers=1))
    monkeypatch.setattr(local, "run_file", real_file)
    monkeypatch.setattr(local, "write_texts", real_texts)


def test_resume_with_fewer_ranks_is_refused_and_changes_nothing(
    job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out"
    _interrupted(job, dst, 3, 3, monkeypatch)  # three data files, no .metadata
    before = snapshot(str(dst))
    refused = r"--resume \(Destination\(resume=True\) in Python\) refused: "
    with pytest.raises(UsageError, match=refused + r".*its output __2_0\.distcp is not among this run's"):
        _dcp(job, dst, 2, resume=True)
    assert snapshot(str(dst)) == before  # the journal, every data file, no lock, nothing new
    assert not (dst / lock.LOCK_NAME).exists()
    with pytest.raises(UsageError, match="the same files with other contents"):  # same names, other dtype
        _dcp(job, dst, 3, resume=True, tensors=api.TensorOptions(dtype="bfloat16"))
    assert snapshot(str(dst)) == before
    report = _dcp(job, dst, 3, resume=True)  # the run's own options continue it
    assert sorted(report.kept) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert sorted(n for n in os.listdir(dst) if n.endswith(".distcp")) == sorted(report.kept)


def test_a_journal_of_an_earlier_reshard_still_resumes(
    job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No first line: its finished files are compared instead; other options are refused only when one of
    them would stay (older journals resumed with other options before, and nothing goes stale here)."""
    dst = tmp_path / "out"
    _interrupted(job, dst, 3, 2, monkeypatch)  # __0_0 and __1_0 finished
    journal = dst / manifest.JOURNAL_NAME
    lines = journal.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[0])["reshard_journal"] == 1
    journal.write_bytes(b"".join(lines[1:]))  # as an earlier reshard wrote it
    with pytest.raises(UsageError, match=r"its output __1_0\.distcp is not among this run's"):
        _dcp(job, dst, 1, resume=True)
    report = _dcp(job, dst, 3, resume=True)
    assert sorted(report.kept) == ["__0_0.distcp", "__1_0.distcp"]


def test_a_finished_output_resumed_with_other_options_is_refused(job: dict[str, str], tmp_path: Path) -> None:
    dst = tmp_path / "out"
    _dcp(job, dst, 3)
    assert manifest.read_manifest(str(dst))["plan"]
    before = snapshot(str(dst))
    with pytest.raises(UsageError, match=r"the finished run here .*__2_0\.distcp is not among this run's"):
        _dcp(job, dst, 2, resume=True)
    assert snapshot(str(dst)) == before


def test_a_finishing_file_holding_its_bytes_is_kept_and_one_missing_is_named(
    job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out"
    _interrupted(job, dst, 2, 2, monkeypatch)
    assert not (dst / ".metadata").exists()
    report = _dcp(job, dst, 2, resume=True)
    assert sorted(report.kept) == ["__0_0.distcp", "__1_0.distcp"] and report.finished == [".metadata"]
    assert any(n.endswith("(verified); finished it with .metadata") for n in report.notes), report.notes
    metadata = (dst / ".metadata").stat().st_mtime_ns
    again = _dcp(job, dst, 2, resume=True)
    assert sorted(again.kept) == [".metadata", "__0_0.distcp", "__1_0.distcp"] and again.finished == []
    assert (dst / ".metadata").stat().st_mtime_ns == metadata  # left as it was: nothing to do, truly
    assert {o["path"] for o in manifest.read_manifest(str(dst))["outputs"]} == set(again.kept)
