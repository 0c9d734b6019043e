"""Modules with global parameters: ``module.to_global`` and ``gt.nn.to_global``.

A module's parameters and buffers are taken as *full* values (the first rank of the placement
wins) and laid out with the sbp chosen for each. Each parameter's ``.grad`` is brought to the
parameter's own layout after it is accumulated, so a broadcast weight's gradient is summed over
the ranks that share it: data parallel with no wrapper::

    mlp.to_global(placement, lambda name, t: gt.sbp.split(1) if name == "w1" else gt.sbp.broadcast)
    opt = torch.optim.AdamW(mlp.parameters())   # build the optimizer after the conversion
"""
from __future__ import annotations

import functools
import itertools
import types

import torch

from .. import observe
from ..grads import parameter_replaced
from ..materialize import meta_message, meta_piece
from ..world.simulated import simulated
from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
from ..sbp import Broadcast, PartialSum, SBP_TYPES, format_sbp, normalize, replicated
from ..compile_support import never_compiled
from ..convert import check_placement
from ..tensor import GlobalTensor, redistribute
from . import experts, pretrained

__all__ = ["to_global", "to_local"]


def to_global(module: torch.nn.Module, placement: Placement, sbp_fn=None) -> torch.nn.Module:
    """Turn ``module``'s parameters and buffers into global tensors, in place; returns it.

    ``sbp_fn(name, tensor) -> sbp`` picks each tensor's sbp by its qualified name (``"0.weight"``);
    an sbp value instead of a function applies to every tensor; None (or a function returning
    None) means broadcast. Shared parameters stay shared. A local tensor is taken as the *full*
    value, except the pieces ``to_local`` left (each is taken as this rank's piece of the layout
    it came from); a global tensor is laid out anew.
    """
    placement = check_placement(placement)
    choose = _sbp_chooser(sbp_fn, placement)
    converted: dict[int, torch.Tensor] = {}
    for sub, store, name, qualified, parameter in _slots(module):
        piece_of = sub.__dict__.get(_PIECES, {}).get(name)
        store[name] = _converted(store[name], qualified, placement, choose, converted, parameter,
                                 piece_of)
    for sub in module.modules():
        sub.__dict__.pop(_PIECES, None)
    _refresh_flat_weights(module)
    run_forward_in_global_mode(module, placement)
    experts.install(module)
    if any(meta_pieces(module)):
        module.__dict__[MAYBE_META] = True  # checked at each forward until materialized
    return module


# a module's attribute: it was laid out with meta tensors (built under torch.device("meta")):
# its forward checks them until to_empty / loading has given every piece data
MAYBE_META = "_gt_maybe_meta"


def meta_pieces(module: torch.nn.Module):
    """(qualified name, tensor) of ``module``'s parameters and buffers whose piece (or value,
    for a plain tensor) is still on the meta device."""
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        piece = t._local if isinstance(t, GlobalTensor) else t
        if piece.is_meta:
            yield name, t


def check_materialized(module: torch.nn.Module, what: str) -> None:
    """``what`` (a forward) needs data: a clear error naming the first tensor of ``module`` that
    is still meta (not inside gt.simulate, where every tensor is); else the check is done for
    good (the module's flag cleared)."""
    if simulated():
        return
    first = next(meta_pieces(module), None)
    if first is None:
        module.__dict__.pop(MAYBE_META, None)
        return
    raise GlobalTensorError(meta_message(what, first[0], first[1]))


def _refresh_flat_weights(module: torch.nn.Module) -> None:
    """RNN/LSTM/GRU keep a list of their weights besides ``_parameters``; torch refreshes it in
    ``_apply`` (``.to()``), so do the same after the tensors are replaced."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.RNNBase):
            sub._init_flat_weights()


# a module's attribute: {name: Layout} of its tensors that to_local made pieces of that layout
_PIECES = "_gt_pieces"


def to_local(module: torch.nn.Module, *, full: bool = False) -> torch.nn.Module:
    """Turn ``module``'s global parameters and buffers into plain tensors, in place; returns it.
    Leaves the forward out of global mode.

    By default each becomes this rank's *piece* (``Tensor.to_local``: no communication), as
    OneFlow's ``Module.to_local``; the module remembers the layout of each piece, so
    ``module.to_global(placement, sbp)`` later takes them as pieces and gives back the same
    global values (laid out with the sbp it is given). ``full=True``: each becomes its *full*
    value instead (collective: every rank gets them), a plain single-device module, for
    export, ``torch.save`` of one rank's state, or single-device tests."""
    converted: dict[int, torch.Tensor] = {}
    for sub, store, name, qualified, parameter in _slots(module):
        value = store[name]
        if not isinstance(value, GlobalTensor):
            continue
        if id(value) not in converted:
            plain = value.detach().full_tensor() if full else value.detach().to_local()
            converted[id(value)] = (torch.nn.Parameter(plain, requires_grad=value.requires_grad)
                                    if parameter else plain)
            if parameter:
                parameter_replaced(value, qualified, "module.to_local")
        store[name] = converted[id(value)]
        if not full:
            sub.__dict__.setdefault(_PIECES, {})[name] = value._layout
    _refresh_flat_weights(module)
    handles = module.__dict__.pop("_gt_global_mode", None)
    for h in handles or ():
        h.remove()
    module.__dict__.pop(PLACEMENT, None)
    module.__class__ = _plain_class(type(module))
    return module


def _slots(module):
    """(submodule, its _parameters or _buffers, name, qualified name, is a parameter) for
    every parameter and buffer (shared ones once per place they appear)."""
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for store, parameter in ((sub._parameters, True), (sub._buffers, False)):
            out += [(sub, store, name, join_name(prefix, name), parameter)
                    for name, value in store.items() if value is not None]
    return out


def run_forward_in_global_mode(module: torch.nn.Module, placement: Placement) -> None:
    """The module's forward runs in ``gt.global_mode(placement)`` (mode/global_mode.py): positions, masks and
    rotary tables it builds with torch's factories are global (broadcast) tensors."""
    from ..mode.global_mode import GlobalMode

    for h in module.__dict__.pop("_gt_global_mode", None) or ():
        h.remove()
    entered: list = []

    def enter(mod, args, kwargs=None):
        if mod.__dict__.get(MAYBE_META):
            check_materialized(mod, f"{type(mod).__name__}.forward")
        mode = GlobalMode(placement)
        mode.__enter__()
        entered.append(mode)

    def leave(mod, args, *rest):
        if entered:
            entered.pop().__exit__(None, None, None)

    # torch.compile(module) runs the hooks as frames of their own (torch's _call_impl is not
    # traced): dynamo traced each, found no op, fell back to eager and then traced their callees
    # one by one (check_placement, get_world_size, a generator it refuses). Plain Python there;
    # inlined (a compiled function that calls the module) they are traced as before
    never_compiled(enter, leave)

    module.__dict__["_gt_global_mode"] = (
        module.register_forward_pre_hook(enter, prepend=True),
        module.register_forward_hook(leave, always_call=True),
    )
    module.__dict__[PLACEMENT] = placement
    module.__class__ = _entry_points_in_global_mode(_plain_class(type(module)))


# public methods that need full values rather than global mode: name -> wrapper of the method
_SPECIAL = {"save_pretrained": pretrained.save_pretrained}

# torch.nn.Module's own methods that run in global mode too: a state dict of full local tensors
# (a plain checkpoint, every rank holding the same values) is taken as broadcast values, so
# each parameter keeps its layout and takes its piece
_MODULE_ENTRY_POINTS = ("load_state_dict",)

# a converted module's attribute: the placement its public methods run in global mode on
PLACEMENT = "_gt_placement"


def _plain_class(cls: type) -> type:
    """The user's class of a module whose class :func:`_entry_points_in_global_mode` made."""
    return cls.__dict__.get("_gt_plain_class", cls)


@functools.cache
def _entry_points_in_global_mode(cls: type) -> type:
    """A subclass of ``cls`` (same name and module) whose public methods, those of ``cls`` and
    of its bases and mixins but ``torch.nn.Module`` (HF's ``generate``,
    ``prepare_inputs_for_generation``, ...), and ``load_state_dict``, run in global mode on the
    instance's placement; ``forward`` has its hooks. A class,
    not instance attributes, so ``copy.deepcopy`` of the module keeps calling its own."""
    namespace = {"_gt_plain_class": cls, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__}
    for klass in cls.__mro__:
        if klass in torch.nn.Module.__mro__:  # Module's own (to, state_dict, ...) and object's
            continue
        for name, value in vars(klass).items():
            if (name.startswith("_") or name == "forward" or name in namespace
                    or not isinstance(value, types.FunctionType)):
                continue
            namespace[name] = _SPECIAL.get(name, _in_global_mode)(getattr(cls, name))
    for name in _MODULE_ENTRY_POINTS:
        namespace.setdefault(name, _in_global_mode(getattr(cls, name)))
    return type(cls.__name__, (cls,), namespace)


def _in_global_mode(method):
    from ..mode.global_mode import GlobalMode

    @functools.wraps(method)
    def entry_point(self, *args, **kwargs):
        placement = self.__dict__.get(PLACEMENT)
        if placement is None:
            return method(self, *args, **kwargs)
        with GlobalMode(placement):
            return method(self, *args, **kwargs)
    return entry_point


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _sbp_chooser(sbp_fn, placement: Placement):
    if sbp_fn is None:
        return lambda name, t: replicated(placement.ndim)
    is_value = (isinstance(sbp_fn, (list, tuple, dict) + SBP_TYPES)
                or sbp_fn in (Broadcast, PartialSum))
    if not is_value and callable(sbp_fn):
        def choose(name, t):
            value = sbp_fn(name, t)
            if value is None:
                return replicated(placement.ndim)
            return _normalized(value, name, placement)
        return choose
    fixed = _normalized(sbp_fn, "every tensor", placement)
    return lambda name, t: fixed


def _normalized(value, name, placement):
    try:
        return normalize(value, placement.ndim, placement.axes)
    except GlobalTensorError as e:
        raise GlobalTensorError(f"module.to_global: the sbp for {name}: {e}") from None


def _converted(value, name, placement, choose, converted, parameter, piece_of=None):
    key = id(value)
    if key in converted:
        return converted[key]
    sbp = choose(name, value)
    if isinstance(value, GlobalTensor):  # already global: lay it out anew (the value is kept)
        g = relaid(value.detach(), placement, sbp, name)
    elif piece_of is not None:  # a piece to_local left: global again as it was, then laid out
        g = relaid(_from_piece(value.detach(), piece_of, name), placement, sbp, name)
    else:
        g = full_to_global(value.detach(), placement, sbp, name)
    if parameter:
        # a global leaf that requires grad keeps its .grad in its own layout (grads.py)
        g = torch.nn.Parameter(g, requires_grad=value.requires_grad)
        parameter_replaced(value, name, "module.to_global")
        observe.storage_kind(g, "parameters")  # gt.memory / gt.simulate count it so
    converted[key] = converted[id(g)] = g  # a shared submodule, met again, keeps it
    return g


def full_to_global(full: torch.Tensor, placement: Placement, sbp, name) -> GlobalTensor:
    """The full value on each rank -> global with ``sbp``; the first rank's values win. A meta
    tensor (a model built under ``torch.device("meta")``) becomes a global tensor with a meta
    piece: a layout only, no data and no communication (``to_empty`` allocates the pieces);
    inside ``gt.simulate``, where every factory makes meta tensors, the path the real run
    takes: that one for what the user built on meta, the broadcast for the rest."""
    if full.is_meta and (not simulated() or observe.holds_no_data(full)):
        # (gt.simulate plays the real run's broadcast of what holds data there)
        try:
            layout = Layout(placement, sbp, tuple(full.shape))
        except GlobalTensorError as e:
            raise GlobalTensorError(f"module.to_global: {name} of shape {list(full.shape)}: {e}") from None
        return GlobalTensor._make(meta_piece(layout, full), layout)
    try:
        whole = full.to_global(placement=placement, sbp=replicated(placement.ndim))
        layout = Layout(placement, sbp, tuple(full.shape))
    except GlobalTensorError as e:
        raise GlobalTensorError(f"module.to_global: {name} of shape {list(full.shape)}: {e}") from None
    return redistribute(whole, layout)


def _from_piece(piece: torch.Tensor, layout: Layout, name) -> GlobalTensor:
    """The global tensor of ``layout`` whose piece on this rank is ``piece`` (the pieces' shapes
    are checked across the ranks)."""
    g = piece.to_global(placement=layout.placement, sbp=layout.sbp)
    if tuple(g.shape) != layout.shape:
        raise GlobalTensorError(
            f"module.to_global: {name} was made a local piece of a global tensor of shape "
            f"{list(layout.shape)} by module.to_local(); its pieces now make shape "
            f"{list(g.shape)}. After module.to_local() the next module.to_global() takes the "
            f"module's tensors as pieces; keep their shapes, or use module.to_local(full=True) "
            f"to work with full values")
    return g


def relaid(value: GlobalTensor, placement: Placement, sbp, name) -> GlobalTensor:
    try:
        return value.to_global(placement=placement, sbp=sbp)
    except GlobalTensorError as e:
        raise GlobalTensorError(f"module.to_global: {name} (already global, sbp "
                                f"{format_sbp(value.sbp)}): {e}") from None


def _module_to_global(self: torch.nn.Module, placement: Placement, sbp=None) -> torch.nn.Module:
    """``module.to_global(placement, sbp)``: see :func:`globaltensor.nn.to_global`."""
    return to_global(self, placement, sbp)


def install_module_methods():
    """``nn.Module.to_global`` (called once by globaltensor/__init__.py)."""
    torch.nn.Module.to_global = _module_to_global
    torch.nn.Module.to_local = to_local
