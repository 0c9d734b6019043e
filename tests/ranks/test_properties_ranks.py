"""Property-based tests over random shapes, grids, placements and sbps: plans executed on real gloo
(thread-ranks) give every rank exactly the simulator's piece (the one-process properties:
tests/core/test_properties.py).

Bounded (max_examples, small sizes) so the file runs in seconds on two shared cores.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globaltensor.plan import oracle
from globaltensor.plan import plan
from globaltensor.redistribute import redistribute_local
from globaltensor.testing import run_ranks

from helpers import conversions, small_ints

GLOO = settings(max_examples=6, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- 3. real gloo agrees with the simulator ------------------------------------------------------------

WORLD = 4


@GLOO
@given(st.lists(st.tuples(conversions(world=WORLD),
                          st.sampled_from([torch.float64, torch.float32, torch.int64])),
                min_size=6, max_size=10))
def test_executed_plans_agree_with_the_simulator(cases):
    inputs, expected = [], []
    for seed, ((src, dst), dtype) in enumerate(cases):
        pieces = oracle.scatter(small_ints(src.shape, dtype, seed), src, world_size=WORLD)
        inputs.append(pieces)
        expected.append(oracle.run(plan(src, dst), pieces))

    def body(rank):
        out = []
        for ((src, dst), _), pieces in zip(cases, inputs):
            local = pieces[rank].clone()
            got = redistribute_local(local, src, dst)
            out.append((got, torch.equal(local, pieces[rank])))
        return out

    results = run_ranks(body, WORLD, timeout=60)
    for i, ((src, dst), _) in enumerate(cases):
        for rank in range(WORLD):
            got, input_intact = results[rank][i]
            want = expected[i][rank]
            assert input_intact, f"rank {rank} changed its input piece: {src!r} -> {dst!r}"
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (src, dst)
            assert torch.equal(got, want), f"rank {rank}: {src!r} -> {dst!r}\n{plan(src, dst)}"
