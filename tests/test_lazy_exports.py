"""The packages that export their modules' names lazily (``reshard.lazy``) give every name as before."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from reshard import lazy

LAZY_PACKAGES = ("reshard.plan", "reshard.sources", "reshard.formats.dcp", "reshard.naming")


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_every_exported_name_is_its_modules_object(name: str) -> None:
    package = importlib.import_module(name)
    for module in pkgutil.iter_modules(package.__path__):  # every module loaded, as a long run would
        importlib.import_module(f"{name}.{module.name}")
    for exported in package.__all__:
        value = getattr(package, exported)
        home, original = lazy.homes(package.__file__, name)[exported]
        assert value is getattr(importlib.import_module(f"{name}.{home}"), original), exported
    assert set(package.__all__) == set(lazy.homes(package.__file__, name))  # no name listed in one place only
    assert set(package.__all__) <= set(dir(package))


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_no_exported_name_is_also_a_module_of_the_package(name: str) -> None:
    """Importing a submodule binds its name in the package: an exported name of the same spelling would
    then be the module (``reshard.sources.strategy`` was, until the function became ``open_strategy``)."""
    package = importlib.import_module(name)
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not modules & set(package.__all__)


def test_names_come_from_the_type_checking_block(tmp_path) -> None:
    """``homes`` reads only ``from <package>.<module> import`` lines under ``if TYPE_CHECKING:``; a name
    not there is an AttributeError, as for any module."""
    init = tmp_path / "pkg_init.py"
    init.write_text(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "if TYPE_CHECKING:\n"
        "    from reshard.plan.model import Plan, SourceFile as Facts\n"
        "    from collections import OrderedDict\n"
        "from reshard.plan.split import plan_split\n"
    )
    assert lazy.homes(str(init), "reshard.plan") == {"Plan": ("model", "Plan"), "Facts": ("model", "SourceFile")}
    namespace = {"__name__": "reshard.plan", "__file__": str(init)}
    getattr_, dir_ = lazy.exports(namespace)
    assert getattr_("Plan").__name__ == "Plan" and namespace["Plan"] is getattr_("Plan")
    assert getattr_("Facts").__name__ == "SourceFile"
    with pytest.raises(AttributeError, match="has no attribute 'plan_split'"):
        getattr_("plan_split")
    assert {"Plan", "Facts"} <= set(dir_())


def test_the_api_module_exports_every_name_from_its_home() -> None:
    """``reshard.api`` is a module, not a package: it exports names of modules anywhere under ``reshard``
    (``lazy.exports(..., within="reshard")``), each imported on its first read."""
    from reshard import api

    where = lazy.homes(api.__file__, "reshard")
    assert set(api.__all__) == set(where)  # no name listed in one place only
    for exported in api.__all__:
        home, original = where[exported]
        assert getattr(api, exported) is getattr(importlib.import_module(f"reshard.{home}"), original), exported
    assert set(api.__all__) <= set(dir(api))
    with pytest.raises(AttributeError, match=r"module 'reshard\.api' has no attribute 'nothing'"):
        api.nothing  # noqa: B018
