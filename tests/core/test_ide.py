"""IDE support (issue 34 item 9): a typed package, and every public module listing only its
public API in ``__all__`` (no ``contextvars``, ``dataclass`` or helpers)."""
import importlib
import inspect
import types

import pytest

from helpers import ROOT

PUBLIC = ["globaltensor", "globaltensor.env", "globaltensor.sbp", "globaltensor.placement",
          "globaltensor.debug", "globaltensor.data", "globaltensor.factories",
          "globaltensor.random", "globaltensor.explain", "globaltensor.visualize",
          "globaltensor.policy", "globaltensor.trace", "globaltensor.verify",
          "globaltensor.testing", "globaltensor.launch.spawn", "globaltensor.launch",
          "globaltensor.comm", "globaltensor.nn", "globaltensor.checkpoint",
          "globaltensor.errors", "globaltensor.mode"]
NOT_API = {"annotations", "contextvars", "dataclass", "dataclasses", "torch", "os", "sys",
           "functools", "Iterable", "Union"}


@pytest.mark.parametrize("name", PUBLIC)
def test_public_modules_list_only_their_api(name):
    module = importlib.import_module(name)
    names = module.__all__
    assert len(set(names)) == len(names)
    for n in names:
        assert hasattr(module, n), f"{name}.__all__ names {n}, which it lacks"
        assert not n.startswith("_") and n not in NOT_API, n
        value = getattr(module, n)  # a module listed is one of ours (gt.env, gt.nn.parallel)
        assert not isinstance(value, types.ModuleType) or value.__name__.startswith("globaltensor."), n


def test_env_lists_its_functions_only():
    import globaltensor as gt

    assert "contextvars" not in gt.env.__all__ and "dataclass" not in gt.env.__all__
    assert {"get_rank", "get_world_size", "print0", "rank_zero_only"} <= set(gt.env.__all__)


def test_the_package_is_typed_and_ships_py_typed():
    assert (ROOT / "globaltensor" / "py.typed").exists()
    assert 'globaltensor = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("name", ["tensor", "zeros", "ones", "full", "empty", "arange", "rand",
                                  "randn", "randint", "linspace", "eye", "placement"])
def test_public_factories_have_docstrings(name):
    import globaltensor as gt

    assert inspect.getdoc(getattr(gt, name)), name
