"""gt.memory() counts what this rank holds (issue 52.3): what it allocates in the block plus
what was alive at its start, each storage once; a plain model that merely lives in a caller's
frame (a one-process reference copy) is not this rank's."""
import copy

import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

from helpers import X_NET as X, Net, shard

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 90
LINE2 = gt.placement("cpu", [0, 1])


def _storage_bytes(tensors) -> int:
    """The bytes of the distinct storages ``tensors`` live in (a storage once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = s.nbytes()
    return sum(seen.values())


def test_a_reference_model_in_a_local_is_not_this_ranks_parameters():
    def body(rank):
        ref = Net(h=32, n=4, generator_seed=0)  # the whole model, one process's copy
        ref_out = ref(X)  # and what it computed: plain tensors, reachable from this frame
        m = shard(copy.deepcopy(ref), LINE2)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        params = list(m.parameters())  # the pieces reached twice: through m and this list
        pieces = [p.to_local() for p in params]
        x = X.to_global(LINE2, B).to_global(sbp=S(0))
        with gt.memory() as mem:
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
        mine = sum(t.numel() * t.element_size() for t in pieces)
        out = {"params": mine, "params_storage": _storage_bytes(pieces),
               "ref": sum(p.numel() * p.element_size() for p in ref.parameters()),
               "x": x.to_local().numel() * x.to_local().element_size(),
               "peak_params": mem.peak_bytes("parameters"),
               "start_params": mem.start_bytes("parameters"),
               "live_params": mem.live_bytes("parameters"),
               "start": mem.start_bytes(),
               # a unit's gradient pieces are views of one reduce-scatter buffer (padded to the
               # largest rank's block): its storage is what the rank holds
               "grads": _storage_bytes(p.grad.to_local() for p in params),
               "live_grads": mem.live_bytes("gradients"),
               "state": sum(v.to_local().nbytes if isinstance(v, gt.GlobalTensor) else v.nbytes
                            for s in opt.state.values() for v in s.values()),  # and the steps
               "live_opt": mem.live_bytes("optimizer"), "report": mem.report()}

        # a tensor the block allocates, referenced three times (and viewed): counted once
        with gt.memory() as again:
            t = torch.ones(4096)
            alias = t
            held = [t, alias, t[1:], t.view(64, 64)]
        out["once"] = again.live_bytes() - again.start_bytes()
        out["once_peak"] = again.peak_bytes() - again.start_bytes()
        out["once_kind"] = again.live_bytes("activations") - again.start_bytes("activations")
        del held, ref_out
        return out

    for got in run_ranks(body, 2, timeout=TIMEOUT):
        report = got["report"]
        assert got["params"] == got["params_storage"], report  # one storage per piece
        assert got["peak_params"] == got["params"], (got["params"], got["ref"], report)
        assert got["start_params"] == got["params"] == got["live_params"], report
        # what was alive at the start: the pieces and the batch's piece; not the reference
        # model, not its output
        assert got["start"] == got["params"] + got["x"], report
        assert got["live_grads"] == got["grads"], report
        assert got["live_opt"] == got["state"], report
        assert got["once"] == got["once_peak"] == got["once_kind"] == 4096 * 4


def _param_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters())


def test_a_plain_model_is_counted_when_the_block_runs_it_or_it_is_passed():
    """One process, no world: a plain model the block runs is this process's parameters, from
    the block's start (found at its forward); one it only reaches is not; one passed is."""
    torch.manual_seed(0)
    used, idle = torch.nn.Linear(64, 32), torch.nn.Linear(128, 128)
    frozen = torch.nn.Linear(32, 4).requires_grad_(False)  # no gradient hook for these
    opt = torch.optim.SGD(used.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    with gt.memory() as mem:
        frozen(used(x)).sum().backward()
        opt.step()
    assert mem.start_bytes("parameters") == _param_bytes(used) + _param_bytes(frozen), mem.report()
    del frozen
    with gt.memory() as mem:
        used(x).sum().backward()
        opt.step()
    assert mem.start_bytes("parameters") == _param_bytes(used), mem.report()
    assert mem.peak_bytes("parameters") == mem.live_bytes("parameters") == _param_bytes(used)
    assert mem.at_peak["parameters"][0] == _param_bytes(used)  # counted from the start
    assert mem.live_bytes("gradients") == _param_bytes(used), mem.report()
    assert mem.start_bytes("gradients") == _param_bytes(used)  # the first step's, found
    # at the forward too; not idle's, not the plain input x
    assert mem.start_bytes() == 2 * _param_bytes(used)

    with gt.memory(idle, opt) as passed:
        pass
    # idle's parameters, and used's (opt's) with their gradients: alive at the start
    assert passed.start_bytes("parameters") == _param_bytes(idle) + _param_bytes(used)
    assert passed.start_bytes("gradients") == _param_bytes(used)

    with gt.memory() as nothing:
        pass
    assert nothing.start_bytes() == nothing.peak_bytes() == 0, nothing.report()
