"""The packages that export their modules' names lazily (``reshard.lazy``) give every name as before."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from reshard import lazy

LAZY_PACKAGES = ("reshard.plan", "reshard.sources", "reshard.formats.dcp")


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_every_exported_name_is_its_modules_object(name: str) -> None:
    package = importlib.import_module(name)
    for module in pkgutil.iter_modules(package.__path__):  # every module loaded, as a long run would
        importlib.import_module(f"{name}.{module.name}")
    for exported in package.__all__:
        value = getattr(package, exported)
        home = next(m for m, names in package._homes.items() if exported in names)
        assert value is getattr(importlib.import_module(f"{name}.{home}"), exported), exported
    assert set(package.__all__) <= set(dir(package))


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_no_exported_name_is_also_a_module_of_the_package(name: str) -> None:
    """Importing a submodule binds its name in the package: an exported name of the same spelling would
    then be the module (``reshard.sources.strategy`` was, until the function became ``open_strategy``)."""
    package = importlib.import_module(name)
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not modules & set(package.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    getattr_, dir_ = lazy.exports("reshard.plan", {"model": ("Plan",)}, {})
    assert getattr_("Plan").__name__ == "Plan"
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        getattr_("nothing")
    assert "Plan" in dir_()
