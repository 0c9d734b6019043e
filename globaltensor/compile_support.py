"""What ``torch.compile`` needs from globaltensor besides the traceable tensor (tensor.py) and
the traced emitter (runtime/emit.py): globaltensor's own frames that torch calls into
(``__torch_dispatch__``, autograd Functions' backward, gradient hooks, the flatten protocol)
are never compiled by dynamo as frames of their own. Where a compiled function graph-breaks
(e.g. at ``loss.backward()``), dynamo's frame hook stays active for the eager code between
graphs and would otherwise try to compile the dispatcher itself. Marked once, at import: the
mark is a flag on the code object, read only while a compiled function runs, so eager calls
pay nothing.
"""
from __future__ import annotations


def never_compiled(*functions) -> None:
    """Dynamo runs these functions, and everything they call, as plain Python (recursively
    skipped, as ``torch.compiler.disable`` does, without a wrapper frame)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for fn in functions:
        fn = getattr(fn, "__func__", fn)
        set_code_exec_strategy(fn.__code__, strategy)

