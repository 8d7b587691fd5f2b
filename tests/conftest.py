"""Shared fixtures. Oracle tests need the MindSpore venv; it is built on first use, never skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hf import hf_python, run_hf
from tests.oracle import oracle_python, run_oracle


@pytest.fixture(scope="session")
def oracle():
    """``oracle(code, args)`` runs code in the MindSpore 2.10 venv and returns its ``out()`` value."""
    oracle_python()
    return run_oracle


@pytest.fixture(scope="session")
def hf():
    """``hf(code, args)`` runs code in the transformers venv (scripts/hf_env.sh) and returns its ``out()`` value."""
    hf_python()
    return run_hf


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local Ray cluster of 2 CPUs (the CI box's cores) per test module that asks for it (starting one
    costs ~4 s); a module with other needs (several nodes) defines its own."""
    import ray  # only the Ray tests load it

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()
