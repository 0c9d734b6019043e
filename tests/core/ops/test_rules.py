"""SBP rule tables, checked in one process: every row of every table is run on the pieces of
every grid coordinate and the assembled outputs are compared with the op on the full tensors."""
import itertools
import math

import pytest
import torch

from globaltensor import ops
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.placement import Placement
from globaltensor.ops import pieces
from globaltensor.ops import B, KEEP, LOCAL, NUMBER, P, S, Call, Ref, choose, sig, table
from globaltensor.sbp import Broadcast, PartialSum, Split
from globaltensor.plan import DEFAULT

from helpers import G2, G22, GRIDS, gen, piece

ALPHA = DEFAULT.alpha  # the suite prices with the default figures

aten = torch.ops.aten


# ----------------------------------------------------------------------------- the oracle
# (piece, in helpers: the piece at a coordinate; along a P axis, unequal parts of the value)


def assemble(pieces: dict, layout: Layout) -> torch.Tensor:
    """The logical value from each coordinate's piece (summing partial replicas)."""
    any_piece = next(iter(pieces.values()))
    full = torch.zeros(layout.shape, dtype=any_piece.dtype)
    for coord, p in pieces.items():
        if any(c != 0 for a, c in enumerate(coord) if isinstance(layout.sbp[a], Broadcast)):
            continue
        full[layout.slices(coord)] += p
    return full


def local_args(args, tensors_at):
    it = iter(tensors_at)
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(next(it))
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            out.append([next(it) for _ in a])
        else:
            out.append(a)
    return out


def flat_tensors(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            out.extend(a)
    return out


def make_call(op: str, args, kwargs=(), tags=()):
    shapes, counter = [], itertools.count()

    def mark(v):
        if isinstance(v, torch.Tensor):
            shapes.append(tuple(v.shape))
            return Ref(next(counter))
        if isinstance(v, list):
            return tuple(mark(x) for x in v)
        if isinstance(v, float):
            return NUMBER
        return v
    margs = tuple(mark(a) for a in args)
    return Call(op, tuple(shapes), margs, tuple(sorted(kwargs)), frozenset(tags))


def every_candidate(rule, n_in, mesh):
    for combo in itertools.product(rule.rows, repeat=len(mesh)):
        if len({r.kernel for r in combo if r.kernel}) > 1:
            continue
        yield combo


def check_rows(func, args, grid, op=None, tags=(), rewrite=None, kwargs=None, skip_kernels=True,
               only=None):
    """Run every candidate of the op's rule on the simulated pieces; return the number checked.
    ``only``: the rows a candidate may hold (the others' kernels are not the op itself)."""
    kwargs = kwargs or {}
    op = op or f"{func._schema.name.split('::')[1]}.{func._overloadname}"
    call = make_call(op, args, tuple(kwargs.items()), tags)
    rule = ops.rows_for(call)
    assert rule is not None, f"no rule for {op}"
    full_in = flat_tensors(args)
    expected = func(*args, **kwargs)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    checked = 0
    for combo in every_candidate(rule, len(full_in), grid.shape):
        if skip_kernels and any(r.kernel for r in combo):
            continue
        if only is not None and not all(only(r) for r in combo):
            continue
        ins = [tuple(B if r.ins[i] is KEEP else r.ins[i] for r in combo) for i in range(len(full_in))]
        outs = ops.outs_of(combo)
        if rule.check is not None and not rule.check(call, grid.shape, ins, outs):
            continue
        in_layouts = [Layout(grid, sbp, t.shape) for t, sbp in zip(full_in, ins)]
        if any(isinstance(v, PartialSum) and not t.is_floating_point()
               for t, l in zip(full_in, in_layouts) for v in l.sbp):
            continue
        out_layouts = [Layout(grid, outs[k] if len(outs) > 1 else outs[0], e.shape)
                       for k, e in enumerate(expected)]
        got = {}
        for coord in grid.coords():
            pieces = [piece(t, l, coord) for t, l in zip(full_in, in_layouts)]
            largs = local_args(args, pieces)
            if rewrite:
                rewrite(largs, out_layouts[0], coord)
            res = func(*largs, **kwargs)
            got[coord] = res if isinstance(res, (tuple, list)) else (res,)
        for k, (e, lay) in enumerate(zip(expected, out_layouts)):
            value = assemble({c: g[k] for c, g in got.items()}, lay)
            what = f"{op} ins {[str(l.sbp) for l in in_layouts]} -> out {lay.sbp} on {grid.shape}"
            if e.dtype == torch.bool:
                assert torch.equal(value.bool(), e), what
            else:
                torch.testing.assert_close(value.to(e.dtype), e, msg=what)
        checked += 1
    return checked


def view_rewrite(largs, out_layout, coord):
    largs[1] = list(out_layout.local_shape(coord))


# ----------------------------------------------------------------------------- table syntax


def test_sig_parses_compact_rows():
    row = sig("S(1) S(0) -> P")
    assert row.ins == (S(1), S(0)) and row.outs == (P,) and row.kernel is None
    assert sig("* -> B").ins == (KEEP,)
    assert str(sig("S(0) B -> S(0)", "k")) == "S(0) B -> S(0)  [k]"
    assert len(table("B -> B", "P -> P")) == 2


def test_view_groups():
    assert ops.view_groups((4, 6), (2, 2, 6)) == (((0,), (0, 1)), ((1,), (2,)))
    assert ops.view_groups((2, 3, 4), (6, 4)) == (((0, 1), (0,)), ((2,), (1,)))
    assert ops.view_groups((1, 4), (4,)) == (((0,), ()), ((1,), (0,)))
    with pytest.raises(GlobalTensorError, match="cannot view"):
        ops.view_groups((4, 6), (5, 5))


# ----------------------------------------------------------------------------- choice


def layouts(grid, *specs):
    return tuple(Layout(grid, sbp, shape) for sbp, shape in specs)


MM_CASES = [
    ((S(0), B), S(0)),      # S(0)·B -> S(0)
    ((B, S(1)), S(1)),      # B·S(1) -> S(1)
    ((S(1), S(0)), P),      # S(1)·S(0) -> P
    ((P, B), P),            # P·B -> P
    ((B, P), P),
    ((B, B), B),
]


@pytest.mark.parametrize("ins,out", MM_CASES)
def test_mm_keeps_the_signature_at_hand_for_free(ins, out):
    call = make_call("mm.default", [gen(4, 6), gen(6, 8)])
    choice = choose(call, layouts(G2, ((ins[0],), (4, 6)), ((ins[1],), (6, 8))), (4, 4))
    # nothing moves; a partial result is a reduction owed, priced at one α
    assert choice.cost == (ALPHA if out == P else 0) and choice.outs == ((out,),)


def test_mm_on_2d_grid_is_the_product_of_axis_rows():
    call = make_call("mm.default", [gen(4, 6), gen(6, 8)])
    ls = layouts(G22, ((S(0), S(1)), (4, 6)), ((B, S(0)), (6, 8)))
    choice = choose(call, ls, (4, 4))
    assert choice.cost == ALPHA and choice.outs == ((S(0), P),)  # the reduction owed


def test_add_of_a_partial_and_a_broadcast_defers_the_reduction():
    # P + B: the B input is zero-filled into a P (local) and the sum stays P, instead of a
    # reduction now (Megatron's residual stream: the all-reduce happens once, where a
    # nonlinear op needs the value; a backward's partial gradients flow on the same way)
    call = make_call("add.Tensor", [gen(4, 6), gen(4, 6)], tags=("pointwise",))
    choice = choose(call, layouts(G2, ((P,), (4, 6)), ((B,), (4, 6))), (4, 4))
    assert [l.sbp for l in choice.ins] == [(P,), (P,)] and choice.outs == ((P,),)
    assert ALPHA < choice.cost < 1.01 * ALPHA  # no collective: only the reduction owed
    # nothing partial: nothing is made partial (B + B and S + S stay as they are)
    for sbp in (B, S(0)):
        kept = choose(call, layouts(G2, ((sbp,), (4, 6)), ((sbp,), (4, 6))), (4, 4))
        assert kept.outs == ((sbp,),) and kept.cost == 0
    # a nonlinear op takes no partial input: exp(P) reduces first
    exp = choose(make_call("exp.default", [gen(4, 6)], tags=("pointwise",)),
                 layouts(G2, ((P,), (4, 6))), (4,))
    assert exp.ins[0].sbp != (P,) and exp.outs != ((P,),)


def test_partial_plus_partial_stays_partial_and_mul_by_broadcast_too():
    add = make_call("add.Tensor", [gen(4), gen(4)], tags=("pointwise",))
    mul = make_call("mul.Tensor", [gen(4), gen(4)], tags=("pointwise",))
    assert choose(add, layouts(G2, ((P,), (4,)), ((P,), (4,))), (4, 4)).outs == ((P,),)
    assert choose(mul, layouts(G2, ((P,), (4,)), ((B,), (4,))), (4, 4)).outs == ((P,),)
    both = choose(mul, layouts(G2, ((P,), (4,)), ((P,), (4,))), (4, 4))
    # P*P is not linear: a factor is reduced first. Reducing one (all_reduce, P*B -> P, one
    # reduction still owed) and reduce-scattering both (S*S -> S, nothing owed) cost the same
    # two α and the same bytes; the one that owes nothing wins the tie
    assert [l.sbp for l in both.ins] == [(S(0),), (S(0),)] and both.outs == ((S(0),),)


def test_add_of_a_scalar_to_a_partial_is_not_partial():
    call = make_call("add.Tensor", [gen(4), 1.0], tags=("pointwise",))
    choice = choose(call, layouts(G2, ((P,), (4,))), (4,))
    assert choice.outs != ((P,),)


def test_sum_over_split_dim_gives_partial():
    call = make_call("sum.dim_IntList", [gen(4, 6), [0]])
    assert choose(call, layouts(G2, ((S(0),), (4, 6))), (4,)).outs == ((P,),)
    assert choose(call, layouts(G2, ((S(1),), (4, 6))), (4,)).outs == ((S(0),),)


def test_max_over_split_dim_gathers():
    call = make_call("amax.default", [gen(4, 6), [0]])
    choice = choose(call, layouts(G2, ((S(0),), (4, 6))), (4,))
    assert choice.ins[0].sbp != (S(0),) and choice.cost > 0


def test_inplace_self_keeps_its_layout():
    call = make_call("add_.Tensor", [gen(4, 6), gen(4, 6)], tags=("pointwise", "inplace"))
    choice = choose(call, layouts(G2, ((S(1),), (4, 6)), ((S(0),), (4, 6))), (4, 4), fixed=(0,))
    assert choice.ins[0].sbp == (S(1),) and choice.ins[1].sbp == (S(1),)
    assert choose(call, layouts(G2, ((B,), (4, 6)), ((P,), (4, 6))), (4, 4), fixed=(0,)).ins[1].sbp == (B,)


def test_no_rule_returns_none():
    assert choose(make_call("histogram.bin_ct", [gen(4)]), layouts(G2, ((B,), (4,))), (4,)) is None


SBPS_2D = [S(0), S(1), B, P]


@pytest.mark.parametrize("grid", GRIDS, ids=["[2]", "[2,2]"])
def test_choice_makes_an_input_partial_only_beside_a_partial_and_always_exists(grid):
    calls = [
        (make_call("mm.default", [gen(4, 6), gen(6, 8)]), [(4, 6), (6, 8)]),
        (make_call("add.Tensor", [gen(4, 6), gen(6)], tags=("pointwise",)), [(4, 6), (6,)]),
        (make_call("view.default", [gen(4, 6), [24]]), [(4, 6)]),
        (make_call("sum.dim_IntList", [gen(4, 6), [1], True]), [(4, 6)]),
    ]
    for call, shapes in calls:
        per_input = [[s for s in itertools.product(SBPS_2D, repeat=grid.ndim)
                      if all(not isinstance(v, Split) or v.dim < len(shape) for v in s)]
                     for shape in shapes]
        for combo in itertools.product(*per_input):
            ls = tuple(Layout(grid, sbp, shape) for sbp, shape in zip(combo, shapes))
            choice = choose(call, ls, (4,) * len(ls))
            assert choice is not None, (call.op, combo)
            for src, dst in zip(ls, choice.ins):
                for a, v in enumerate(dst.sbp):  # a P is joined (deferred), never made up
                    assert (not isinstance(v, PartialSum) or isinstance(src.sbp[a], PartialSum)
                            or any(isinstance(l.sbp[a], PartialSum) for l in ls)), (call.op, combo)


# ----------------------------------------------------------------------------- every row, simulated

POINTWISE = [
    ("add", aten.add.Tensor, [gen(4, 6), gen(4, 6, seed=1)]),
    ("add broadcast", aten.add.Tensor, [gen(4, 6), gen(6, seed=1)]),
    ("add size-1", aten.add.Tensor, [gen(4, 1), gen(1, 6, seed=1)]),
    ("add scalar", aten.add.Tensor, [gen(4, 6), 2.0]),
    ("sub", aten.sub.Tensor, [gen(4, 6), gen(4, 6, seed=1)]),
    ("mul", aten.mul.Tensor, [gen(4, 6), gen(4, 6, seed=1)]),
    ("mul scalar", aten.mul.Tensor, [gen(4, 6), 3.0]),
    ("div", aten.div.Tensor, [gen(4, 6), gen(4, 6, seed=1).abs() + 1]),
    ("relu", aten.relu.default, [gen(4, 6)]),
    ("exp", aten.exp.default, [gen(4, 6)]),
    ("neg", aten.neg.default, [gen(4, 6)]),
    ("gt", aten.gt.Tensor, [gen(4, 6), gen(4, 6, seed=1)]),
    ("where", aten.where.self, [gen(4, 6) > 0, gen(4, 6, seed=1), gen(4, 6, seed=2)]),
    ("threshold_backward", aten.threshold_backward.default, [gen(4, 6), gen(4, 6, seed=1), 0.0]),
    ("clone", aten.clone.default, [gen(4, 6)]),
]


@pytest.mark.parametrize("grid", GRIDS, ids=["[2]", "[2,2]"])
@pytest.mark.parametrize("name,func,args", POINTWISE, ids=[c[0] for c in POINTWISE])
def test_pointwise_rows(name, func, args, grid):
    assert check_rows(func, args, grid, tags=("pointwise",)) >= 3


OTHERS = [
    ("mm", aten.mm.default, [gen(4, 6), gen(6, 8, seed=1)], None),
    ("mm uneven", aten.mm.default, [gen(5, 3), gen(3, 7, seed=1)], None),
    ("bmm", aten.bmm.default, [gen(2, 4, 6), gen(2, 6, 4, seed=1)], None),
    ("dot", aten.dot.default, [gen(6), gen(6, seed=1)], None),
    ("mv", aten.mv.default, [gen(4, 6), gen(6, seed=1)], None),
    ("sum", aten.sum.default, [gen(4, 6)], None),
    ("sum dim", aten.sum.dim_IntList, [gen(4, 6), [1]], None),
    ("sum dim keep", aten.sum.dim_IntList, [gen(4, 6, 2), [0, 2], True], None),
    ("amax", aten.amax.default, [gen(4, 6), [1]], None),
    ("max dim", aten.max.dim, [gen(4, 6), 0], None),
    ("argmax", aten.argmax.default, [gen(4, 6), 1], None),
    ("norm", aten.linalg_vector_norm.default, [gen(4, 6), 2, [1]], None),
    ("softmax", aten._softmax.default, [gen(4, 6), 1, False], None),
    ("log_softmax", aten._log_softmax.default, [gen(4, 6), 0, False], None),
    ("softmax backward", aten._softmax_backward_data.default,
     [gen(4, 6), gen(4, 6, seed=1).softmax(1), 1, torch.float64], None),
    ("cumsum", aten.cumsum.default, [gen(4, 6), 1], None),
    ("view merge", aten.view.default, [gen(4, 6), [24]], view_rewrite),
    ("view split", aten.view.default, [gen(4, 6), [2, 2, 6]], view_rewrite),
    ("view uneven", aten.view.default, [gen(5, 6), [5, 2, 3]], view_rewrite),
    ("view unsqueeze", aten.view.default, [gen(4, 6), [4, 1, 6]], view_rewrite),
    ("permute", aten.permute.default, [gen(2, 4, 6), [2, 0, 1]], None),
    ("transpose", aten.transpose.int, [gen(4, 6), 0, 1], None),
    ("t", aten.t.default, [gen(4, 6)], None),
    ("unsqueeze", aten.unsqueeze.default, [gen(4, 6), 1], None),
    ("squeeze", aten.squeeze.dim, [gen(4, 1, 6), 1], None),
    ("select", aten.select.int, [gen(4, 6), 0, 2], None),
    ("slice", aten.slice.Tensor, [gen(4, 6), 1, 1, 5], None),
    ("split", aten.split.Tensor, [gen(4, 6), 2, 1], None),
    ("unbind", aten.unbind.int, [gen(4, 6), 1], None),
    ("cat", aten.cat.default, [[gen(4, 6), gen(4, 2, seed=1)], 1], None),
    ("stack", aten.stack.default, [[gen(4, 6), gen(4, 6, seed=1)], 0], None),
    ("gather", aten.gather.default, [gen(4, 6), 1, torch.tensor([[0, 5], [1, 1], [2, 3], [4, 0]])], None),
    ("scatter_add", aten.scatter_add.default,
     [gen(4, 6), 1, torch.tensor([[0, 5], [1, 1], [2, 3], [4, 0]]), gen(4, 2, seed=1)], None),
    ("index_select", aten.index_select.default, [gen(4, 6), 0, torch.tensor([3, 0, 0])], None),
    ("index", aten.index.Tensor, [gen(4, 6), [torch.tensor([[3, 0], [1, 1]])]], None),
    ("tril", aten.tril.default, [gen(2, 4, 4)], None),
    ("diagonal", aten.diagonal.default, [gen(3, 4, 2), 1, 0, 2], None),
    ("select_scatter", aten.select_scatter.default, [gen(4, 6), gen(4, seed=1), 1, 2], None),
    ("slice_scatter", aten.slice_scatter.default, [gen(4, 6), gen(2, 6, seed=1), 0, 1, 3, 1], None),
    ("diagonal_scatter", aten.diagonal_scatter.default,
     [gen(3, 4, 4), gen(3, 3, seed=1), 1, 1, 2], None),
    ("embedding", aten.embedding.default, [gen(10, 4), torch.tensor([[1, 9], [0, 3]])], None),
    ("embedding backward", aten.embedding_dense_backward.default,
     [gen(2, 2, 4), torch.tensor([[1, 9], [1, 3]]), 10, -1, False], None),
    ("layer_norm", aten.native_layer_norm.default, [gen(4, 6), [6], gen(6, seed=1), gen(6, seed=2), 1e-5], None),
    ("nll_loss none", aten.nll_loss_forward.default,
     [gen(4, 5).log_softmax(1), torch.tensor([0, 4, 2, 1]), None, 0, -100], None),
    ("nll_loss sum", aten.nll_loss_forward.default,
     [gen(4, 5).log_softmax(1), torch.tensor([0, 4, 2, 1]), None, 2, -100], None),
    ("conv2d", aten.convolution.default,
     [gen(2, 3, 5, 5), gen(4, 3, 3, 3, seed=1), gen(4, seed=2), [1, 1], [1, 1], [1, 1], False, [0, 0], 1], None),
]


@pytest.mark.parametrize("grid", GRIDS, ids=["[2]", "[2,2]"])
@pytest.mark.parametrize("name,func,args,rewrite", OTHERS, ids=[c[0] for c in OTHERS])
def test_rows(name, func, args, rewrite, grid):
    assert check_rows(func, args, grid, rewrite=rewrite) >= 2


def test_layer_norm_backward_rows():
    x, w, b = gen(4, 6), gen(6, seed=1), gen(6, seed=2)
    out, mean, rstd = aten.native_layer_norm.default(x, [6], w, b, 1e-5)
    args = [gen(4, 6, seed=3), x, [6], mean, rstd, w, b, [True, True, True]]
    for grid in GRIDS:
        assert check_rows(aten.native_layer_norm_backward.default, args, grid) >= 2


def test_convolution_backward_rows():
    x, w = gen(2, 3, 5, 5), gen(4, 3, 3, 3, seed=1)
    g = gen(2, 4, 5, 5, seed=2)
    args = [g, x, w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]]
    assert check_rows(aten.convolution_backward.default, args, G2) >= 3


def test_nll_loss_backward_rows():
    x = gen(4, 5).log_softmax(1)
    t = torch.tensor([0, 4, 2, 1])
    _, tw = aten.nll_loss_forward.default(x, t, None, 2, -100)
    args = [torch.tensor(1.5, dtype=torch.float64), x, t, None, 2, -100, tw]
    for grid in GRIDS:
        assert check_rows(aten.nll_loss_backward.default, args, grid) >= 2


LINE4 = Placement("cpu", [0, 1, 2, 3])


@pytest.mark.parametrize("grid", GRIDS + [LINE4], ids=["[2]", "[2,2]", "[4]"])
def test_grouped_query_attention_splits_heads_only_in_whole_groups(grid):
    """4 query heads over 2 key heads: a head split is right where each rank's query heads
    read its own key head (2 ranks on the heads), wrong where the 2 key heads do not divide
    over the ranks (4): ranks 2 and 3 would hold query heads and no key head."""
    q, k, v = gen(4, 4, 3, 2), gen(4, 2, 3, 2, seed=1), gen(4, 2, 3, 2, seed=2)
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    # (the query-sequence row's kernel masks rows at their global positions: its own tests)
    assert check_rows(func, [q, k, v], grid, skip_kernels=False,
                      only=lambda row: row.ins[0] != S(2)) >= 2
    call = make_call("_scaled_dot_product_flash_attention_for_cpu.default", [q, k, v])
    rule = ops.rows_for(call)
    heads = tuple((S(1),) * grid.ndim for _ in range(3))
    assert rule.check(call, grid.shape, heads, None) == (grid.size <= 2)


def test_unequal_splits_are_kept_to_even_cuts():
    call = make_call("mm.default", [gen(6, 4), gen(4, 3)])  # only the shapes are read
    even = pieces.unequal_splits_even
    assert even(call, (2,), ((S(0),), (S(0),)))           # 6 and 4 over 2: 3 and 2 each
    assert not even(call, (4,), ((S(0),), (S(0),)))       # 6 over 4: 2 2 1 1
    assert even(call, (4,), ((S(1),), (S(0),)))           # 4 and 4: equal, uneven allowed
    assert even(call, (2, 2), ((S(0), B), (B, S(0))))     # one split per axis: sizes agree
    assert not even(call, (2, 2), ((S(0), S(0)), (B, S(0))))  # 6 over 2x2 nested


@pytest.mark.parametrize("op,extra", [("mul.Tensor", 2.0), ("add.Tensor", None),
                                      ("neg.default", ()), ("sum.dim_IntList", [1])])
@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_an_empty_partial_input_keeps_its_layout_where_a_signature_keeps_it(op, extra, shape):
    """Issue 52.8 (the fuzzer's metadata cases): on an empty tensor every move is free, so the
    tie-break that prefers resolving partial sums turned (P, S(1)) * 2 into (B, S(1)); the
    layout must be what the same op on a non-empty tensor keeps."""
    def sbp_of(s):
        args = [gen(*s)] + ([] if extra == () else [gen(*s)] if extra is None else [extra])
        call = make_call(op, args, tags=("pointwise",) if "sum" not in op else ())
        ins = [((P, S(1)), s)] * (2 if extra is None else 1)
        return choose(call, layouts(G22, *ins), (4,) * len(ins)).outs
    assert sbp_of(shape) == sbp_of((4, 4))
