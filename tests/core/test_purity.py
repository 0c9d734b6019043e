"""The shape of the package, read from its source: the pure core never imports torch.distributed
nor asks which rank is running; ``runtime`` never imports ``comm``; ``ops`` imports nothing from
``tensor`` or ``dispatch``; and the one import cycle is ``tensor`` <-> ``dispatch``."""
import ast
import pathlib

import pytest

from helpers import ROOT

PKG = ROOT / "globaltensor"
# the pure core, and every op family module: rows, kernels (which get what they need from their
# context object) and size rewrites
PURE = ["sbp.py", "placement.py", "layout.py", "debug.py", "_cache.py", "errors.py",
        "tools/visualize.py"] + sorted(
            str(p.relative_to(PKG)) for folder in ("plan", "ops") for p in (PKG / folder).glob("*.py"))
FORBIDDEN_IMPORTS = ("torch.distributed", "globaltensor.comm", "globaltensor.runtime",
                     "globaltensor.tensor", "globaltensor.dispatch", "globaltensor.convert",
                     "globaltensor.redistribute")
# the world's size (never the rank) may be read lazily inside a function: placement.all()
LAZY_ONLY = ("globaltensor.env", "globaltensor.world.world")
FORBIDDEN_CALLS = ("get_rank", "get_local_rank", "cached_rank")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imported(module: str, is_package: bool, node) -> list[str]:
    """The absolute names an import statement imports (``from . import a, b`` names two)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = (node.module or "").split(".") if not node.level else module.split(".")
    if node.level:
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        base += node.module.split(".") if node.module else []
    target = ".".join(base)
    # `from pkg import mod` imports a module, `from mod import name` does not
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in _MODULES else target for a in node.names]


def _imports(path: pathlib.Path, top_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (a function-level import hides a
    dependency, it does not remove it), or at its top level only."""
    name = _module_name(path)
    found = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_imported(name, path.name == "__init__.py", node))
    return found


@pytest.mark.parametrize("name", PURE)
def test_pure_module(name):
    path = PKG / name
    assert path.exists(), f"{name} is listed as pure but does not exist"
    for n in _imports(path):
        assert not any(n == f or n.startswith(f + ".") for f in FORBIDDEN_IMPORTS), \
            f"{name} imports {n}"
    for n in _imports(path, top_level_only=True):
        assert n not in LAZY_ONLY, f"{name} imports {n} at its top level"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            pytest.fail(f"{name} asks for {node.attr}")


def _graph() -> dict[str, set[str]]:
    """Module -> the globaltensor modules it imports."""
    return {name: {m for m in _imports(path) if m in _MODULES and m != name}
            for name, path in _MODULES.items()}


def _cycles(graph) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _unit(name: str) -> str:
    """``globaltensor.dispatch.args`` -> ``dispatch``: the top-level module or package."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_only_import_cycle_is_tensor_and_dispatch():
    units: dict = {}
    for name, edges in _graph().items():
        units.setdefault(_unit(name), set()).update(
            _unit(e) for e in edges if _unit(e) not in ("", _unit(name)))
    units.pop("", None)
    assert _cycles(units) == [{"tensor", "dispatch"}]
    for cycle in _cycles(_graph()):  # between modules too, not only packages
        assert {_unit(m) for m in cycle} == {"tensor", "dispatch"}, f"import cycle: {sorted(cycle)}"


def test_the_cycle_is_one_name_each_way():
    def names(path, level, module):
        return {a.name for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.ImportFrom) and n.level == level and n.module == module
                for a in n.names}

    assert names(PKG / "tensor.py", 1, "dispatch") == {"dispatch"}
    from_tensor = set()
    for path in (PKG / "dispatch").glob("*.py"):
        from_tensor |= names(path, 2, "tensor")
    assert from_tensor == {"GlobalTensor"}


def test_runtime_never_imports_comm_and_ops_never_imports_tensor_or_dispatch():
    for name, edges in _graph().items():
        if _unit(name) == "runtime":
            assert not {e for e in edges if _unit(e) == "comm"}, f"{name} imports comm"
        if _unit(name) == "ops":
            bad = {e for e in edges if _unit(e) in ("tensor", "dispatch")}
            assert not bad, f"{name} imports {sorted(bad)}"


def _import_froms(path: pathlib.Path):
    """(the absolute module, the names) of every ``from ... import`` in ``path``."""
    name, is_package = _module_name(path), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if not node.level else name.split(".")
            if node.level:
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                base += node.module.split(".") if node.module else []
            yield ".".join(base), [a.name for a in node.names]


def test_the_planner_is_used_through_its_facade_and_public_names():
    # plan/__init__ only re-exports; outside plan/ the planner is imported from that facade
    # (ops.choose, the runtime, the user surface), and no module imports a private name of
    # the planner's (inside plan/ each part uses another's public names too)
    facade = PKG / "plan" / "__init__.py"
    for node in ast.parse(facade.read_text()).body:
        assert isinstance(node, ast.ImportFrom) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) or (
            isinstance(node, ast.Assign) and node.targets[0].id == "__all__"), ast.dump(node)[:80]
    for name, path in _MODULES.items():
        inside = name.startswith("globaltensor.plan")
        for target, names in _import_froms(path):
            if not target.startswith("globaltensor.plan"):
                continue
            assert inside or target == "globaltensor.plan", f"{name} imports {target}"
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{name} imports {private} from {target}"


def test_no_private_name_crosses_modules():
    # a name with a leading underscore is its module's own: no `from .x import _y` between
    # globaltensor's modules, and no `x._y` on a module imported as `x` (package-private
    # *modules*, such as _cache, are imported by name; torch's privates are torch's business)
    for name, path in _MODULES.items():
        modules = set()
        for target, names in _import_froms(path):
            if not target.startswith("globaltensor"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")
                       and f"{target}.{n}" not in _MODULES]
            assert not private, f"{name} imports {private} from {target}"
            modules.update(n for n in names if f"{target}.{n}" in _MODULES)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(a.asname or a.name.split(".")[0] for a in node.names
                               if a.name.startswith("globaltensor"))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                pytest.fail(f"{name} reads {node.value.id}.{node.attr} (line {node.lineno})")


def _identifiers(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.alias):
            yield node.asname or node.name, getattr(node, "lineno", 0)


def test_one_vocabulary_grid_not_mesh():
    # a placement's shape is its `grid`; `axis` is a placement axis, `dim` a tensor dim
    for name, path in _MODULES.items():
        for ident, line in _identifiers(ast.parse(path.read_text())):
            parts = ident.lower().strip("_").split("_")
            assert "mesh" not in parts, f"{name}:{line}: `{ident}`: call a placement's shape `grid`"


# the only `global` statements: process-wide state installed or cached once per process
GLOBALS = {
    "globaltensor.world.world": {"_LAST_RANK"},  # cached_rank: a one-entry cache keyed by the world's group
    "globaltensor.runtime.layoutcheck": {"_LAST"},  # the record of the world asked last (as above)
    "globaltensor.testing": {"_installed"},  # run_ranks makes torch's registry per-thread, once
    # the planner's cost figures: process-wide, as the plan caches are (gt.set_costs clears them)
    "globaltensor.plan.cost": {"ALPHA", "BETA", "MEMORY", "COPY", "_CURRENT"},
}


def test_configuration_is_never_a_module_global_set_with_global():
    found = {}
    for name, path in _MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found.setdefault(name, set()).update(node.names)
    assert found == GLOBALS, "configuration is an argument or a contextvars.ContextVar"


def test_short_files_and_functions():
    # house style 10: no file over 450 lines, no function over 60 (docstring included)
    for name, path in _MODULES.items():
        text = path.read_text()
        assert text.count("\n") <= 450, f"{name} has {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{name}.{node.name} has {length} lines"


# ----------------------------------------------------------------------------- the house by audience
# (DESIGN.md, "The shape of the house"; docs/architecture.md: one paragraph per room)

EFFECTS = ("runtime", "comm", "world", "checkpoint", "launch")


def test_tools_are_a_leaf_the_core_never_imports():
    # the core announces through observe.py; the tools listen (only the face imports them)
    for name, edges in _graph().items():
        if _unit(name) in ("tools", "") or name == "globaltensor":
            continue
        bad = sorted(e for e in edges if _unit(e) == "tools")
        assert not bad, f"{name} imports {bad}: announce through globaltensor.observe instead"


def test_global_mode_is_imported_only_by_the_face_and_nn():
    for name, edges in _graph().items():
        if _unit(name) in ("mode", "nn") or name == "globaltensor":
            continue
        bad = sorted(e for e in edges if _unit(e) == "mode")
        assert not bad, f"{name} imports {bad}"


def test_torch_distributed_is_called_only_from_the_effects_layer():
    for name, path in _MODULES.items():
        if _unit(name) in EFFECTS or name == "globaltensor.testing":
            continue
        found = sorted(n for n in _imports(path) if n == "torch.distributed"
                       or n.startswith("torch.distributed."))
        assert not found, f"{name} imports {found}: go through runtime/ (or world/, comm/)"


# torch.distributed's calls that move data (process groups, ranks and stores are not data)
DATA_CALLS = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
              "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
              "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv",
              "batch_isend_irecv", "P2POp", "all_gather_object", "broadcast_object_list",
              "send_object_list", "recv_object_list", "gather", "scatter", "reduce", "barrier",
              "monitored_barrier", "gather_object", "scatter_object_list", "_c10d_functional"}
# the tensor side: all but the user's gt.comm, the world, the launcher, DCP and the test harness
NOT_TENSOR_SIDE = ("comm", "world", "launch", "checkpoint")


def _distributed_data_calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases = {"dist", "c10d"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names
                           if a.asname and a.name.startswith("torch.distributed"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"{a.name} (line {node.lineno})" for a in node.names if a.name in DATA_CALLS]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in DATA_CALLS:
            base = node.value
            named = isinstance(base, ast.Name) and base.id in aliases
            dotted = isinstance(base, ast.Attribute) and base.attr in ("distributed", "ops")
            if named or dotted:
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_every_byte_goes_through_the_wire():
    # DESIGN "One wire": runtime/wire.py is the only module of the tensor side that calls
    # torch.distributed's data calls; each of its calls announces one event
    for name, path in _MODULES.items():
        if (_unit(name) in NOT_TENSOR_SIDE or name in ("globaltensor.testing",
                                                       "globaltensor.runtime.wire")):
            continue
        found = _distributed_data_calls(path)
        assert not found, f"{name} moves data itself: {found}; go through runtime/wire.py"
    assert _distributed_data_calls(PKG / "runtime" / "wire.py")  # the check sees real calls


def test_op_families_import_neither_the_planner_nor_the_choice():
    for name, edges in _graph().items():
        if _unit(name) != "ops" or name.startswith("globaltensor.ops.choice") or name == "globaltensor.ops":
            continue
        bad = sorted(e for e in edges if e.startswith(("globaltensor.plan", "globaltensor.ops.choice")))
        assert not bad, f"{name} imports {bad}: only ops/choice/ prices plans"


@pytest.mark.parametrize("package", sorted(str(p.parent.relative_to(PKG.parent))
                                           for p in PKG.rglob("__init__.py")))
def test_every_package_docstring_names_every_module_of_its_folder(package):
    folder = PKG.parent / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    if folder == PKG:
        return  # the face's docstring is the project's; docs/architecture.md maps the root
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
    missing = sorted(n for n in names if n not in doc)
    assert not missing, f"{package}/__init__.py's docstring does not name {missing}"


def _replicated_spellings(tree):
    """``(B,) * placement.ndim``-like expressions: a one-element tuple or list of a broadcast
    value times something's ``ndim``."""
    broadcast_names = {"B", "B_SBP", "broadcast", "Broadcast"}
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            seq, times = node.left, node.right
            if not (isinstance(seq, (ast.Tuple, ast.List)) and len(seq.elts) == 1):
                continue
            value = seq.elts[0]
            name = value.func if isinstance(value, ast.Call) else value
            named = getattr(name, "id", None) or getattr(name, "attr", None)
            if named in broadcast_names and "ndim" in ast.unparse(times):
                yield node.lineno


def test_the_replicated_sbp_is_spelled_once():
    # sbp.replicated(ndim): B on every placement axis
    for name, path in _MODULES.items():
        if name == "globaltensor.sbp":
            continue
        lines = list(_replicated_spellings(ast.parse(path.read_text())))
        assert not lines, f"{name}:{lines}: write sbp.replicated(placement.ndim)"
