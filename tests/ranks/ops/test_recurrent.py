"""Recurrent models on global tensors (issue 36): packed sequences through a bidirectional
LSTM / GRU trained data parallel, and the LSTM kernel's batch-split rule, against one process.

Every run is float64 (float32 where the op under test is float32-only) and compares the loss at
each optimizer step, then every gradient and parameter, with the same model on one process.
"""
import copy

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
G2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
STEPS = 3
BATCH, T, F, H = 5, 6, 4, 3
LENGTHS = torch.tensor([4, 6, 1, 5, 3])  # uneven, unsorted; the longest fills T


def data(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, T, F, generator=g, dtype=torch.float64)
    target = torch.randn(BATCH, T, 2, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)[..., None]
    return x, target, mask


class Tagger(torch.nn.Module):
    """Pack, a 2-layer bidirectional RNN, pad back, a linear head: a sequence tagger."""

    def __init__(self, cell, enforce_sorted):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(F, H, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(2 * H, 2)
        self.enforce_sorted = enforce_sorted

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True,
                                      enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        last = state[0] if isinstance(state, tuple) else state  # (num_layers * 2, batch, H)
        return self.head(padded), last


def loss_of(model, x, lengths, target, mask):
    y, last = model(x, lengths)
    return ((y - target) ** 2 * mask).sum() / mask.sum() + last.pow(2).mean()


def train(model, x, lengths, target, mask, full=lambda t: t):
    """STEPS Adam steps: the losses, then every gradient and parameter (full values)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, x, lengths, target, mask)
        loss.backward()
        losses.append(full(loss.detach()))
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
    params = {n: full(p.detach()) for n, p in model.named_parameters()}
    return losses, grads, params


def one_process(cell, enforce_sorted, lengths, as_arg):
    x, target, mask = data(lengths)
    model = Tagger(cell, enforce_sorted).double()
    return train(model, x, as_arg(lengths), target, mask)


def assert_same(got, want):
    losses, grads, params = got
    torch.testing.assert_close(torch.stack(losses), torch.stack(want[0]), rtol=1e-10, atol=1e-12)
    for name in want[1]:
        torch.testing.assert_close(grads[name], want[1][name], rtol=1e-9, atol=1e-11, msg=name)
        torch.testing.assert_close(params[name], want[2][name], rtol=1e-9, atol=1e-11, msg=name)


def data_parallel(cell, enforce_sorted, grid, batch_sbp, lengths=LENGTHS, as_arg=lambda n: n):
    """The tagger trained on one process, then with its parameters B on ``grid`` and the batch
    (inputs, targets, mask) laid out ``batch_sbp``; lengths passed as ``as_arg(lengths)``."""
    want = one_process(cell, enforce_sorted, lengths, lambda n: n)
    base = Tagger(cell, enforce_sorted).double()
    x, target, mask = data(lengths)

    def body(rank):
        model = copy.deepcopy(base).to_global(grid, (B,) * grid.ndim)
        gx, gtarget, gmask = (gt.tensor(v, placement=grid, sbp=batch_sbp)
                              for v in (x, target, mask))
        return train(model, gx, as_arg(lengths), gtarget, gmask, full=lambda t: t.full_tensor())
    for got in run_ranks(body, grid.size, timeout=240):
        assert_same(got, want)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("batch_sbp", [S(0), B], ids=["split", "broadcast"])
def test_packed_bidirectional_rnn_data_parallel_matches_one_process(cell, batch_sbp):
    data_parallel(cell, False, G2, batch_sbp)


def test_packed_lstm_sorted_lengths_as_a_list_on_a_2x2_grid():
    # enforce_sorted=True wants the batch sorted by length: LENGTHS sorted, passed as a list
    lengths = LENGTHS.sort(descending=True).values
    data_parallel(torch.nn.LSTM, True, G22, (S(0), B), lengths, lambda n: n.tolist())


def test_packed_gru_global_lengths_batch_split_on_a_2x2_grid():
    # lengths given as a global tensor (split like the batch): read whole by the packing
    data_parallel(torch.nn.GRU, False, G22, (B, S(0)), LENGTHS,
                  lambda n: gt.tensor(n, placement=G22, sbp=(B, S(0))))


def test_bad_lengths_raise_the_same_clear_error_on_every_rank():
    x = torch.randn(3, 4, 2, dtype=torch.float64)

    def body(rank):
        gx = gt.tensor(x, placement=G2, sbp=S(0))
        errors = []
        for lengths in ([4, 2, 0], [2, 4, 1]):  # a zero length; unsorted with enforce_sorted
            try:
                with gt.global_mode(G2):
                    pack_padded_sequence(gx, lengths, batch_first=True)
            except GlobalTensorError as e:
                errors.append(str(e))
        return errors
    results = run_ranks(body, 2, timeout=60)
    assert results[0] == results[1] and len(results[0]) == 2
    assert "greater than 0" in results[0][0] and "sorted in decreasing order" in results[0][1]


def test_packing_outside_global_mode_names_the_way_out():
    x = torch.randn(3, 4, 2, dtype=torch.float64)

    def body(rank):
        gx = gt.tensor(x, placement=G2, sbp=S(0))
        lengths = gt.tensor(torch.tensor([4, 3, 2]), placement=G2, sbp=B)
        with pytest.raises(GlobalTensorError, match="global_mode"):
            pack_padded_sequence(gx, lengths, batch_first=True)
    run_ranks(body, 2, timeout=60)


# ----------------------------------------------------------------------------- the LSTM kernel
# nn.LSTM in float32 on CPU runs aten.mkldnn_rnn_layer per layer and direction: its rule keeps
# the batch split (no gather in forward; weight gradients partial sums, all-reduced once).


def lstm_one_process(lstm, x, h0):
    out, (h, c) = lstm(x, h0)
    (out.pow(2).sum() + h.sum() + 2 * c.sum()).backward()
    grads = [p.grad.clone() for p in lstm.parameters()]
    return out.detach(), h.detach(), c.detach(), grads


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_first"])
@pytest.mark.parametrize("grid, batch", [(G2, S(0)), (G22, (B, S(0)))], ids=["2", "2x2"])
def test_lstm_kernel_keeps_the_batch_split(batch_first, grid, batch):
    torch.manual_seed(1)
    lstm = torch.nn.LSTM(F, H, num_layers=2, bidirectional=True, batch_first=batch_first)
    x = torch.randn((BATCH, T, F) if batch_first else (T, BATCH, F))
    h0 = tuple(torch.randn(4, BATCH, H) for _ in range(2))
    want = lstm_one_process(copy.deepcopy(lstm), x, h0)
    batch = batch if isinstance(batch, tuple) else (batch,)
    on_dim1 = tuple(S(1) if v == S(0) else v for v in batch)
    x_sbp, h_sbp = (batch if batch_first else on_dim1), on_dim1

    def body(rank):
        m = copy.deepcopy(lstm).to_global(grid, (B,) * grid.ndim)
        gx = gt.tensor(x, placement=grid, sbp=x_sbp)
        gh = tuple(gt.tensor(v, placement=grid, sbp=h_sbp) for v in h0)
        with gt.comm_trace() as forward:
            out, (h, c) = m(gx, gh)
        with gt.comm_trace() as backward:
            (out.pow(2).sum() + h.sum() + 2 * c.sum()).backward()
        return ([v.full_tensor() for v in (out, h, c)], [p.grad.full_tensor() for p in m.parameters()],
                forward.counts(), backward.counts(), out.sbp, h.sbp)
    for values, grads, fwd, bwd, out_sbp, h_sbp_out in run_ranks(body, grid.size, timeout=240):
        assert "all_gather" not in fwd and "all_gather" not in bwd, (fwd, bwd)
        assert S(0 if batch_first else 1) in out_sbp and S(1) in h_sbp_out, (out_sbp, h_sbp_out)
        for got, w in zip(values, want[:3]):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
        for got, w in zip(grads, want[3]):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- layers on pieces
# nn.GRU, nn.RNN and a float64 nn.LSTM are composites above the dispatcher (their input
# projection flattens time and batch: no aten rule keeps a split batch through it); global mode
# runs them on each rank's sequences (globaltensor/mode/rnn.py).


@pytest.mark.parametrize("cell", ["GRU", "RNN", "LSTM"])
@pytest.mark.parametrize("grid, batch", [(G2, S(0)), (G22, (B, S(0)))], ids=["2", "2x2"])
@pytest.mark.parametrize("initial", [True, False], ids=["h0", "no h0"])
def test_recurrent_layers_run_on_each_ranks_sequences(cell, grid, batch, initial):
    torch.manual_seed(2)
    layer = getattr(torch.nn, cell)(F, H, num_layers=2, bidirectional=True,
                                    batch_first=True).double()
    x = torch.randn(BATCH, T, F, dtype=torch.float64)
    h0 = torch.randn(4, BATCH, H, dtype=torch.float64)
    state = ((h0, h0 * 0.5) if cell == "LSTM" else h0) if initial else None

    def loss(out, h):
        h = h[0] + 2 * h[1] if isinstance(h, tuple) else h
        return out.pow(2).sum() + h.sum()

    reference = copy.deepcopy(layer)
    out, h = reference(x, state)
    loss(out, h).backward()
    want = [out.detach(), [p.grad for p in reference.parameters()]]
    batch = batch if isinstance(batch, tuple) else (batch,)
    on_dim1 = tuple(S(1) if v == S(0) else v for v in batch)

    def body(rank):
        m = copy.deepcopy(layer).to_global(grid, (B,) * grid.ndim)
        gx = gt.tensor(x, placement=grid, sbp=batch)
        gs = None
        if initial:
            gs = tuple(gt.tensor(v, placement=grid, sbp=on_dim1) for v in state) \
                if cell == "LSTM" else gt.tensor(h0, placement=grid, sbp=on_dim1)
        with gt.comm_trace() as forward:
            out, h = m(gx, gs)
        loss(out, h).backward()
        return (out.sbp, out.full_tensor(), [p.grad.full_tensor() for p in m.parameters()],
                forward.counts())

    for out_sbp, got, grads, counts in run_ranks(body, grid.size, timeout=240):
        assert out_sbp == batch and not counts, (out_sbp, counts)  # no move in forward
        torch.testing.assert_close(got, want[0], rtol=1e-10, atol=1e-10)
        for g, w in zip(grads, want[1]):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
