"""The prompt order is a function of the seed: same seed same order, a resumed source goes on
with it (epoch boundaries included), different seeds give different orders."""

import pytest

from prorl_async.data.source import PromptSource

ROWS = [{"id": f"p{k}"} for k in range(10)]


def ids(source, k):
    return [r["id"] for r in source.next(k)]


def test_same_seed_same_order_and_every_epoch_is_a_permutation():
    a, b = PromptSource(ROWS, seed=7), PromptSource(ROWS, seed=7)
    stream = ids(a, 35)
    assert stream == ids(b, 35)
    for e in range(3):  # each full epoch hands out every row once
        assert sorted(stream[10 * e:10 * e + 10]) == sorted(r["id"] for r in ROWS)
    assert stream[:10] != stream[10:20]  # a new shuffle each epoch
    assert a.state_dict()["consumed"] == 35


@pytest.mark.parametrize("cut", [3, 10, 17, 20])
def test_a_resumed_source_continues_the_order(cut):
    whole = PromptSource(ROWS, seed=3)
    straight = ids(whole, 40)
    first = PromptSource(ROWS, seed=3)
    head = ids(first, cut)
    resumed = PromptSource(ROWS, seed=0)  # the seed comes from the state, not the constructor
    resumed.load_state_dict(first.state_dict())
    assert head + ids(resumed, 40 - cut) == straight
    assert resumed.state_dict() == whole.state_dict()


def test_different_seeds_give_different_orders_in_every_epoch():
    # no (seed, epoch) shares an order with another: seed 1's first epoch is not seed 0's second
    orders = {}
    for seed in range(6):
        stream = ids(PromptSource(ROWS, seed=seed), 40)
        for e in range(4):
            orders[(seed, e)] = tuple(stream[10 * e:10 * e + 10])
    assert len(set(orders.values())) == len(orders)


def test_a_checkpoint_from_before_the_order_was_keyed_by_seed_and_epoch_resumes_its_order():
    import random

    def legacy_epoch(seed, epoch):  # the order such a checkpoint's run used: Random(seed + epoch)
        order = list(range(len(ROWS)))
        random.Random(seed + epoch).shuffle(order)
        return [ROWS[i]["id"] for i in order]

    src = PromptSource(ROWS, seed=2)
    src.load_state_dict({"epoch": 1, "pos": 4, "consumed": 14, "seed": 2})  # no "order" key
    assert ids(src, 16) == legacy_epoch(2, 1)[4:] + legacy_epoch(2, 2)
    assert src.state_dict()["order"] == "legacy"
