"""``reshard.auto_transform`` / ``reshard auto-transform``: a job start, converted once for all ranks.

The main test starts 8 callers at once on one shared cache, as two "nodes" of 4 ranks (each with
its own node-local working folder), while a background writer puts the job's strategy files in
one by one (one of them in two halves): every rank gets a file byte-equal to an offline
``reshard transform``, each destination file is converted exactly once (the conversion log and the
summed bytes say so), each node converts only its own ranks, and a second start converts nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reshard import api
from reshard.auto import (
    CachePolicy,
    Conversion,
    _interrupted,
    auto_transform,
    cache_entries,
    entry_in_use,
    evict,
)
from reshard.errors import UnsupportedError
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies, write_strategy
from reshard.synthetic import ModelShape, full_model, stage_strategies

SHAPE = ModelShape(vocab=64, hidden=32, ffn=64, layers=4)
WORLD = 8  # destination: pp 2 x (dp 2, mp 2)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-rank source (with its strategy folder beside it), the 8 per-rank strategy files of the
    destination job (a template to copy in), and an offline transform of the source to them."""
    root = tmp_path_factory.mktemp("auto")
    full = root / "full" / "model.ckpt"
    save_ckpt(str(full), full_model(SHAPE))
    (root / "train" / "strategy").mkdir(parents=True)
    write_strategy(
        root / "train" / "strategy" / "ckpt_strategy_rank_0.ckpt",
        stage_strategies(SHAPE, dp=2, mp=2, pp=1, opt_shard=True)[0],
    )
    src = root / "train" / "checkpoint"
    api.transform(str(full), str(src), None, str(root / "train" / "strategy"))
    template = root / "template"
    template.mkdir()
    stages = stage_strategies(SHAPE, dp=2, mp=2, pp=2, opt_shard=False)
    for rank in range(WORLD):
        write_strategy(template / f"ckpt_strategy_rank_{rank}.ckpt", stages[rank // 4])
    merge_pipeline_strategies(template, root / "merged.ckpt")
    reference = root / "reference"
    done = _cli(
        "transform",
        "--src",
        str(src),
        "--dst",
        str(reference),
        "--src-strategy",
        str(root / "train" / "strategy"),
        "--dst-strategy",
        str(template),
    )
    assert done.returncode == 0, done.stderr
    return {
        "root": root,
        "merged": root / "merged.ckpt",
        "full": full,
        "src": src,
        "template": template,
        "reference": reference,
    }


def _cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def _popen(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path)] = (st.st_size, st.st_mtime_ns)
    return out


def _write_slowly(template: Path, strategy: Path, halves: int) -> None:
    """Copy the per-rank strategy files in one by one, rank ``halves`` in two halves."""
    time.sleep(0.3)  # the callers are already waiting
    strategy.mkdir()
    for rank in (3, 0, 6, 1, 7, 2, 5, 4):
        data = (template / f"ckpt_strategy_rank_{rank}.ckpt").read_bytes()
        with open(strategy / f"ckpt_strategy_rank_{rank}.ckpt", "wb") as fh:
            if rank == halves:
                fh.write(data[: len(data) // 2])
                fh.flush()
                time.sleep(0.4)
            fh.write(data[len(data) // 2 :] if rank == halves else data)
        time.sleep(0.1)


def _start_job(job: dict[str, Path], work: Path, strategy: Path) -> tuple[list[subprocess.Popen[str]], list[int]]:
    procs, nodes = [], []
    for rank in range(WORLD):
        node = rank // 4
        node_dir = work / f"node{node}"
        node_dir.mkdir(exist_ok=True)
        procs.append(
            _popen(
                "auto-transform",
                str(job["src"]),
                "--dst-strategy",
                str(strategy),
                "--rank-id",
                str(rank),
                "--world-size",
                str(WORLD),
                "--local-ranks",
                f"{4 * node}-{4 * node + 3}",
                "--cache-dir",
                str(work / "cache"),
                "--timeout",
                "60",
                cwd=node_dir,
            )
        )
        nodes.append(node)
    return procs, nodes


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    paths = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        lines = out.splitlines()
        assert len(lines) == 1, out  # the path and nothing else on stdout
        paths.append(lines[0])
    return paths


def _log(entry: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (entry / "conversions.log").read_text().splitlines()]


def test_eight_callers_two_nodes_strategy_appearing(job: dict[str, Path], tmp_path: Path) -> None:
    strategy = tmp_path / "output" / "strategy"
    strategy.parent.mkdir()
    inputs = _snapshot(job["src"].parent)
    procs, nodes = _start_job(job, tmp_path, strategy)
    writer = threading.Thread(target=_write_slowly, args=(job["template"], strategy, 6))
    writer.start()
    paths = _finish(procs)
    writer.join()
    entries = cache_entries(str(tmp_path / "cache"))
    assert len(entries) == 1
    entry = Path(entries[0])
    for rank, path in enumerate(paths):
        assert path == str(entry / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert Path(path).read_bytes() == (job["reference"] / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").read_bytes()
    log = _log(entry)
    assert sorted(int(e["rank"]) for e in log) == list(range(WORLD))  # each destination file converted once
    assert sum(int(e["bytes"]) for e in log) == sum(Path(p).stat().st_size for p in paths)
    pid_node = {proc.pid: node for proc, node in zip(procs, nodes, strict=True)}
    assert all(pid_node[int(e["pid"])] == int(e["rank"]) // 4 for e in log)  # each node converts its own ranks
    for node in (0, 1):
        assert list((tmp_path / f"node{node}").iterdir()) == []  # nothing in the node-local folders
    assert _snapshot(job["src"].parent) == inputs  # the inputs untouched
    assert sorted(p.name for p in strategy.iterdir()) == sorted(p.name for p in job["template"].iterdir())

    outputs = _snapshot(entry)
    outputs = {k: v for k, v in outputs.items() if not k.endswith((".last-used", ".in-use"))}
    again, _ = _start_job(job, tmp_path, strategy)  # a second start: nothing converted, nothing rewritten
    assert _finish(again) == paths
    after = {k: v for k, v in _snapshot(entry).items() if k in outputs}
    assert after == outputs
    assert len(_log(entry)) == WORLD


def test_killed_converter_is_taken_over(job: dict[str, Path], tmp_path: Path) -> None:
    args = (
        "auto-transform",
        str(job["src"]),
        "--dst-strategy",
        str(job["template"]),
        "--rank-id",
        "2",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    slow = _popen(*args, cwd=tmp_path, env={**os.environ, "RESHARD_AUTO_TEST_PAUSE": "60"})
    deadline = time.monotonic() + 30
    work = None
    while time.monotonic() < deadline:
        found = list((tmp_path / "cache").glob("*/.work/rank_2/rank_2/checkpoint_2.ckpt"))
        if found:
            work = found[0]
            break
        time.sleep(0.05)
    assert work is not None, "the slow converter never got to its pause"
    waiting = _popen(*args, cwd=tmp_path)  # waits on the live holder's lock
    time.sleep(0.5)
    assert waiting.poll() is None
    slow.send_signal(signal.SIGKILL)
    slow.wait()
    (path,) = _finish([waiting])
    expected = (job["reference"] / "rank_2" / "checkpoint_2.ckpt").read_bytes()
    assert Path(path).read_bytes() == expected
    entry = Path(path).parent.parent
    assert [int(e["rank"]) for e in _log(entry)] == [2]
    assert [int(e["pid"]) for e in _log(entry)] == [waiting.pid]
    assert not (entry / ".work" / "rank_2").exists()


def test_timeout_names_the_missing_stage(job: dict[str, Path], tmp_path: Path) -> None:
    """Stage 1 has no complete file (rank 7's is cut short): the line names the stage, its ranks, the
    file being written; ranks 1-3, which need no file of their own beside rank 0's, are not named."""
    strategy = tmp_path / "strategy"
    strategy.mkdir()
    for rank in (0, 2):
        shutil.copy(job["template"] / f"ckpt_strategy_rank_{rank}.ckpt", strategy)
    (strategy / "ckpt_strategy_rank_7.ckpt").write_bytes(
        (job["template"] / "ckpt_strategy_rank_7.ckpt").read_bytes()[:7]  # never finished
    )
    started = time.monotonic()
    done = _cli(
        "auto-transform",
        str(job["src"]),
        "--dst-strategy",
        str(strategy),
        "--rank-id",
        "0",
        "--world-size",
        "8",
        "--timeout",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--quiet",
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "timed out after 1 s" in line and "no strategy file yet of pipeline stage 1 of 2" in line, line
    assert "any one of its ranks 4-7" in line and "still being written: rank 7" in line, line
    assert "ranks 1" not in line and "missing ranks" not in line, line
    assert time.monotonic() - started < 15
    assert not (tmp_path / "cache").exists()


def _auto(job: dict[str, Path], strategy: Path, cache: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return _cli("auto-transform", str(job["src"]), "--dst-strategy", str(strategy), "--cache-dir", str(cache), *flags)


def test_a_folder_of_one_file_per_stage_is_complete_at_once(job: dict[str, Path], tmp_path: Path) -> None:
    """As ``reshard demo`` and a training job leave it: ranks 0 and 4 wrote the stages' files; every
    other command merges such a folder, and with --world-size 8 it describes all 8 ranks."""
    strategy = tmp_path / "strategy_8"
    strategy.mkdir()
    for rank in (0, 4):
        shutil.copy(job["template"] / f"ckpt_strategy_rank_{rank}.ckpt", strategy)
    old = time.time() - 60  # written by an earlier start, not being written now
    for path in strategy.iterdir():
        os.utime(path, (old, old))
    started = time.monotonic()
    done = _auto(job, strategy, tmp_path / "cache", "--rank-id", "5", "--world-size", "8", "--timeout", "5")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 4 and "waiting" not in done.stderr, done.stderr
    reference = (job["reference"] / "rank_5" / "checkpoint_5.ckpt").read_bytes()
    assert Path(done.stdout.strip()).read_bytes() == reference
    named = tmp_path / "named"  # per-stage files not named by rank: the folder's strategy files
    named.mkdir()
    for stage, rank in enumerate((0, 4)):
        shutil.copy(job["template"] / f"ckpt_strategy_rank_{rank}.ckpt", named / f"stage_{stage}.ckpt")
        os.utime(named / f"stage_{stage}.ckpt", (old, old))
    done = _auto(job, named, tmp_path / "cache", "--rank-id", "5", "--world-size", "8", "--timeout", "0")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == reference


def test_a_refused_conversion_is_one_line_and_leaves_no_entry(job: dict[str, Path], tmp_path: Path) -> None:
    """The 8-rank job's strategy given as the 4-rank source's: refused when planned, after the entry is
    open. One line, no "converting" note before it; no entry left (nor the cache folder it made)."""
    for cache, existed in ((tmp_path / "new_cache", False), (tmp_path / "old_cache", True)):
        if existed:
            cache.mkdir()
        done = _auto(
            job, job["template"], cache, "--rank-id", "0", "--src-strategy", str(job["template"]), "--timeout", "5"
        )
        assert done.returncode == 2 and done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert line.startswith("reshard: error: "), line
        assert cache.is_dir() == existed and (not existed or list(cache.iterdir()) == [])


def test_an_interrupted_start_says_to_start_it_again(job: dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM while rank 0 of ``--local-ranks 0-1`` converts: the line says what a restart does (it
    takes the unfinished conversion over), not --resume / --no-manifest, which auto-transform has not."""
    cache = tmp_path / "cache"
    args = ("auto-transform", str(job["src"]), "--dst-strategy", str(job["template"]), "--rank-id", "0")
    more = ("--local-ranks", "0-1", "--cache-dir", str(cache))
    slow = _popen(*args, *more, cwd=tmp_path, env={**os.environ, "RESHARD_AUTO_TEST_PAUSE": "60"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(cache.glob("*/.work/rank_0/rank_0/checkpoint_0.ckpt")):
        time.sleep(0.05)
    slow.send_signal(signal.SIGTERM)
    _, err = slow.communicate(timeout=60)
    assert slow.returncode == 128 + signal.SIGTERM, err
    line = err.splitlines()[-1]
    assert line.startswith("reshard: interrupted (SIGTERM): none of ranks 0-1 ready yet in the cache entry "), line
    assert line.endswith("; start it again: it takes over the unfinished conversion"), line
    assert "--resume" not in err and "manifest" not in err
    (path,) = _finish([_popen(*args, *more, cwd=tmp_path)])
    assert Path(path).read_bytes() == (job["reference"] / "rank_0" / "checkpoint_0.ckpt").read_bytes()
    entry = Path(path).parent.parent
    assert (entry / "rank_1" / "checkpoint_1.ckpt").read_bytes() == (
        job["reference"] / "rank_1" / "checkpoint_1.ckpt"
    ).read_bytes()
    assert not (entry / ".work" / "rank_0").exists()


def test_without_world_size_the_stages_found_count(job: dict[str, Path], tmp_path: Path) -> None:
    strategy = tmp_path / "strategy"
    strategy.mkdir()
    shutil.copy(job["template"] / "ckpt_strategy_rank_0.ckpt", strategy)
    done = _cli(
        "auto-transform",
        str(job["src"]),
        "--dst-strategy",
        str(strategy),
        "--rank-id",
        "5",
        "--timeout",
        "0.5",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert done.returncode == 2 and "rank 5 is outside the 4 ranks" in done.stderr and "give world_size" in done.stderr
    shutil.copy(job["template"] / "ckpt_strategy_rank_5.ckpt", strategy)
    done = _cli(
        "auto-transform",
        str(job["src"]),
        "--dst-strategy",
        str(strategy),
        "--rank-id",
        "5",
        "--timeout",
        "5",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == (job["reference"] / "rank_5" / "checkpoint_5.ckpt").read_bytes()


def _bad_cases(job: dict[str, Path], tmp: Path) -> list[tuple[list[str], str]]:
    src, dst, cache = str(job["src"]), str(job["template"]), str(tmp / "cache")
    (tmp / "a_file").write_text("x")
    return [
        (
            ["auto-transform", str(tmp / "nope"), "--dst-strategy", dst, "--rank-id", "0", "--cache-dir", cache],
            "does not exist",
        ),
        (["auto-transform", src, "--dst-strategy", dst, "--rank-id", "-1", "--cache-dir", cache], "rank"),
        (
            ["auto-transform", src, "--dst-strategy", dst, "--rank-id", "8", "--world-size", "8", "--cache-dir", cache],
            "outside the world size 8",
        ),
        (
            ["auto-transform", src, "--dst-strategy", str(job["merged"]), "--rank-id", "9", "--cache-dir", cache],
            "outside the 8 ranks",
        ),
        (
            [
                "auto-transform",
                src,
                "--dst-strategy",
                dst,
                "--rank-id",
                "5",
                "--local-ranks",
                "0-3",
                "--cache-dir",
                cache,
            ],
            "not one of the local ranks 0-3",
        ),
        (
            ["auto-transform", src, "--dst-strategy", dst, "--rank-id", "0", "--timeout", "-1", "--cache-dir", cache],
            "timeout",
        ),
        (
            ["auto-transform", src, "--dst-strategy", dst, "--rank-id", "0", "--cache-dir", str(job["src"] / "c")],
            "may not lie inside",
        ),
        (
            ["auto-transform", src, "--dst-strategy", dst, "--rank-id", "0", "--cache-dir", str(tmp / "a_file")],
            "not a folder",
        ),
        (  # mkdir there fails with ENOENT: the place, not an eviction
            ["auto-transform", src, "--dst-strategy", dst, "--rank-id", "0", "--cache-dir", "/proc/nope"],
            "cannot write into the cache",
        ),
        (
            [
                "auto-transform",
                src,
                "--dst-strategy",
                dst,
                "--rank-id",
                "0",
                "--src-strategy",
                str(tmp / "none"),
                "--cache-dir",
                cache,
            ],
            "none",
        ),
        (
            [
                "auto-transform",
                src,
                "--dst-strategy",
                dst,
                "--rank-id",
                "0",
                "--max-cache-bytes",
                "lots",
                "--cache-dir",
                cache,
            ],
            "not a size",
        ),
    ]


def test_bad_input_one_line_exit_2_nothing_written(job: dict[str, Path], tmp_path: Path) -> None:
    cases = _bad_cases(job, tmp_path)
    before = _snapshot(job["root"]), _snapshot(tmp_path)
    procs = [_popen(*args, "--quiet", cwd=tmp_path) for args, _ in cases]  # all at once: the test stays short
    for (args, words), proc in zip(cases, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, err)
        assert out == ""
        (line,) = err.splitlines()
        assert line.startswith("reshard: error:") and words in line, (args, line)
    assert (_snapshot(job["root"]), _snapshot(tmp_path)) == before  # no case wrote anything


def test_checkpoint2_output_is_refused(job: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"Checkpoint 2\.0 is one tree"):
        auto_transform(
            str(job["src"]), str(job["template"]), 0, output_format="checkpoint2", cache_dir=str(tmp_path / "cache")
        )
    assert not (tmp_path / "cache").exists()


def test_eviction_keeps_entries_in_use(job: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    mine = tmp_path / "mine"
    mine.mkdir()
    (cache / "not-an-entry").mkdir(parents=True)  # never reshard's to remove
    first = Path(auto_transform(str(job["src"]), str(job["template"]), 0, cache_dir=str(cache)))
    second = Path(
        auto_transform(str(job["src"]), str(job["template"]), 0, cache_dir=str(cache), output_format="safetensors")
    )
    old, new = first.parent.parent, second.parent.parent
    assert old != new and len(cache_entries(str(cache))) == 2
    os.utime(old / ".last-used", (time.time() - 3600, time.time() - 3600))
    with entry_in_use(str(old)):  # a job still using the older entry: it stays
        assert evict(str(cache), CachePolicy(max_bytes=1)) == [str(new)]
    assert old.is_dir() and first.is_file()
    assert evict(str(cache), CachePolicy(max_bytes=None, max_age=60)) == [str(old)]
    assert cache_entries(str(cache)) == [] and (cache / "not-an-entry").is_dir()
    # the size limit through the call itself: the newer entry stays, the older goes
    first = Path(auto_transform(str(job["src"]), str(job["template"]), 1, cache_dir=str(cache)))
    second = Path(
        auto_transform(
            str(job["src"]),
            str(job["template"]),
            1,
            cache_dir=str(cache),
            output_format="safetensors",
            max_cache_bytes=1,
        )
    )
    assert not first.exists() and second.is_file()


def test_eviction_skips_an_entry_being_converted(job: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = Path(auto_transform(str(job["src"]), str(job["template"]), 0, cache_dir=str(cache)))
    entry = first.parent.parent
    fd = os.open(entry / ".in-use", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as a converting caller in another process holds it
        assert evict(str(cache), CachePolicy(max_bytes=1, max_age=0.0)) == []
    finally:
        os.close(fd)
    assert first.is_file()


def test_checkpoint2_and_hugging_face_sources(job: dict[str, Path], tmp_path: Path) -> None:
    cp2 = tmp_path / "cp2"
    api.transform(
        str(job["src"]),
        str(cp2),
        str(job["src"].parent / "strategy"),
        str(job["src"].parent / "strategy"),
        output=api.OutputSpec(format="checkpoint2", iteration=10),
    )
    hf = tmp_path / "hf"
    api.transform(str(job["full"]), str(hf), None, None, output=api.OutputSpec(format="hf", max_shard_size="100KB"))
    for source in (cp2, hf):
        reference = tmp_path / f"ref_{source.name}"
        api.transform(str(source), str(reference), None, str(job["template"]), output=api.OutputSpec(format="ckpt"))
        got = auto_transform(
            str(source), str(job["template"]), 3, cache_dir=str(tmp_path / "cache"), output_format="ckpt"
        )
        assert Path(got).read_bytes() == (reference / "rank_3" / "checkpoint_3.ckpt").read_bytes(), source


def test_top_level_name() -> None:
    import reshard

    assert reshard.auto_transform is auto_transform


def test_cache_key_follows_the_inputs_not_the_mount_path(job: dict[str, Path], tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    first = Path(auto_transform(str(job["src"]), str(job["template"]), 0, cache_dir=cache))
    other_mount = tmp_path / "mnt"
    other_mount.symlink_to(job["src"].parent)  # the same shared disk seen at another path
    assert Path(auto_transform(str(other_mount / "checkpoint"), str(job["template"]), 0, cache_dir=cache)) == first
    assert len(_log(first.parent.parent)) == 1
    strategy = str(job["src"].parent / "strategy")
    kept = tmp_path / "kept" / "checkpoint"
    shutil.copytree(job["src"], kept)  # cp -p: same names, sizes, mtimes and headers: the same entry
    same = Path(auto_transform(str(kept), str(job["template"]), 0, cache_dir=cache, src_strategy=strategy))
    assert same == first and len(_log(first.parent.parent)) == 1
    copy = tmp_path / "copy" / "checkpoint"
    shutil.copytree(job["src"], copy, copy_function=shutil.copy)  # new mtimes: another entry
    other = Path(auto_transform(str(copy), str(job["template"]), 0, cache_dir=cache, src_strategy=strategy))
    assert other.parent.parent != first.parent.parent and other.read_bytes() == first.read_bytes()


def test_the_interrupt_line_says_what_starting_again_does() -> None:
    conversion = Conversion("ckpt", None, None, None, "/cache/e", lambda _note: None)  # type: ignore[arg-type]
    assert _interrupted(conversion, [3]) == (
        "rank 3 not ready yet in the cache entry /cache/e; start it again: it takes over the unfinished conversion"
    )
    conversion.ready.update({0: "a", 1: "b"})
    assert _interrupted(conversion, [0, 1, 2, 3]).startswith("ranks 0-1 of ranks 0-3 ready in the cache entry")
    assert _interrupted(conversion, [0, 1]).endswith("start it again: it converts nothing and prints the file")
