"""Issue 17, the last pieces: tensor_split with a global tensor of indices, embedding_bag,
masked_scatter, _conj, pixel_shuffle / pixel_unshuffle, max_unpool, and the clear errors
left in the coverage sweep. Every rule against the full-tensor oracle on [2] and [2, 2]
(helpers.check: every sbp of every input, uneven shapes, forward and gradients)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks
from helpers import G2, G22, check, gen

F = torch.nn.functional
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


# ----------------------------------------------------------------------------- tensor_split

@pytest.mark.parametrize("part", [0, 1, 2])
def test_tensor_split_takes_a_global_tensor_of_indices(part):
    # torch's C++ reads the indices' memory above dispatch: the whole value is passed instead
    check(lambda x, i: torch.tensor_split(x, i, dim=1)[part], [gen(3, 5, 2), torch.tensor([1, 3])])
    check(lambda x, i: x.tensor_split(i)[part], [gen(5, 2), torch.tensor(3)])


def test_tensor_split_of_a_local_tensor_by_global_indices():
    def body(rank):
        i = gt.tensor(torch.tensor([2, 3]), placement=G2, sbp=S(0))
        x = torch.arange(6.0)
        return [p.tolist() for p in torch.tensor_split(x, tensor_indices_or_sections=i)]
    for parts in run_ranks(body, 2, timeout=60):
        assert parts == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]]
