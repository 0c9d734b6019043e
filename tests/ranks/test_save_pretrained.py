"""HF's save_pretrained on a global model: every rank takes part, the full values are written
once (safetensors), and the folder loads with from_pretrained in one process (issue 34, item 4)."""
import copy
import os

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

from test_real_models import gpt2, llama, megatron

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2 tied", "llama"])
def test_save_pretrained_writes_full_values_that_load_in_one_process(make, tmp_path,
                                                                     monkeypatch):
    reference = make("eager")  # built once: thread-ranks share torch's global generator
    writes, saved = [], []
    save_file = transformers.modeling_utils.safe_save_file
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        lambda values, *a, **k: (saved.append(gt.env.get_rank()),
                                                 save_file(values, *a, **k)))

    def body(rank):
        model = copy.deepcopy(reference).to_global(gt.placement("cpu", [[0, 1], [2, 3]]), megatron)
        model.save_pretrained(tmp_path, is_main_process=True)
        writes.append(rank)
        return model.transformer.wte.weight.sbp if make is gpt2 else model.lm_head.weight.sbp
    sbps = run_ranks(body, 4, timeout=120)
    assert all(s == (gt.sbp.B, gt.sbp.S(0)) for s in sbps) and sorted(writes) == [0, 1, 2, 3]
    assert saved == [0]  # the full values written once, by rank 0
    assert {"model.safetensors", "config.json"} <= set(os.listdir(tmp_path))
    loaded = type(reference).from_pretrained(tmp_path, torch_dtype=torch.float64)
    expected, got = reference.state_dict(), loaded.state_dict()
    assert set(expected) == set(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    if make is gpt2:  # the tie survives: one tensor
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
