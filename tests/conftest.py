"""Shared fixtures. Oracle tests need the MindSpore venv; it is built on first use, never skipped."""

from __future__ import annotations

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
