"""The executor's resident memory per thread is a bounded row block, whatever the tensor (issue 19, item 4).

A merge to one full ``.ckpt`` runs its tensors on every worker thread. Each strided tensor used to be
assembled in one block of up to ``max_memory / threads`` (the whole tensor, in practice) while its
source pages stayed mapped until the tensor was done, so peak RSS grew by about two tensors per
thread: when the default went from 2 to 4 threads, a merge of a model whose largest tensor is
144 MiB went from 174 MB to 294 MB. Now a block is at most ``local.STAGING_BLOCK_BYTES`` and the
source pages a block read are released before the next one. These tests shrink the block to one
page so that a small model shows it, and check the bytes are unchanged.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard import api
from reshard.execute import local
from reshard.execute.options import RunOptions
from reshard.formats.ckpt import read_ckpt
from reshard.synthetic import ModelShape
from tests.trust_helpers import make_job

SHAPE = ModelShape(vocab=512, hidden=64, ffn=128, layers=2)  # embedding 128 KiB: many one-page blocks


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("memory")), SHAPE)


def test_blocks_are_bounded_and_sources_released_per_block(job: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    page = local._PAGE
    monkeypatch.setattr(local, "STAGING_BLOCK_BYTES", page)
    sizes: list[int] = []
    releases = {"per_block": 0}
    lock = threading.Lock()
    real_staging, real_release = local._staging, local._release_row_sources

    def staging(nbytes: int) -> np.ndarray:
        with lock:
            sizes.append(nbytes)
        return real_staging(nbytes)

    def release(*args: Any) -> None:
        with lock:
            releases["per_block"] += 1
        real_release(*args)

    monkeypatch.setattr(local, "_staging", staging)
    monkeypatch.setattr(local, "_release_row_sources", release)
    out = tmp_path / "full"
    # the default memory bound (1 GiB) would allow a whole tensor per thread; the block bound wins
    api.transform(
        job["r8"], str(out), job["s8"], None, run=RunOptions(workers=4), destination=api.Destination(manifest=False)
    )
    assert sizes and max(sizes) <= page, max(sizes)
    assert releases["per_block"] > 0
    (merged,) = out.rglob("*.ckpt")
    got, want = read_ckpt(str(merged)), read_ckpt(job["full"])
    try:
        assert set(got.entries) == set(want.entries)
        for name in want.entries:
            if not want.entries[name].is_string:
                assert np.array_equal(got.items(name), want.items(name)), name
    finally:
        got.close()
        want.close()


def test_the_memory_bound_still_lowers_the_block(job: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    """A small ``max_memory`` gives smaller blocks than ``STAGING_BLOCK_BYTES`` (the bound is a ceiling)."""
    sizes: list[int] = []
    real_staging = local._staging
    monkeypatch.setattr(local, "_staging", lambda n: sizes.append(n) or real_staging(n))
    api.transform(
        job["r8"],
        str(tmp_path / "full"),
        job["s8"],
        None,
        run=RunOptions(workers=2, max_memory=16 * 1024),
        destination=api.Destination(manifest=False),
    )
    assert sizes and max(sizes) <= 8 * 1024
