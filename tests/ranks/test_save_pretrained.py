"""HF's save_pretrained on a global model: every rank takes part, the full values are written
once (safetensors), and the folder loads with from_pretrained in one process (issue 34, item 4)."""
import copy
import os

import pytest
import torch

import globaltensor as gt
from globaltensor.nn import pretrained
from globaltensor.testing import run_ranks

from test_real_models import gpt2, llama, megatron

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2 tied", "llama"])
def test_save_pretrained_writes_full_values_that_load_in_one_process(make, tmp_path,
                                                                     monkeypatch):
    reference = make("eager")  # built once: thread-ranks share torch's global generator
    writes, saved = [], []
    header = pretrained._header
    monkeypatch.setattr(pretrained, "_header",
                        lambda group: (saved.append(gt.env.get_rank()), header(group))[1])

    def body(rank):
        model = copy.deepcopy(reference).to_global(gt.placement("cpu", [[0, 1], [2, 3]]), megatron)
        with gt.comm_trace() as trace:
            model.save_pretrained(tmp_path, is_main_process=True)
        writes.append(rank)
        # one tensor at a time to rank 0: no move gives a full value to any other rank
        targets = {tuple(r.target.placement.flat_ranks) for r in trace.records
                   if r.target is not None}
        sbp = model.transformer.wte.weight.sbp if make is gpt2 else model.lm_head.weight.sbp
        return sbp, targets
    results = run_ranks(body, 4, timeout=120)
    assert all(s == (gt.sbp.B, gt.sbp.S(0)) for s, _ in results) and sorted(writes) == [0, 1, 2, 3]
    assert all(targets == {(0,)} for _, targets in results)
    assert saved == [0]  # the file written once, by rank 0
    assert {"model.safetensors", "config.json"} <= set(os.listdir(tmp_path))
    loaded = type(reference).from_pretrained(tmp_path, torch_dtype=torch.float64)
    expected, got = reference.state_dict(), loaded.state_dict()
    assert set(expected) == set(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    if make is gpt2:  # the tie survives: one tensor
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_save_pretrained_of_a_sharded_model_writes_shards_and_an_index_one_process_loads(
        tmp_path):
    """fully_shard per block on a line of 2, max_shard_size small: several safetensors files and
    HF's index; from_pretrained in one process gives the same state."""
    reference = llama("eager")

    def body(rank):
        model = copy.deepcopy(reference)
        placement = gt.placement("cpu", [0, 1])
        for layer in model.model.layers:
            gt.nn.fully_shard(layer, placement)
        gt.nn.fully_shard(model, placement)
        model.save_pretrained(tmp_path, max_shard_size="20KB")
    run_ranks(body, 2, timeout=120)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "config.json" in files
    loaded = type(reference).from_pretrained(tmp_path, torch_dtype=torch.float64)
    expected, got = reference.state_dict(), loaded.state_dict()
    assert set(expected) == set(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_save_pretrained_refuses_what_it_would_ignore(tmp_path):
    reference = llama("eager")

    def body(rank):
        model = copy.deepcopy(reference).to_global(gt.placement("cpu", [0, 1]), gt.sbp.B)
        try:
            model.save_pretrained(tmp_path, safe_serialization=False)
        except gt.GlobalTensorError as e:
            return str(e)
    assert all("safe_serialization=False" in m for m in run_ranks(body, 2, timeout=60))
