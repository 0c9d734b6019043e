"""Timeouts that explain, in one process: which errors are timeouts and the words the guard
builds (stuck collectives on thread-ranks: tests/ranks/test_timeouts_ranks.py)."""
import pytest

from globaltensor.runtime.guard import guard, is_timeout
from globaltensor.errors import CollectiveTimeoutError, GlobalTensorError


# --- pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv operation",
    "Wait timeout",
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)",
])
def test_timeout_messages_are_recognised(text):
    assert is_timeout(RuntimeError(text))


def test_other_errors_pass_through_unchanged():
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        with guard("all_reduce"):
            raise RuntimeError("shape mismatch")
    with pytest.raises(KeyError):
        with guard("all_reduce"):
            raise KeyError("timeout")  # not a RuntimeError: not torch's


def test_guard_builds_its_words_only_on_failure():
    calls = []

    def words():
        calls.append(1)
        return "all_gather along axis 0 of placement('cpu', ranks=[0, 1])"

    with guard(words, ranks=lambda: calls.append(2) or [0, 1]):
        pass
    assert calls == []
    with pytest.raises(CollectiveTimeoutError) as info:
        with guard(words, ranks=lambda: [0, 1]):
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    msg = str(info.value)
    assert msg.startswith("all_gather along axis 0 of placement('cpu', ranks=[0, 1]): timed out on ")
    assert "among ranks [0, 1]" in msg and "Timed out waiting 5000ms" in msg
    assert "Run with GT_DEBUG=1" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_lost_peer_is_named():
    with pytest.raises(GlobalTensorError, match=r"a peer left the collective .*among ranks \[0, 1\]"):
        with guard("barrier", ranks=[0, 1]):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5000")
