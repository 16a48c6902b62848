"""A weight update must fit where it is received: checked when a receiver joins, refused with the
numbers and the setting to change (prorl_async/receive_memory.py), on this node's real free RAM."""

from __future__ import annotations

import psutil
import pytest
import torch

from prorl_async.receive_memory import check_update_fits, free_bytes, update_bytes
from prorl_async.weight_sync import WeightSyncError


def test_an_update_is_counted_in_its_wire_dtypes():
    shapes = [("a", (3, 4), torch.float32), ("b", (5,), torch.bfloat16), ("c", (2, 2, 2), torch.int64)]
    assert update_bytes(shapes) == 12 * 4 + 5 * 2 + 8 * 8
    assert update_bytes([]) == 0


def test_an_update_larger_than_the_free_ram_is_refused_with_the_numbers_and_the_fix():
    free = psutil.virtual_memory().available
    assert abs(free_bytes("cpu") - free) < 2e9  # the node's available RAM (it moves a little between reads)
    huge = [("model.embed", (free // 4 + 2**28,), torch.float32)]  # 1 GiB more than is free, as fp32
    with pytest.raises(WeightSyncError) as e:
        check_update_fits(huge, "cpu", 1, "vLLM worker rank 1")
    msg = str(e.value)
    assert msg.startswith("vLLM worker rank 1: a weight update needs ") and " on cpu (1 x 1 tensors" in msg
    assert "GB is free" in msg and "rollout.generator_resources" in msg
    # half of it fits once, not twice
    half = [("model.embed", (free // 8,), torch.float32)]
    assert check_update_fits(half, "cpu", 1, "x") == free // 8 * 4
    with pytest.raises(WeightSyncError, match=r"2 x 1 tensors"):
        check_update_fits([("model.embed", (free // 4 * 3 // 4,), torch.float32)], "cpu", 2, "x")


def test_the_hf_engine_checks_the_update_it_will_hold_when_it_joins(tiny_model):
    from prorl_async.engines.hf import HFEngine

    engine = HFEngine(tiny_model, dtype="float32")
    model = sum(t.numel() * t.element_size() for _, t in engine.named_tensors())
    assert engine.update_bytes == 0
    engine.init_weight_sync("127.0.0.1", 0, 1, 2, "ipc", timeout_s=5)
    assert engine.update_bytes == model > 0  # the staged copy of one update
