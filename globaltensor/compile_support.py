"""What ``torch.compile`` needs from globaltensor besides the traceable tensor (tensor.py) and
the traced emitter (runtime/emit.py): globaltensor's own frames that torch calls into
(``__torch_dispatch__``, autograd Functions' backward, gradient hooks, the flatten protocol)
are never compiled by dynamo as frames of their own. Where a compiled function graph-breaks
(e.g. at ``loss.backward()``), dynamo's frame hook stays active for the eager code between
graphs and would otherwise try to compile the dispatcher itself. Marked once, at import: the
mark is a flag on the code object, read only while a compiled function runs, so eager calls
pay nothing.

Nothing here imports ``torch._dynamo`` (about a second of CPU at every start of every rank):
the frame marks are set through torch's C extension, and what needs dynamo's Python side waits
until the program imports it (``torch.compile`` and ``torch.optim`` do), see
``when_dynamo_is_imported``.
"""
from __future__ import annotations

import importlib.abc
import sys

_DYNAMO = "torch._dynamo"
_waiting: list = []  # callbacks for when torch._dynamo is imported


def never_compiled(*functions) -> None:
    """Dynamo runs these functions, and everything they call, as plain Python (recursively
    skipped, as ``torch.compiler.disable`` does, without a wrapper frame)."""
    from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
    from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy

    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for fn in functions:
        fn = getattr(fn, "__func__", fn)
        set_code_exec_strategy(fn.__code__, strategy)



def when_dynamo_is_imported(callback) -> None:
    """Call ``callback(torch._dynamo)`` now if torch._dynamo is imported, else as soon as its
    import ends (before the importing code goes on: before anything is traced)."""
    dynamo = sys.modules.get(_DYNAMO)
    if dynamo is not None:
        callback(dynamo)
        return
    _waiting.append(callback)
    if not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo through the other finders and runs ``_waiting`` right after the
    module's code: Python has no post-import hook of its own."""

    def find_spec(self, name, path, target=None):
        if name != _DYNAMO:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            if self in sys.meta_path:  # once: a later import finds it in sys.modules
                sys.meta_path.remove(self)
            while _waiting:
                _waiting.pop(0)(module)

        loader.exec_module = exec_module
        return spec


def nonstrict(fn):
    """``fn`` as one opaque call in dynamo's graph (``torch._dynamo.nonstrict_trace``, which
    AOTAutograd then traces), from the moment the program imports torch._dynamo; plain ``fn``
    until then. Its arguments must be tensors or constants dynamo can pass (ints, tuples,
    registered pytree constants)."""
    current = [fn]
    when_dynamo_is_imported(lambda dynamo: current.__setitem__(0, dynamo.nonstrict_trace(fn)))

    def call(*args):
        return current[0](*args)
    call.__name__, call.__doc__, call.__wrapped__ = fn.__name__, fn.__doc__, fn
    call.target = lambda: current[0]  # what a call runs now
    return call
