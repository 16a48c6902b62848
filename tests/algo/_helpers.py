"""Shared test helpers for tests/algo: hypothesis strategies and plain-python references."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch
from hypothesis import settings
from hypothesis import strategies as st

# Small example counts: the whole tests/algo suite must stay fast on a shared 2-core box.
FAST = settings(max_examples=40, deadline=None)

finite_reward = st.floats(-5.0, 5.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def reward_batches(draw, max_n: int = 8, max_t: int = 5):
    """(rewards[N] f32, group_index[N] int64 with sparse ids, mask[N,T] right-padded, lengths)."""
    n = draw(st.integers(1, max_n))
    t = draw(st.integers(1, max_t))
    rewards = draw(st.lists(finite_reward, min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1.0
    group_index = torch.tensor([17 * g + 5 for g in groups], dtype=torch.int64)
    return torch.tensor(rewards, dtype=torch.float32), group_index, mask, lengths


def group_members(groups: Sequence[int]) -> Dict[int, List[int]]:
    members: Dict[int, List[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def loop_token_whiten(per_sample: Sequence[float], lengths: Sequence[int], t: int, eps: float):
    """Broadcast per-sample values to their first `lengths[i]` tokens, whiten over those tokens."""
    tokens = [per_sample[i] for i in range(len(per_sample)) for _ in range(lengths[i])]
    out = [[0.0] * t for _ in per_sample]
    if not tokens:
        return out
    mu = sum(tokens) / len(tokens)
    var = sum((x - mu) ** 2 for x in tokens) / len(tokens)
    for i, v in enumerate(per_sample):
        for j in range(lengths[i]):
            out[i][j] = (v - mu) / math.sqrt(var + eps)
    return out
