"""IDE support (issue 34 item 9): a typed package, every public module listing only its public
API in ``__all__`` (no ``contextvars``, ``dataclass`` or helpers), docstrings on the public
functions, and annotations a type checker reads: the factories and ``GlobalTensor``'s methods
return ``GlobalTensor`` (read at runtime here; mypy itself runs under ``-m slow``)."""
import ast
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import types
import typing

import pytest
import torch

import globaltensor as gt
from globaltensor import convert, factories
from globaltensor.placement import Placement
from globaltensor.sbp import SbpValue
from globaltensor.tensor import GlobalTensor
from helpers import ROOT

PUBLIC = ["globaltensor", "globaltensor.env", "globaltensor.sbp", "globaltensor.placement",
          "globaltensor.debug", "globaltensor.data", "globaltensor.factories",
          "globaltensor.random", "globaltensor.tools.explain", "globaltensor.tools.visualize",
          "globaltensor.tools.policy", "globaltensor.tools.trace", "globaltensor.tools.verify",
          "globaltensor.testing", "globaltensor.launch.spawn", "globaltensor.launch",
          "globaltensor.comm", "globaltensor.nn", "globaltensor.checkpoint",
          "globaltensor.errors", "globaltensor.mode.global_mode"]
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


def _ours(value) -> bool:
    return inspect.isfunction(value) and value.__module__.startswith("globaltensor")


FACTORIES = [n for n in factories.__all__ if _ours(getattr(factories, n))]


def test_every_public_function_has_a_docstring():
    # every factory, and every function of globaltensor's that gt exports (gt.placement is the
    # Placement class: its docstring is the class's)
    names = {f"factories.{n}": getattr(factories, n) for n in factories.__all__}
    names.update({f"gt.{n}": getattr(gt, n) for n in gt.__all__
                  if _ours(getattr(gt, n)) or n == "placement"})
    assert len(FACTORIES) >= 22 and "randperm" in FACTORIES and "randint_like" in FACTORIES
    assert [n for n, value in names.items() if not inspect.getdoc(value)] == []


def test_every_factory_is_annotated_to_return_a_global_tensor():
    assert set(FACTORIES) <= set(gt.__all__)  # gt re-exports them all
    wrong = {n: typing.get_type_hints(getattr(factories, n)).get("return") for n in FACTORIES}
    assert {n: r for n, r in wrong.items() if r is not GlobalTensor} == {}


def test_global_tensor_methods_are_annotated():
    def returns(f):
        return typing.get_type_hints(getattr(f, "fget", f))["return"]

    assert GlobalTensor.to_global is convert.to_global  # what runs: installed by gt's import
    assert returns(GlobalTensor.to_global) is GlobalTensor
    hints = typing.get_type_hints(convert.to_global)
    assert hints["placement"] == typing.Optional[Placement]
    for name in ("to_local", "full_tensor"):
        assert returns(getattr(GlobalTensor, name)) is torch.Tensor, name
    assert returns(GlobalTensor.placement) is Placement
    assert returns(GlobalTensor.sbp) == tuple[SbpValue, ...]
    assert returns(GlobalTensor.is_global) is bool and returns(GlobalTensor.is_local) is bool
    assert {"type", "shape", "flat_ranks", "axes"} <= set(typing.get_type_hints(Placement))


def _function(tree, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_to_global_type_checkers_see_is_the_one_that_runs():
    # GlobalTensor declares to_global under `if TYPE_CHECKING:` (what mypy and pyright read);
    # at runtime it is convert.to_global: the two signatures must not drift apart
    def parsed(name: str) -> ast.Module:
        return ast.parse((ROOT / "globaltensor" / name).read_text())

    installed = _function(parsed("convert.py"), "to_global")
    body = next(n for n in parsed("tensor.py").body
                if isinstance(n, ast.ClassDef) and n.name == "GlobalTensor").body
    guard = next(n for n in body
                 if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = _function(guard, "to_global")

    def signature(f: ast.FunctionDef) -> str:
        return ast.unparse(f.args) + " -> " + ast.unparse(f.returns)

    assert signature(declared) == signature(installed)


USER_FILE = """
    import typing
    import torch
    import globaltensor as gt

    p = gt.placement("cpu", [0, 1])
    x = gt.zeros(4, 4, placement=p, sbp=gt.sbp.split(0))
    y = x.to_global(sbp=gt.sbp.broadcast)
    z = gt.GlobalTensor.to_global(torch.ones(2), placement=p, sbp=gt.sbp.split(0))
    w = typing.cast(gt.GlobalTensor, y.relu())
    reveal_type(y)
    reveal_type(y.to_local())
    reveal_type(y.placement)
    reveal_type(z.full_tensor())
    reveal_type(w.sbp)
    reveal_type(y.placement.flat_ranks)
    x.to_global(placement=p, sbp=(gt.sbp.split(0),), grad_sbp={0: gt.sbp.partial_sum})
    x.to_global(sbp=1, bogus=2)
"""


@pytest.mark.slow
def test_mypy_reads_the_annotations(tmp_path):
    # ~15 s cold on 2 busy cores (most of it reading torch's stubs), hence -m slow
    pytest.importorskip("mypy", reason="the type-check test needs mypy (pip install mypy; it "
                                       "is in the test extra)")
    source = textwrap.dedent(USER_FILE)
    (tmp_path / "user.py").write_text(source)
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = silent\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's globaltensor, not an install
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
                          "--cache-dir", str(tmp_path / "cache"), "user.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    revealed = [line.split("Revealed type is ")[1].strip('"') for line in out.splitlines()
                if "Revealed type is" in line]
    sbp = "globaltensor.sbp.Split | globaltensor.sbp.Broadcast | globaltensor.sbp.PartialSum"
    assert revealed == ["globaltensor.tensor.GlobalTensor", "torch._tensor.Tensor",
                        "globaltensor.placement.Placement", "torch._tensor.Tensor",
                        f"tuple[{sbp}, ...]", "tuple[int, ...]"], out
    errors = [line for line in out.splitlines() if ": error:" in line]
    wrong = f"user.py:{source.splitlines().index('x.to_global(sbp=1, bogus=2)') + 1}:"
    assert len(errors) == 2 and all(line.startswith(wrong) for line in errors), out
    assert 'Unexpected keyword argument "bogus"' in out and 'Argument "sbp"' in out, out
