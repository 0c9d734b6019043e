"""The 2x2 Llama step follows the cost figures. On links where a collective's latency is high
(gloo's 0.1 ms and more) the backward all-reduces the activations' gradients as Megatron does,
and the gradients that are partial on both axes of the grid join one bucket's all_reduce.
Where it is low (NCCL's few us) it gathers a matmul's operand instead where that sends fewer
bytes (the product's sum then owed), and reduces a gradient partial on both axes by the fewest bytes,
reduce_scatter + all_reduce + all_gather. Both give one process's numbers (docs/planner.md,
"Choosing a signature")."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
GRID = gt.placement("cpu", [[0, 1], [2, 3]])
VOCAB = 128


def megatron(name, t):
    """Column-parallel q/k/v/gate/up, row-parallel o/down on the grid's tensor axis."""
    if t.dim() == 2 and any(c in name for c in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return (B, S(0))
    if t.dim() == 2 and any(c in name for c in ("o_proj", "down_proj")):
        return (B, S(1))
    return (B, B)


def test_the_2x2_llama_step_follows_the_cost_figures():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa"))
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(base).double()  # HF computes its rotary embedding in float32 still
    ref(ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def body(rank):
        model = copy.deepcopy(base).double().to_global(GRID, megatron)
        gids = gt.tensor(ids, placement=GRID, sbp=(S(0), B))
        loss = model(gids, labels=gids).loss
        with gt.comm_trace() as trace:
            loss.backward()
        wrong = [n for n, p in model.named_parameters()
                 if not torch.allclose(p.grad.full_tensor(), want[n], rtol=1e-6, atol=1e-7)]
        reductions = [(r.op, r.collectives) for r in trace.records if r.layouts() == "(P, P) -> (B, B)"]
        gathers = [r.layouts() for r in trace.records if r.op == "aten.mm.default"
                   and r.collectives == ("all_gather",)]
        return trace.counts(), reductions, gathers, wrong

    found = {}
    for alpha in (1e-3, 1e-6):  # gloo on this machine measures 0.2-0.6 ms; NCCL in a node ~5 us
        before = gt.set_costs(alpha=alpha, beta=1e-9)
        try:
            found[alpha] = run_ranks(body, 4, timeout=120)[0]
        finally:
            gt.set_costs(costs=before)
    (slow, slow_reduced, slow_gathers, slow_wrong), (fast, fast_reduced, fast_gathers, fast_wrong) = \
        found.values()
    assert slow_wrong == [] and fast_wrong == []
    # high latency: only all-reduces (Megatron's of the activations' gradients, and buckets);
    # no gradient partial on both axes is reduced on its own
    assert set(slow) == {"all_reduce"} and slow_reduced == [] and slow_gathers == []
    # low latency: a matmul's operand is gathered where that sends fewer bytes than reducing
    # the activation's gradient, and the embedding's gradient is reduced by the fewest bytes
    assert fast_gathers
    assert fast_reduced == [("gradient sync", ("reduce_scatter", "all_reduce", "all_gather"))]
    assert sum(slow.values()) < sum(fast.values())


def test_a_world_of_one_has_nothing_to_measure():
    # a world of one sends nothing: measuring keeps the figures in use (no division by zero)
    from globaltensor.plan import DEFAULT

    assert run_ranks(lambda rank: gt.measure_costs(), 1, timeout=30) == [DEFAULT]
