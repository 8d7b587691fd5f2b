"""The public surface: every module says what it exports.

Every module of ``src/reshard`` (but ``__main__``, which runs the command when imported) declares
``__all__``; every name in it exists; and every public function or class the module defines (name
not starting with ``_``, defined there rather than imported) is listed, so a new public name
cannot slip in unannounced.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import textwrap

import pytest

import reshard

NOT_IMPORTED = {"reshard.__main__"}  # importing it runs the command and exits

# Public-looking classes deliberately left out of __all__, and why.
NOT_EXPORTED = {
    # A source kind is used through its one instance (FULL_FILE, RANK_FOLDERS, STRATEGY, ...), which
    # is exported and listed in sources.registry.KINDS; the class is only how that instance is built.
    "reshard.sources.full_model": {"EncryptedCkpt", "FullFile", "HuggingFace", "Unified"},
    "reshard.sources.rank_folders": {"OneRankFolder", "RankFolders"},
    "reshard.sources.strategy": {"Strategy"},
    "reshard.sources.checkpoint2": {"Checkpoint2"},
}


def _module_names() -> list[str]:
    names = ["reshard"]
    for info in pkgutil.walk_packages(reshard.__path__, "reshard."):
        if info.name not in NOT_IMPORTED:
            names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def test_every_module_is_found() -> None:
    # the walk must see the whole tree, subpackages included
    for name in (
        "reshard.api",
        "reshard.mindspore",
        "reshard.mindspore.parallel",
        "reshard.formats.ckpt",
        "reshard.sources.registry",
    ):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_declares_all(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{name} declares no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names the module does not have: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_public_definitions_are_exported(name: str) -> None:
    module = importlib.import_module(name)
    defined = {
        n
        for n, value in vars(module).items()
        if not n.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == name
    }
    unlisted = defined - set(module.__all__) - NOT_EXPORTED.get(name, set())
    assert not unlisted, f"{name} defines public names missing from __all__: {sorted(unlisted)}"


def test_exclusions_are_still_defined() -> None:
    # an exclusion for a name that is gone, or that became exported, is stale
    for name, excluded in NOT_EXPORTED.items():
        module = importlib.import_module(name)
        for n in excluded:
            assert inspect.isclass(getattr(module, n, None)), f"{name}.{n} is gone: drop the exclusion"
            assert n not in module.__all__, f"{name}.{n} is exported now: drop the exclusion"


# --------------------------------------------------------------------------------------------
# The documented functions: Google-style sections, and examples that run on `reshard demo`'s files.

DOCUMENTED = {
    "reshard.api": (
        "check_destination",
        "convert",
        "convert_targets",
        "execute",
        "holds_only_ckpt",
        "needed_ranks",
        "recrypt",
        "split",
        "superseded",
        "transform",
        "transform_by_rank",
        "unify",
        # the discovery functions docs/python-api.md shows (defined in reshard.sources)
        "open_checkpoint",
        "source_file",
        "unified_index",
    ),
    "reshard.mindspore": tuple(importlib.import_module("reshard.mindspore").__all__),
    # the names shared with reshard.mindspore are the same objects, checked once above
    "reshard.mindspore.parallel": tuple(
        n
        for n in importlib.import_module("reshard.mindspore.parallel").__all__
        if n not in importlib.import_module("reshard.mindspore").__all__
    ),
}
SECTIONS = ("Args:", "Returns:", "Raises:", "Example:")
FUNCTIONS = [(module, name) for module, names in DOCUMENTED.items() for name in names]


def _function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _example(doc: str) -> str:
    """The code of the docstring's ``Example:`` section (indented under it, up to the next section)."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Example:") + 1
    body = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    return textwrap.dedent("\n".join(body)).strip() + "\n"


def test_every_public_api_function_is_documented() -> None:
    api = importlib.import_module("reshard.api")
    public = {n for n in api.__all__ if inspect.isfunction(getattr(api, n))}
    # the rest of the re-exported discovery helpers keep their one-paragraph docstrings
    helpers = {"full_model_file", "hf_model", "is_hf_model", "model_folder", "rank_sources", "has_crc_trailer"}
    assert public - helpers == set(DOCUMENTED["reshard.api"])


@pytest.mark.parametrize(("module", "name"), FUNCTIONS)
def test_docstring_sections(module: str, name: str) -> None:
    function = _function(module, name)
    doc = inspect.cleandoc(function.__doc__ or "")
    lines = doc.splitlines()
    assert lines and lines[0].strip() and (len(lines) == 1 or not lines[1].strip()), "one summary line first"
    at = [lines.index(section) if section in lines else -1 for section in SECTIONS]
    assert -1 not in at, f"{name}: missing {[s for s, i in zip(SECTIONS, at, strict=True) if i < 0]}"
    assert at == sorted(at), f"{name}: sections out of order"
    args = "\n".join(lines[at[0] + 1 : at[1]])
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is not parameter.VAR_KEYWORD:
            assert f"    {parameter.name}: " in args, f"{name}: parameter {parameter.name} not under Args"
    assert all(len(line) <= 120 for line in inspect.getsource(function).splitlines())


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``reshard demo --dir demo``, made once for the examples (they only read it)."""
    from reshard import demo

    folder = tmp_path_factory.mktemp("demo") / "demo"
    demo.main(str(folder))
    return str(folder)


@pytest.mark.parametrize(("module", "name"), FUNCTIONS)
def test_example_runs_on_the_demo(module: str, name: str, demo_dir: str, tmp_path, monkeypatch) -> None:
    code = _example(_function(module, name).__doc__)
    (tmp_path / "demo").symlink_to(demo_dir)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(demo_dir)
    exec(compile(code, f"<{module}.{name} example>", "exec"), {})
    assert _snapshot(demo_dir) == before, "an example must not change the shared demo folder"


def _snapshot(folder: str) -> dict[str, tuple[int, int]]:
    result = {}
    for root, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(root, f))
            result[os.path.join(root, f)] = (st.st_size, st.st_mtime_ns)
    return result
