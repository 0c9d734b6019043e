"""Helpers shared by test modules of every tier: tests/core (one process, no ranks), tests/ranks
(thread-ranks on real gloo) and tests/processes (real processes). A test module imports them with
``from helpers import ...`` (tests/conftest.py puts tests/ on sys.path), never from another test
module; a helper that only one module uses stays in that module.
"""
import copy
import datetime
import itertools
import math
import pathlib
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.errors import GlobalTensorError, PlacementError, SbpError
from globaltensor.layout import Layout
from globaltensor.sbp import PartialSum
from globaltensor.tensor import GlobalTensor, dual_sbp
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum

# ----------------------------------------------------------------------------- paths

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository: README.md, launch.py, examples/, globaltensor/
SCRIPTS = TESTS / "scripts"  # rank scripts the launcher tests run
BEHAVE = str(SCRIPTS / "behave.py")

# ----------------------------------------------------------------------------- values and pieces


def two_stage_losses(stages, x, y, steps: int = 3) -> list[float]:
    """One process's losses of ``steps`` AdamW steps (lr 0.01) of two stages over 2 equal
    micro-batches of ``x`` and ``y`` (MSE, their mean): what gt.nn.Pipeline's 1F1B must give."""
    import torch.nn.functional as F
    ref = copy.deepcopy(stages)
    opt, want = torch.optim.AdamW([p for s in ref for p in s.parameters()], lr=0.01), []
    half = x.shape[0] // 2
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(F.mse_loss(ref[1](ref[0](x[i:i + half])), y[i:i + half])
                   for i in (0, half)) / 2
        loss.backward()
        opt.step()
        want.append(loss.item())
    return want


def gen(*shape, seed=0, dtype=torch.float64):
    """Normal random values of ``shape``, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def piece(full: torch.Tensor, layout: Layout, coord) -> torch.Tensor:
    """The piece at ``coord``; along a P axis the value is split into unequal parts. A
    head-tail layout's piece holds its ranges in their order (Layout.ranges)."""
    if layout.order:
        from globaltensor.plan import oracle
        return piece(oracle.permuted(full, layout.order), layout.plain(), coord)
    part = full[layout.slices(coord)].clone()
    if part.is_floating_point():
        for a, v in enumerate(layout.sbp):
            if isinstance(v, PartialSum):
                n = layout.placement.shape[a]
                part = part * (coord[a] + 1) / (n * (n + 1) / 2)
    return part


# ----------------------------------------------------------------------------- torch's OpInfo


def op_db():
    """torch's OpInfo database (skips the test where its testing internals cannot load)."""
    pytest.importorskip("expecttest")  # torch's testing internals need it
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def opinfo_samples(opinfo, count: int) -> list:
    """The first ``count`` float64 samples (requiring grad) of ``opinfo``; none where it cannot
    make samples here. (torch tracks each sample for its unittest classes by an
    ``inspect.stack()`` per call, with the source of every frame: under pytest's deep stacks and
    many modules that is 30x the samples' own cost; no TestCase runs here, so it is skipped.)"""
    import contextlib
    from unittest import mock
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    out = []
    with contextlib.ExitStack() as patches:
        for module in (common_utils, core):  # opinfo.core holds its own reference
            if hasattr(module, "extract_test_fn"):
                patches.enter_context(mock.patch.object(module, "extract_test_fn", lambda: None))
        try:
            for sample in opinfo.sample_inputs("cpu", torch.float64, requires_grad=True):
                out.append(sample)
                if len(out) >= count:
                    break
        except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
            pass
    return out


# ------------------------------------------------------------------------- global tensors vs torch
# ``check`` builds each input from its full value (a P input's pieces are unequal parts of it),
# runs the op on global tensors on thread-ranks, then compares the full output and the full
# gradients (for a cotangent laid out with the output's dual sbp) with torch on the full tensors.

G2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
GRIDS = [G2, G22]


def make_global(full: torch.Tensor, layout: Layout, rank: int) -> GlobalTensor:
    coord = layout.placement.coord_of(rank)
    local = piece(full, layout, coord) if coord is not None else full.new_empty((0,) * full.dim())
    return GlobalTensor._make(local.contiguous(), layout)


def sbp_options(t: torch.Tensor, grid):
    one = [S(d) for d in range(t.dim())] + [B]
    if t.is_floating_point():
        one.append(P)
    return list(itertools.product(one, repeat=grid.ndim))


def combos(inputs, grid):
    """Every sbp of every input: the full product on a 1-D grid; on larger grids each input runs
    through all of its options while the others cycle through theirs."""
    options = [sbp_options(t, grid) for t in inputs]
    if grid.ndim == 1 or len(inputs) == 1:
        return list(itertools.product(*options))
    out = []
    for i, opts in enumerate(options):
        for k, mine in enumerate(opts):
            out.append(tuple(mine if j == i else options[j][(k + 3 * j) % len(options[j])]
                             for j in range(len(inputs))))
    return out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def reference(fn, inputs, seed=7):
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = _first(fn(*leaves))
    cot = gen(*out.shape, seed=seed, dtype=out.dtype) if out.is_floating_point() else None
    grads = None
    if cot is not None and out.requires_grad:
        out.backward(cot)
        grads = [l.grad for l in leaves]
    return out.detach(), cot, grads


def run_global(fn, inputs, grid, sbps, cot, rank):
    xs = []
    for t, sbp in zip(inputs, sbps):
        x = make_global(t, Layout(grid, sbp, t.shape), rank)
        xs.append(x.requires_grad_() if t.is_floating_point() else x)
    out = _first(fn(*xs))
    full = out.full_tensor()
    grads = None
    if cot is not None and out.requires_grad:
        out.backward(make_global(cot, Layout(grid, dual_sbp(out.sbp), cot.shape), rank))
        grads = [x.grad.full_tensor() if x.grad is not None else None for x in xs]
    return full, grads, out.sbp


def run_no_grad(fn, inputs, grid, sbps, rank):
    """``fn``'s full output under ``torch.no_grad()``, where layouts are chosen without a
    backward to price: it must equal the grad-mode output."""
    with torch.no_grad():
        xs = [make_global(t, Layout(grid, sbp, t.shape), rank) for t, sbp in zip(inputs, sbps)]
        return _first(fn(*xs)).full_tensor()


def check(fn, inputs, grids=GRIDS, atol=1e-6, only=None, timeout=120):
    """Compare ``fn`` on global tensors with ``fn`` on the full ``inputs`` for every layout:
    the output and the inputs' gradients, and the output under ``torch.no_grad()`` too (on the
    grids of more than one axis, whose layouts include the 1-D ones along each axis: the suite's
    time)."""
    ref_out, cot, ref_grads = reference(fn, inputs)
    for grid in grids:
        cases = [c for c in combos(inputs, grid) if only is None or only(c)]
        no_grad_too = ref_grads is not None and (grid.ndim > 1 or len(grids) == 1)

        def body(rank):
            errors = []
            for sbps in cases:
                try:
                    full, grads, out_sbp = run_global(fn, inputs, grid, sbps, cot, rank)
                except Exception as e:  # noqa: BLE001 - reported with the layout
                    errors.append(f"{sbps}: {type(e).__name__}: {e}")
                    break
                what = f"in {gt.sbp.format_sbp(sbps[0]) if len(sbps) == 1 else sbps} -> {out_sbp}"
                if not torch.allclose(full.to(ref_out.dtype), ref_out, atol=atol, rtol=1e-5):
                    errors.append(f"forward differs for {what}")
                if no_grad_too and not torch.allclose(
                        run_no_grad(fn, inputs, grid, sbps, rank).to(ref_out.dtype), ref_out,
                        atol=atol, rtol=1e-5):
                    errors.append(f"forward under no_grad differs for {what}")
                if ref_grads is not None:
                    for i, (g, r) in enumerate(zip(grads, ref_grads)):
                        if r is not None and (g is None or not torch.allclose(g, r, atol=atol, rtol=1e-5)):
                            errors.append(f"grad of input {i} differs for {what}")
            return errors

        results = run_ranks(body, grid.size, timeout=timeout)
        assert results[0] == [], "\n".join(results[0][:10])
    return ref_out


# ----------------------------------------------------------------------------- errors


def error_or_none(fn):
    """Run ``fn``; return ``(type name, message)`` of the GlobalTensorError it raised, or None."""
    try:
        fn()
    except GlobalTensorError as e:
        return type(e).__name__, str(e)
    return None


# ----------------------------------------------------------------------------- conversions


def full_of(shape):
    """1, 2, 3, ... laid out in ``shape``: every element differs."""
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def random_cases(seed, count, world):
    """Random placements (1-3 axes, shuffled ranks, axes of size 1), shapes (with empty dims
    and scalars) and sbps."""
    rng = random.Random(seed)

    def placement():
        while True:
            shape = [rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 1, 2, 2, 3]))]
            if math.prod(shape) <= world:
                ranks = rng.sample(range(world), math.prod(shape))
                return gt.placement("cpu", np.array(ranks).reshape(shape).tolist())

    cases = []
    for _ in range(count):
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7]) for _ in range(rng.choice([0, 1, 2, 3])))
        src_p = placement()
        dst_p = src_p if rng.random() < 0.5 else placement()
        values = [S(d) for d in range(len(shape))] + [B, P]
        cases.append((Layout(src_p, tuple(rng.choice(values) for _ in range(src_p.ndim)), shape),
                      Layout(dst_p, tuple(rng.choice(values) for _ in range(dst_p.ndim)), shape)))
    return cases


# ------------------------------------------------------------------------- hypothesis strategies

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@st.composite
def grids(draw, max_size: int):
    """A grid shape of 1 to 3 axes with at most ``max_size`` cells."""
    grid, size = [], 1
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, max(1, min(4, max_size // size))))
        grid.append(n)
        size *= n
    return tuple(grid)


@st.composite
def placements(draw, world: int):
    """Any grid of distinct ranks of a world, in any order."""
    grid = draw(grids(world))
    ranks = draw(st.permutations(range(world)))[:math.prod(grid)]
    return gt.placement("cpu", np.array(ranks, dtype=np.int64).reshape(grid))


def sbp_values(tensor_ndim: int):
    choices = [st.just(B), st.just(P)]
    if tensor_ndim:
        choices.append(st.integers(-tensor_ndim, tensor_ndim - 1).map(S))
    return st.one_of(*choices)


@st.composite
def layouts(draw, world: int, shape=None, placement=None):
    placement = placement if placement is not None else draw(placements(world))
    shape = shape if shape is not None else draw(shapes)
    sbp = tuple(draw(sbp_values(len(shape))) for _ in range(placement.ndim))
    return Layout(placement, sbp, shape)


@st.composite
def conversions(draw, world: int):
    """(src, dst): one shape; half the time one placement, otherwise any two of the world."""
    src = draw(layouts(world))
    same = draw(st.booleans())
    dst = draw(layouts(world, shape=src.shape, placement=src.placement if same else None))
    return src, dst


def small_ints(shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    """Small integers: sums are exact in every dtype and order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=gen).to(dtype)


# ------------------------------------------------------------------------- the bad input sweep


def p1():
    return gt.placement("cpu", [0])


def _g():
    """A small global tensor on every rank of the world (world of 1: rank 0)."""
    return gt.ones(2, placement=gt.placement.all("cpu"), sbp=B)


# (id, call, error class, words the message must hold). Every call is cheap and local: it fails
# before any communication, so in a world of several ranks every rank fails alike, at once.
BAD_INPUT_CASES = [
    # placements
    ("placement type unknown", lambda: gt.placement("gpu", [0]), PlacementError, "found 'gpu'"),
    ("placement type not str", lambda: gt.placement(0, [0]), PlacementError, "device type"),
    ("placement no ranks", lambda: gt.placement("cpu"), PlacementError, "expected ranks"),
    ("placement empty list", lambda: gt.placement("cpu", []), PlacementError, "non-empty"),
    ("placement empty row", lambda: gt.placement("cpu", [[]]), PlacementError, "non-empty"),
    ("placement empty array", lambda: gt.placement("cpu", np.array([], dtype=np.int64)),
     PlacementError, "at least one rank"),
    ("placement ragged", lambda: gt.placement("cpu", [[0, 1], [2]]), PlacementError, "ragged"),
    ("placement float rank", lambda: gt.placement("cpu", [0.0]), PlacementError, "integer ranks"),
    ("placement str rank", lambda: gt.placement("cpu", ["0"]), PlacementError, "integer ranks"),
    ("placement bool rank", lambda: gt.placement("cpu", [True]), PlacementError, "integer ranks"),
    ("placement float array", lambda: gt.placement("cpu", np.array([0.0, 1.0])), PlacementError,
     "integer ranks"),
    ("placement set", lambda: gt.placement("cpu", {0, 1}), PlacementError, "integer ranks"),
    ("placement negative", lambda: gt.placement("cpu", [0, -1]), PlacementError, "ranks >= 0"),
    ("placement duplicate", lambda: gt.placement("cpu", [0, 0]), PlacementError, "distinct ranks"),
    ("placement.all unknown type", lambda: gt.placement.all("tpu"), PlacementError, "'tpu'"),
    ("placement axis out of range", lambda: p1().groups_along(1), PlacementError,
     "placement axis in [0, 1), found 1"),
    # sbp
    ("split float dim", lambda: S(1.0), SbpError, "int dim, found 1.0"),
    ("split bool dim", lambda: S(True), SbpError, "int dim, found True"),
    ("sbp string", lambda: gt.zeros(2, placement=p1(), sbp="S(0)"), SbpError, "found 'S(0)'"),
    ("sbp None entry", lambda: gt.zeros(2, placement=p1(), sbp=(None,)), SbpError, "found None"),
    ("sbp empty", lambda: gt.zeros(2, placement=p1(), sbp=()), SbpError, "at least one sbp"),
    ("sbp split uncalled", lambda: gt.zeros(2, placement=p1(), sbp=S), SbpError,
     "split(0), not gt.sbp.split"),
    ("sbp too many", lambda: gt.zeros(2, placement=p1(), sbp=(B, B)), SbpError,
     "expected 1 sbp value, one per placement axis, found 2: (B, B); pass a "
     "tuple like (gt.sbp.broadcast,)"),
    ("split dim out of range", lambda: gt.zeros(2, placement=p1(), sbp=S(1)), SbpError,
     "split(1) needs a tensor dim in [-1, 1)"),
    ("split of a 0-dim tensor", lambda: gt.tensor(3.0, placement=p1(), sbp=S(0)), SbpError,
     "split(0) needs a tensor dim in [0, 0)"),
    # layouts
    ("layout negative shape", lambda: gt.Layout(p1(), (B,), (-1, 2)), GlobalTensorError,
     "shape of ints >= 0, found (-1, 2)"),
    ("layout float shape", lambda: gt.Layout(p1(), (B,), (1.5,)), GlobalTensorError,
     "shape of ints >= 0"),
    ("layout shape not a sequence", lambda: gt.Layout(p1(), (B,), 5), GlobalTensorError,
     "found 5"),
    ("layout placement a list", lambda: gt.Layout([0], (B,), (2,)), PlacementError,
     "found [0] (list)"),
    # factories
    ("factory no placement", lambda: gt.zeros(2, sbp=B), GlobalTensorError, "need placement="),
    ("factory placement a list", lambda: gt.zeros(2, placement=[0], sbp=B), GlobalTensorError,
     "expected placement=gt.placement(type, ranks), found [0] (list)"),
    ("factory ranks beyond world", lambda: gt.zeros(2, placement=gt.placement("cpu", [0, 7]),
                                                    sbp=B), PlacementError, "found [7]"),
    ("factory negative size", lambda: gt.zeros(-1, placement=p1(), sbp=B), GlobalTensorError,
     "non-negative ints, found [-1]"),
    ("factory float size", lambda: gt.ones(2.0, placement=p1(), sbp=B), GlobalTensorError,
     "non-negative ints, found [2.0]"),
    ("factory dtype string", lambda: gt.zeros(2, placement=p1(), sbp=B, dtype="float32"),
     GlobalTensorError, "torch.dtype (e.g. torch.float32) or None, found 'float32'"),
    ("random dtype string", lambda: gt.randn(2, placement=p1(), sbp=B, dtype="float32"),
     GlobalTensorError, "found 'float32'"),
    ("requires_grad on ints", lambda: gt.zeros(2, placement=p1(), sbp=B, dtype=torch.int64,
                                               requires_grad=True),
     GlobalTensorError, "floating point or complex dtype, found torch.int64"),
    ("full size an int", lambda: gt.full(3, 1.0, placement=p1(), sbp=B), GlobalTensorError,
     "size as a tuple or list of ints, found 3"),
    ("full value a string", lambda: gt.full((3,), "a", placement=p1(), sbp=B),
     GlobalTensorError, "fill_value to be a number, found 'a'"),
    ("arange zero step", lambda: gt.arange(0, 3, 0, placement=p1(), sbp=B), GlobalTensorError,
     "non-zero step"),
    ("arange string end", lambda: gt.arange("3", placement=p1(), sbp=B), GlobalTensorError,
     "arange's end to be a number, found '3'"),
    ("randint empty range", lambda: gt.randint(3, 3, (2,), placement=p1(), sbp=B),
     GlobalTensorError, "low < high"),
    ("randint size an int", lambda: gt.randint(0, 3, 2, placement=p1(), sbp=B),
     GlobalTensorError, "size as a tuple or list of ints, found 2"),
    ("tensor ragged data", lambda: gt.tensor([[1, 2], [3]], placement=p1(), sbp=B),
     GlobalTensorError, "rectangular nested list"),
    ("cuda placement without cuda", lambda: gt.zeros(2, placement=gt.placement("cuda", [0]),
                                                     sbp=B),
     GlobalTensorError, "needs CUDA, found none"),
    # local -> global
    ("to_global without sbp", lambda: torch.ones(2).to_global(placement=p1()), GlobalTensorError,
     "needs both placement and sbp"),
    ("to_global placement a list", lambda: torch.ones(2).to_global(placement=[0], sbp=B),
     GlobalTensorError, "found [0] (list)"),
    ("to_global split of 0-dim", lambda: torch.tensor(1.0).to_global(placement=p1(), sbp=S(0)),
     SbpError, "split(0) needs a tensor dim in [0, 0)"),
    ("to_global split dim beyond", lambda: torch.ones(2).to_global(placement=p1(), sbp=S(2)),
     SbpError, "split(2) needs a tensor dim in [-1, 1)"),
    ("to_global bad grad_sbp", lambda: torch.ones(2).to_global(placement=p1(), sbp=B,
                                                               grad_sbp="x"),
     SbpError, "found 'x'"),
    ("to_global ranks beyond world", lambda: torch.ones(2).to_global(
        placement=gt.placement("cpu", [9]), sbp=B), PlacementError, "found [9]"),
    # global -> global
    ("redistribute placement a list", lambda: _g().to_global(placement=[0]), GlobalTensorError,
     "found [0] (list)"),
    ("redistribute split dim beyond", lambda: _g().to_global(sbp=S(3)), SbpError,
     "split(3) needs a tensor dim"),
    ("redistribute sbp too many", lambda: _g().to_global(sbp=(B, B)), SbpError,
     "expected 1 sbp value,"),
    ("redistribute 1-D to 2-D without sbp", lambda: _g().to_global(
        placement=gt.placement("cpu", [[0]])), GlobalTensorError, "needs an sbp for each of its 2"),
    ("redistribute to another device type", lambda: _g().to_global(
        placement=gt.placement("cuda", [0])), GlobalTensorError, "between device types"),
    ("redistribute bad grad_sbp", lambda: _g().to_global(sbp=S(0), grad_sbp=5), SbpError,
     "found 5 (int)"),
    ("item of many elements", lambda: _g().item(), GlobalTensorError, "one element, found shape"),
    ("pickle a global tensor", lambda: pickle.dumps(_g()), GlobalTensorError, "cannot be pickled"),
    # misc public entry points
    ("explain a local tensor", lambda: gt.explain(torch.ones(2), sbp=B), GlobalTensorError,
     "expects a global tensor, found Tensor"),
    ("explain bad sbp", lambda: gt.explain(_g(), sbp="B"), SbpError, "found 'B'"),
    ("visualize a local tensor", lambda: gt.visualize(torch.ones(2)), GlobalTensorError,
     "global tensor or a Layout, found Tensor"),
    ("manual_seed a string", lambda: gt.manual_seed("a"), GlobalTensorError, "found 'a'"),
    ("set_debug not a bool", lambda: gt.set_debug("yes"), GlobalTensorError, "found 'yes'"),
    ("init timeout a string", lambda: gt.init(timeout="5"), GlobalTensorError,
     "seconds > 0 or a datetime.timedelta, found '5'"),
    ("init timeout negative", lambda: gt.init(timeout=datetime.timedelta(seconds=-1)),
     GlobalTensorError, "seconds > 0"),
]


# ----------------------------------------------------------------------------- training


def train_mse(model, opt, x, y, steps: int) -> list:
    """``steps`` optimizer steps on the MSE loss of ``model(x)`` against ``y``; the losses
    (``.item()``: collective on global tensors)."""
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- sharded training
# (gt.nn.fully_shard: tests/ranks/test_fully_shard.py, tests/processes/test_fully_shard_compile.py)


class Block(torch.nn.Module):
    def __init__(self, h, remat=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 3 * h)
        self.down = torch.nn.Linear(3 * h, h)
        self.remat = remat

    def _inner(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))

    def forward(self, x):
        if self.remat:  # activation checkpointing inside the unit
            return x + checkpoint(self._inner, x, use_reentrant=False)
        return x + self._inner(x)


class Net(torch.nn.Module):
    """Hidden 10 and 7 inputs: every piece uneven on 4 ranks."""

    def __init__(self, h=10, n=3, remat=False, generator_seed=None):
        super().__init__()
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        self.emb = torch.nn.Linear(7, h)
        self.layers = torch.nn.ModuleList(Block(h, remat) for _ in range(n))
        self.head = torch.nn.Linear(h, 5)

    def forward(self, x):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


REF_NET = Net(generator_seed=0)
X_NET = torch.randn(12, 7, generator=torch.Generator().manual_seed(3))


def one_process(model, steps=3, micro=1):
    """Losses and final state of AdamW on the mean square of ``model(X_NET)``."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        for x in X_NET.chunk(micro):
            loss = m(x).pow(2).mean() / micro
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in m.state_dict().items()}


def shard(model, placement, axis=None, **kwargs):
    """One gt.nn.fully_shard unit per block, then the root (as torchtitan spells it)."""
    for layer in model.layers:
        gt.nn.fully_shard(layer, placement, axis, **kwargs)
    return gt.nn.fully_shard(model, placement, axis, **kwargs)


def full_state(m):
    """``m``'s state dict as full values (collective)."""
    return {k: v.full_tensor() for k, v in m.state_dict().items()}


def assert_matches(expected, got, loss_tol=1e-5, tol=1e-4):
    (el, es), (gl, gs) = expected, got
    assert gl == pytest.approx(el, abs=loss_tol)
    assert es.keys() == gs.keys()
    for k in es:
        torch.testing.assert_close(gs[k], es[k], atol=tol, rtol=tol, msg=k)


# ----------------------------------------------------------------------------- gt.auto_layout
# (tests/core/test_auto_layout.py, tests/ranks/test_auto_layout_applied.py)


def llama(layers=4):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa",
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


class Attention(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, h))


class GPTBlock(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.attn = Attention(h, heads)
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


def gpt(vocab=64, h=32, heads=4, layers=4):
    """An nn.Sequential GPT: embedding, pre-norm blocks of causal attention and an MLP, norm, head."""
    return torch.nn.Sequential(torch.nn.Embedding(vocab, h),
                               *[GPTBlock(h, heads) for _ in range(layers)],
                               torch.nn.LayerNorm(h), torch.nn.Linear(h, vocab, bias=False))
