"""The curriculum's rule (prorl_async.curriculum), pure: pools, preflight, probes, hold and re-admit, resume."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest

from prorl_async.buffer import ReplayBuffer
from prorl_async.curriculum import ACTIVE, HELD, Curriculum, NoSignal
from prorl_async.data.schema import rollout_batch


def rows(domain: str, n: int) -> list[dict]:
    return [{"id": f"{domain}-{i}", "domain": domain, "prompt": f"q{i}", "answer": "1"} for i in range(n)]


def make(min_signal=0.1, probe_frac=0.125, window=8, seed=0):
    return Curriculum(rows("easy", 20) + rows("hard", 30) + rows("solved", 10), seed=seed, min_signal=min_signal,
                      probe_frac=probe_frac, window=window)


PREFLIGHT = {"easy": [8, 4, 10.0, 32], "hard": [8, 0, 0.0, 32], "solved": [8, 0, 32.0, 32]}


def test_preflight_splits_pools_by_signal_and_prints_the_table():
    c = make()
    table = c.preflight(PREFLIGHT)
    assert c.names(ACTIVE) == ["easy"] and sorted(c.names(HELD)) == ["hard", "solved"]
    assert "preflight: 1 of 3 pools active" in table
    line = {ln.split()[0]: ln for ln in table.splitlines()[2:]}
    assert line["easy"].split()[1:4] == ["8", "0.312", "0.500"] and line["easy"].endswith("active")
    assert line["hard"].endswith("held (too hard)") and line["solved"].endswith("held (solved)")


def test_a_mix_without_signal_is_one_error_with_the_table():
    c = make()
    with pytest.raises(NoSignal) as err:
        c.preflight({"easy": [8, 0, 0.0, 32], "hard": [8, 0, 0.0, 32], "solved": [8, 0, 32.0, 32]})
    msg = str(err.value)
    assert msg.startswith("no task of the training mix has signal") and "held (too hard)" in msg
    assert "easy" in msg and "Fix:" in msg and "shots=2" in msg


def test_requests_come_from_active_pools_with_a_probe_of_the_held():
    c = make(probe_frac=0.125)
    c.preflight(PREFLIGHT)
    drawn = [r["domain"] for _ in range(10) for r in c.next(8)]
    counts = Counter(drawn)
    assert counts["easy"] == 70 and counts["hard"] == 5 and counts["solved"] == 5  # one probe per request, in turn
    assert c.consumed == 80


def test_one_prompt_requests_do_not_starve_the_active_pools():
    c = make(probe_frac=0.125)
    c.preflight(PREFLIGHT)
    drawn = Counter(c.next(1)[0]["domain"] for _ in range(80))  # admission control's smallest requests
    assert drawn["easy"] == 70 and drawn["hard"] + drawn["solved"] == 10  # probe_frac of them, not all


def test_active_pools_share_requests_equally_whatever_their_size():
    c = Curriculum(rows("a", 5) + rows("b", 500), seed=0, min_signal=0.1, probe_frac=0.0, window=8)
    c.preflight({"a": [4, 2, 2.0, 8], "b": [4, 2, 2.0, 8]})
    assert Counter(r["domain"] for r in c.next(100)) == {"a": 50, "b": 50}


def test_a_held_pool_is_readmitted_when_its_signal_rises_and_held_again_when_it_falls():
    c = make(min_signal=0.2, window=4)
    c.preflight(PREFLIGHT)
    assert c.observe({"hard": [2, 0, 0.0, 8]}, step=3) == [] and c.pools["hard"].status == HELD
    lines = c.observe({"hard": [4, 3, 5.0, 16]}, step=5)  # the policy has grown into it
    assert c.pools["hard"].status == ACTIVE and len(lines) == 1
    assert lines[0].startswith("curriculum: hard re-admitted at step 5")
    # one unlucky request does not flip it back (hysteresis at half of min_signal) ...
    c.observe({"hard": [1, 0, 0.0, 4]}, step=6)
    assert c.pools["hard"].status == ACTIVE
    # ... a solved stretch does
    lines = c.observe({"hard": [12, 0, 48.0, 48]}, step=9)
    assert c.pools["hard"].status == HELD and "held back (solved) at step 9" in lines[0]
    assert [ch[:2] for ch in c.pools["hard"].changes] == [(0, HELD), (5, ACTIVE), (9, HELD)]


def test_a_held_pool_is_called_too_hard_settled_or_solved_by_its_pass_rate():
    # groups without signal are all right or all wrong: a pass rate between the two ends means some
    # prompts always right and others never (seen at step 178 of a run: signal 0.05, pass rate 0.40)
    c = make(min_signal=0.2, window=4)
    c.preflight({"easy": [8, 4, 10.0, 32], "hard": [8, 4, 10.0, 32], "solved": [8, 4, 10.0, 32]})
    assert c.names(HELD) == []
    lines = c.observe({"easy": [40, 20, 60.0, 160], "hard": [40, 0, 64.0, 160], "solved": [40, 0, 160.0, 160]},
                      step=7)
    assert c.names(ACTIVE) == ["easy"] and sorted(c.names(HELD)) == ["hard", "solved"]
    said = {ln.split()[1]: ln for ln in lines}
    assert "held back (settled) at step 7" in said["hard"] and "pass rate 0.40" in said["hard"]
    assert "held back (solved) at step 7" in said["solved"]
    table = {ln.split()[0]: ln for ln in c.table("now").splitlines()[2:]}
    assert table["hard"].endswith("held (settled)") and table["solved"].endswith("held (solved)")
    c.pools["hard"].pass_rate = 0.24
    assert c.why_held(c.pools["hard"]) == "too hard"


def test_the_last_active_pool_is_never_held():
    c = make()
    c.preflight(PREFLIGHT)
    c.observe({"easy": [50, 0, 0.0, 200]}, step=4)
    assert c.names(ACTIVE) == ["easy"]


def test_a_resumed_curriculum_draws_what_an_uninterrupted_one_draws():
    a = make()
    a.preflight(PREFLIGHT)
    a.next(8)
    a.observe({"hard": [4, 3, 5.0, 16]}, step=2)
    state = json.loads(json.dumps(a.state_dict()))  # what the checkpoint's JSON holds
    b = make()
    b.load_state_dict(state)
    for step in range(3, 12):
        assert [r["id"] for r in a.next(8)] == [r["id"] for r in b.next(8)]
        obs = {"easy": [3, step % 2, 1.0, 12], "solved": [1, 1, 2.0, 4]}
        assert a.observe(obs, step) == b.observe(obs, step)
    assert a.state_dict() == b.state_dict()


def test_a_checkpoint_of_other_pools_is_refused():
    a = make()
    other = Curriculum(rows("x", 3), seed=0, min_signal=0.1, probe_frac=0.1, window=4)
    with pytest.raises(ValueError, match="does not match this run's curriculum pools"):
        other.load_state_dict(a.state_dict())


def test_the_buffer_reports_graded_groups_per_pool():
    n = 4
    groups = [("easy", "p0", [1, 0, 0, 1]), ("easy", "p1", [0, 0, 0, 0]), ("hard", "p2", [0, 0, 0, 0]),
              ("solved", "p3", [1, 1, 1, 1]), ("partial", "p4", [0.5, 0.25, 0.5, 0.75])]
    cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids", "behavior_logprobs",
                            "policy_version", "finish_reason", "raw_reward", "reward_valid", "request_id",
                            "response_text")}
    for dom, pid, rewards in groups:
        for j, r in enumerate(rewards):
            for k, v in (("sample_id", f"{pid}-{j}"), ("prompt_id", pid), ("domain", dom), ("prompt_ids", [1]),
                         ("response_ids", [2, 3]), ("behavior_logprobs", [-0.1, -0.2]), ("policy_version", 0),
                         ("finish_reason", "stop"), ("raw_reward", float(r)), ("reward_valid", True),
                         ("request_id", "r0"), ("response_text", "x")):
                cols[k].append(v)
    info = ReplayBuffer(max_staleness=1).put(rollout_batch(cols))
    # [groups, with signal, reward sum, valid samples, split into solved and not]
    assert info.pools == {"easy": [2, 1, 2.0, 2 * n, 1], "hard": [1, 0, 0.0, n, 0], "solved": [1, 0, 4.0, n, 0],
                             "partial": [1, 1, 2.0, n, 0]}
    assert isinstance(rollout_batch(cols), pa.RecordBatch) and info.kept == 2


def test_a_floor_of_active_pools_admits_the_held_pools_with_the_most_signal():
    c = Curriculum(rows("a", 10) + rows("b", 10) + rows("c", 10) + rows("d", 10), seed=0, min_signal=0.2,
                   probe_frac=0.125, window=4, min_active=3)
    table = c.preflight({"a": [8, 4, 4.0, 32], "b": [8, 1, 1.0, 32], "c": [8, 0, 0.0, 32], "d": [8, 0, 32.0, 32]})
    # only a has signal >= 0.2; b (0.125) has the most of the rest, then c and d tie at 0 (by name)
    assert c.names(ACTIVE) == ["a", "b", "c"] and c.names(HELD) == ["d"]
    assert "preflight: 3 of 4 pools active" in table
    # every pool's signal collapses (a sharpening policy): the floor keeps three of them fed
    c.observe({n: [40, 0, 20.0, 160] for n in "abcd"}, step=7)
    assert len(c.names(ACTIVE)) == 3
    # a held pool whose signal returns is re-admitted; then one of the floor's pools may step aside
    lines = c.observe({"d": [20, 20, 40.0, 80]}, step=8)
    assert "curriculum: d re-admitted at step 8" in lines[0] and len(c.names(ACTIVE)) == 4
    lines = c.observe({"a": [1, 0, 0.0, 4]}, step=9)
    assert c.pools["a"].status == HELD and len(c.names(ACTIVE)) == 3 and "held back" in lines[0]


def test_without_a_floor_a_collapse_leaves_one_pool():  # the behaviour the floor exists for
    c = Curriculum(rows("a", 10) + rows("b", 10) + rows("c", 10), seed=0, min_signal=0.2, probe_frac=0.125,
                   window=4)
    c.preflight({n: [8, 4, 4.0, 32] for n in "abc"})
    c.observe({n: [40, 0, 20.0, 160] for n in "abc"}, step=7)
    assert len(c.names(ACTIVE)) == 1


def test_signal_by_solved_ignores_partial_credit_that_never_solves():
    kw = dict(seed=0, min_signal=0.2, probe_frac=0.125, window=4)
    # "partial": every group's scores differ (signal 1.0 by reward) but no sample is fully correct
    pre = {"partial": [8, 8, 12.0, 32, 0], "binary": [8, 4, 10.0, 32, 4]}
    by_reward = Curriculum(rows("partial", 10) + rows("binary", 10), signal_by="reward", **kw)
    by_reward.preflight(pre)
    by_solved = Curriculum(rows("partial", 10) + rows("binary", 10), signal_by="solved", **kw)
    by_solved.preflight(pre)
    assert by_reward.names(ACTIVE) == ["binary", "partial"]
    assert by_solved.names(ACTIVE) == ["binary"] and by_solved.pools["partial"].signal == 0.0
    with pytest.raises(ValueError, match="lack the solved split"):
        by_solved.observe({"binary": [1, 1, 1.0, 4]}, step=1)
    with pytest.raises(ValueError, match="signal_by"):
        Curriculum(rows("x", 2), signal_by="score", **kw)


def test_a_pinned_pool_without_signal_trains_from_step_1_and_is_never_held():
    kw = dict(seed=0, min_signal=0.1, probe_frac=0.125, window=8)
    pinned = Curriculum(rows("easy", 20) + rows("hard", 30) + rows("solved", 10), pinned=("hard",), **kw)
    table = pinned.preflight(PREFLIGHT)
    plain = make()
    plain.preflight(PREFLIGHT)
    assert plain.pools["hard"].status == HELD  # what pinning changes: without it the no-signal pool is held
    assert pinned.names(ACTIVE) == ["easy", "hard"] and pinned.names(HELD) == ["solved"]
    assert "hard" in table and "active (pinned)" in table
    drawn = Counter(r["domain"] for _ in range(10) for r in pinned.next(8))
    assert drawn["hard"] >= 30 and drawn["easy"] >= 30  # an equal share of the active prompts
    # its signal stays at zero for many groups: a pinned pool stays; an unpinned one is held
    lines = pinned.observe({"hard": [40, 0, 0.0, 160], "easy": [40, 0, 0.0, 160]}, step=5)
    assert pinned.pools["hard"].status == ACTIVE and not any(ln.startswith("curriculum: hard ") for ln in lines)
    assert pinned.pools["easy"].status == HELD  # the other active pool: held once the floor (1) allows it


def test_pinning_alone_does_not_pass_a_mix_without_signal_and_a_wrong_name_lists_the_pools():
    kw = dict(seed=0, min_signal=0.1, probe_frac=0.125, window=8)
    c = Curriculum(rows("easy", 20) + rows("hard", 30), pinned=("hard",), **kw)
    with pytest.raises(NoSignal, match="no task of the training mix has signal"):
        c.preflight({"easy": [8, 0, 0.0, 32], "hard": [8, 0, 0.0, 32]})
    with pytest.raises(ValueError) as err:
        Curriculum(rows("easy", 20) + rows("hard", 30), pinned=("hrad",), **kw)
    assert str(err.value) == "curriculum.pinned: hrad is not a pool of data.train; its pools are easy, hard"


def signal_mix(shares: str) -> Curriculum:
    # a: half its groups split right and wrong; b: a fifth; c: pinned, no signal yet (weight min_signal/2)
    c = Curriculum(rows("a", 40) + rows("b", 40) + rows("c", 40), seed=0, min_signal=0.1, probe_frac=0.0, window=8,
                   pinned=("c",), shares=shares)
    c.preflight({"a": [10, 6, 20.0, 80], "b": [10, 2, 8.0, 80], "c": [10, 0, 0.0, 80]})
    return c


def test_signal_shares_draw_the_active_pools_in_proportion_to_their_signal_over_every_stretch():
    equal, by_signal = signal_mix("equal"), signal_mix("signal")
    assert Counter(r["domain"] for r in equal.next(85)) == {"a": 29, "b": 28, "c": 28}  # the turn, as before
    drawn = [r["domain"] for r in by_signal.next(85)]  # weights 0.6, 0.2 and 0.05 (pinned, half of min_signal)
    assert Counter(drawn) == {"a": 60, "b": 20, "c": 5}
    for k in range(0, 85, 17):  # not only on average: every stretch of 17 holds the shares within one prompt
        part = Counter(drawn[k:k + 17])
        assert abs(part["a"] - 12) <= 1 and abs(part["b"] - 4) <= 1 and abs(part["c"] - 1) <= 1, (k, part)
    assert by_signal.shares_now() == pytest.approx({"a": 0.6 / 0.85, "b": 0.2 / 0.85, "c": 0.05 / 0.85})
    assert equal.shares_now() == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    table = {ln.split()[0]: ln.split() for ln in by_signal.table("now").splitlines()[2:]}
    assert table["a"][1:5] == ["10", "0.250", "0.600", "0.706"] and table["c"][4] == "0.059"
    m = by_signal.metrics()
    assert m["curriculum/share/a"] == pytest.approx(0.6 / 0.85) and m["curriculum/share/c"] == pytest.approx(0.05 / 0.85)


def test_signal_shares_follow_the_signal_as_it_moves_and_skip_held_pools():
    c = signal_mix("signal")
    c.next(40)
    c.observe({"a": [64, 0, 512.0, 512], "b": [64, 48, 200.0, 512]}, step=3)  # a solved, b opening up
    assert c.pools["a"].status == HELD and c.pools["b"].signal > 0.7
    assert "a" not in c.credit  # a held pool leaves the turn; it starts level if re-admitted
    drawn = Counter(r["domain"] for r in c.next(60))
    w_b = c.pools["b"].signal
    assert drawn["a"] == 0 and abs(drawn["b"] - 60 * w_b / (w_b + 0.05)) <= 1 and drawn["c"] >= 2
    with pytest.raises(ValueError, match=r"curriculum.shares: 'size' is not one of \['equal', 'signal'\]"):
        Curriculum(rows("x", 2), seed=0, min_signal=0.1, probe_frac=0.0, window=8, shares="size")


def test_a_resumed_signal_share_curriculum_draws_what_an_uninterrupted_one_draws():
    a = signal_mix("signal")
    a.next(7)  # part-way through the turn: the credits are uneven
    state = json.loads(json.dumps(a.state_dict()))
    assert state["credit"] and any(v != 0 for v in state["credit"].values())
    b = signal_mix("signal")
    b.load_state_dict(state)
    fresh = signal_mix("signal")
    fresh.load_state_dict({**state, "credit": {}})  # a checkpoint without the credits
    seqs = {"a": [], "b": [], "fresh": []}
    for step in range(3, 10):
        for name, cur in (("a", a), ("b", b), ("fresh", fresh)):
            seqs[name] += [r["id"] for r in cur.next(6)]
            cur.observe({"a": [2, step % 2, 3.0, 16], "b": [2, 1, 4.0, 16]}, step)
    assert seqs["a"] == seqs["b"] and a.state_dict() == b.state_dict()
    assert seqs["fresh"] != seqs["a"]  # what the checkpointed credits are for
