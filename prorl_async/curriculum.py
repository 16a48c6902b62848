"""Data chosen by signal: pools per task (or difficulty level), held back while they teach nothing.

A group teaches the policy something only when its rewards differ (DAPO's dynamic sampling,
Yu et al. 2025, arXiv 2503.14476, Sec. 3.2, drops the others); a task the policy never or always
solves fills batches with groups that are dropped and refilled. ProRL (Liu et al. 2025, arXiv
2505.24864, Sec. 3) filters its prompts by the base model's pass rate for the same reason, once,
offline; here the pools are kept up to date during the run, so a task that was out of reach comes
back when the policy has grown into it, and a solved one steps aside (prime-rl's difficulty
pools do this per problem; here it is per pool, which needs no per-prompt history).

* A **pool** is every training row of one domain (``rg:TASK@LEVEL`` for Reasoning Gym, so levels
  are pools of their own).
* The **signal** of a pool is the share of its groups whose rewards are not all equal
  (``signal_by="reward"``, what dynamic sampling keeps) or whose samples split into fully correct
  and not (``signal_by="solved"``: a partial-credit task whose scores always differ a little has
  reward signal in every group, whether or not anything is ever solved), and its **pass rate** the
  mean reward of its samples (pass@1 where rewards are 0 or 1; with partial credit, the mean score:
  the table's ``reward`` column); both are moving averages over about ``window`` groups (an
  exponential average with weight 1/window per group), started from the preflight.
* **Preflight** (before step 1): ``preflight_prompts`` prompts of every pool, sampled as the
  rollouts are; the table of mean reward and signal per pool is printed and the pools are split.
  No pool with signal: the run stops at once with that table (:class:`NoSignal`).
* A pool is **active** while its signal is at least ``min_signal`` and **held** otherwise
  (the console says why: **too hard** below a pass rate of 0.25, **solved** above 0.75, and
  **settled** between, where each prompt's samples agree, some prompts always right and others
  never, so no group has a gradient); an active pool is held only once its signal falls
  below half of ``min_signal`` (hysteresis), so a pool does not flip on one unlucky request.
* At least ``min_active`` pools stay active (a **floor**): an active pool is not held while the
  floor would break, and when fewer are active the held pools with the most signal are admitted.
  As a policy sharpens, its samples of one prompt agree more often and every pool's signal falls
  together; without a floor the batches then come from the one or two pools left, and the rest
  of the mix is only probed (measured: one pool of 13 from step 153 of a 200-step run).
* A **pinned** pool (``pinned``) is active from step 1 and never held back, whatever its signal:
  a level the base model cannot yet solve trains from the start, for its equal share of the
  prompts, without lowering ``min_signal`` for every pool (which keeps the weak pools in the
  batches too; measured: a worse run). It still counts toward the floor.
* Prompts come from the active pools in turn: each pool an equal share, whatever its size
  (``shares="equal"``), or a share in proportion to its signal (``shares="signal"``, at least
  half of ``min_signal``, so a pinned or floor-kept pool is still drawn): under equal shares the
  groups dynamic sampling keeps already come from a pool in proportion to its signal, and the
  rest of a low-signal pool's share is generated only to be dropped; by signal, the prompts go
  where the learning is (a pool whose samples split right and wrong half the time draws about
  four times the prompts of one at an eighth), and fewer groups are generated per kept group.
  The turn is a smooth weighted round-robin (every pick adds each active pool's weight to its
  credit, takes the pool with the most credit and charges it the total), deterministic from the
  checkpointed credits, so the shares hold over every short stretch and not only on average;
  ``probe_frac`` of them (at least one per request of two or more prompts while any pool is held)
  come from the held pools in turn, so their averages keep moving and a held pool whose signal
  reaches ``min_signal`` is **re-admitted**.

Every pool walks its own rows as :class:`~prorl_async.data.source.PromptSource` does (a seeded
shuffle per epoch); :meth:`Curriculum.state_dict` holds the pools' cursors, averages, statuses and
the round-robin positions and credits, so a resumed run draws exactly the prompts an uninterrupted run draws.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prorl_async.data.source import PromptSource

if TYPE_CHECKING:
    from prorl_async.config import Config

ACTIVE, HELD = "active", "held"
# why a pool without signal is held, by its pass rate (the console's words; the decision is the signal's)
TOO_HARD_BELOW, SOLVED_ABOVE = 0.25, 0.75
SIGNAL_BY = ("reward", "solved")
SHARES = ("equal", "signal")


class NoSignal(RuntimeError):
    """No pool of the training mix has signal: nothing can be learned from it as it is."""


@dataclass
class Pool:
    name: str
    source: PromptSource
    status: str = ACTIVE
    signal: float = 0.0       # moving share of groups with unequal rewards
    pass_rate: float = 0.0    # moving mean reward
    groups: int = 0           # groups observed (preflight included)
    changes: list = field(default_factory=list)  # (step, new status, signal) of every change

    def observe(self, groups: int, signal_groups: int, reward_sum: float, samples: int, alpha: float) -> None:
        """Move the averages by ``groups`` new groups (``signal_groups`` of them with signal)."""
        if groups <= 0:
            return
        w = 1.0 - (1.0 - alpha) ** groups if self.groups else 1.0  # the first observation sets the average
        self.signal += w * (signal_groups / groups - self.signal)
        if samples:
            self.pass_rate += w * (reward_sum / samples - self.pass_rate)
        self.groups += groups


class Curriculum:
    """The pools of a run's training rows and the rule that feeds requests from them."""

    def __init__(self, rows: list[dict], seed: int, min_signal: float, probe_frac: float, window: int,
                 min_active: int = 1, signal_by: str = "reward", pinned: tuple[str, ...] = (),
                 shares: str = "equal"):
        if not rows:
            raise ValueError("the training dataset is empty; check data.train")
        by_domain: dict[str, list[dict]] = {}
        for row in rows:
            by_domain.setdefault(row["domain"], []).append(row)
        self.pools = {name: Pool(name, PromptSource(r, seed=seed + k))
                      for k, (name, r) in enumerate(sorted(by_domain.items()))}
        self.min_signal, self.probe_frac, self.alpha = min_signal, probe_frac, 1.0 / max(window, 1)
        if signal_by not in SIGNAL_BY:
            raise ValueError(f"curriculum.signal_by: {signal_by!r} is not one of {list(SIGNAL_BY)}")
        self.min_active, self.signal_by = max(1, int(min_active)), signal_by
        if shares not in SHARES:
            raise ValueError(f"curriculum.shares: {shares!r} is not one of {list(SHARES)}")
        self.shares = shares
        unknown = sorted(set(pinned) - set(self.pools))
        if unknown:
            raise ValueError(f"curriculum.pinned: {', '.join(unknown)} is not a pool of data.train; its pools are "
                             f"{', '.join(self.pools)}")
        self.pinned = frozenset(pinned)
        self.seed = seed
        self.turn = {ACTIVE: 0, HELD: 0}  # round-robin positions
        self.credit: dict[str, float] = {}  # the active pools' credits (shares="signal")
        self.probe_debt = 0.0             # probes owed (fractional) to the held pools
        self.consumed = 0
        self.step = 0                     # the learner version the last observation was made at

    # ------------------------------------------------------------------ choosing prompts
    def names(self, status: str) -> list[str]:
        return [n for n, p in self.pools.items() if p.status == status]

    def weight(self, name: str) -> float:
        """An active pool's weight in the turn: 1 (``shares="equal"``) or its signal, at least half of ``min_signal``."""
        return 1.0 if self.shares == "equal" else max(self.pools[name].signal, self.min_signal / 2)

    def _next_from(self, status: str) -> dict:
        names = self.names(status)
        if status == ACTIVE and self.shares == "signal":
            weights = [self.weight(n) for n in names]
            for n, w in zip(names, weights):
                self.credit[n] = self.credit.get(n, 0.0) + w
            name = max(names, key=lambda n: self.credit[n])  # the first of equal credits
            self.credit[name] -= sum(weights)
        else:
            name = names[self.turn[status] % len(names)]
        self.turn[status] += 1
        return self.pools[name].source.next(1)[0]

    def next(self, k: int) -> list[dict]:
        """``k`` prompts: round-robin over the active pools, ``probe_frac`` from the held ones."""
        out = []
        held = self.names(HELD)
        probes = 0
        if held and self.probe_frac > 0:
            self.probe_debt += self.probe_frac * k
            # at least one per request of two or more prompts; a one-prompt request (what admission
            # control sizes near a run's end) only when a whole probe is owed, or the held pools
            # would take every such request and the active pools starve
            probes = min(k, max(int(k > 1), int(self.probe_debt)))
            self.probe_debt = max(0.0, self.probe_debt - probes)
        if not self.names(ACTIVE):
            probes = k
        for _ in range(k - probes):
            out.append(self._next_from(ACTIVE))
        for _ in range(probes):
            out.append(self._next_from(HELD))
        self.consumed += k
        return out

    def preflight_rows(self, per_pool: int) -> dict[str, list[dict]]:
        """``per_pool`` training rows of every pool for the preflight (a seeded draw that moves no cursor)."""
        out = {}
        for name, pool in self.pools.items():
            rows = list(pool.source.rows)
            random.Random(f"preflight-{self.seed}-{name}").shuffle(rows)
            out[name] = [rows[i % len(rows)] for i in range(per_pool)]
        return out

    # ------------------------------------------------------------------ observing
    def observe(self, pools: dict, step: int) -> list[str]:
        """Graded groups per pool (``{pool: [groups, signal_groups, reward_sum, samples]}``, what the
        replay buffer's ``put`` reports); returns a line for every pool whose status changed."""
        self.step = step
        lines = []
        for name, counts in pools.items():
            pool = self.pools.get(name)
            if pool is None:  # a domain this run does not train (cannot happen from its own requests)
                continue
            self._observe(pool, counts)
            if line := self._decide(pool, step):
                lines.append(line)
        return lines + self._fill_floor(step)

    def _observe(self, pool: Pool, counts) -> None:
        """``counts``: the pool's :data:`~prorl_async.algo.sampling.GROUP_COUNTS` (a 4-long list,
        without the solved split, is read as such where ``signal_by`` is "reward")."""
        groups, reward_sum, samples = int(counts[0]), float(counts[2]), int(counts[3])
        if self.signal_by == "solved":
            if len(counts) < 5:
                raise ValueError(f"curriculum: pool {pool.name}'s counts {list(counts)} lack the solved split "
                                 "that signal_by='solved' reads")
            signal = int(counts[4])
        else:
            signal = int(counts[1])
        pool.observe(groups, signal, reward_sum, samples, self.alpha)

    def _decide(self, pool: Pool, step: int) -> str:
        if pool.status == HELD and pool.signal >= self.min_signal:
            return self._set(pool, ACTIVE, step, "re-admitted")
        if (pool.status == ACTIVE and pool.name not in self.pinned and pool.signal < self.min_signal / 2
                and len(self.names(ACTIVE)) > self.min_active):
            # the floor's pools stay (at least the last): held pools are probed, active ones feed the batches
            return self._set(pool, HELD, step, f"held back ({self.why_held(pool)})")
        return ""

    def _fill_floor(self, step: int) -> list[str]:
        """Admit the held pools with the most signal while fewer than ``min_active`` are active."""
        held = sorted(self.names(HELD), key=lambda n: (-self.pools[n].signal, n))
        missing = max(0, self.min_active - len(self.names(ACTIVE)))
        return [self._set(self.pools[n], ACTIVE, step, f"admitted to keep {self.min_active} pools active")
                for n in held[:missing]]

    def _set(self, pool: Pool, new: str, step: int, verb: str) -> str:
        pool.status = new
        self.credit.pop(pool.name, None)  # a pool (re-)entering the turn starts level
        pool.changes.append((step, new, round(pool.signal, 4)))
        return (f"curriculum: {pool.name} {verb} at step {step}: signal {pool.signal:.2f}, "
                f"pass rate {pool.pass_rate:.2f} over {pool.groups} groups")

    @staticmethod
    def why_held(pool: Pool) -> str:
        if pool.pass_rate < TOO_HARD_BELOW:
            return "too hard"
        return "solved" if pool.pass_rate > SOLVED_ABOVE else "settled"

    def preflight(self, results: dict) -> str:
        """Set every pool from its preflight (``results``: ``{pool: [groups, signal_groups,
        reward_sum, samples]}``) and return the table; raises :class:`NoSignal` when no pool has signal."""
        for name, pool in self.pools.items():
            self._observe(pool, results.get(name, (0, 0, 0.0, 0, 0)))
            pool.status = ACTIVE if pool.signal >= self.min_signal or name in self.pinned else HELD
            pool.changes.append((0, pool.status, round(pool.signal, 4)))
        with_signal = [n for n, p in self.pools.items() if p.signal >= self.min_signal]
        if with_signal:
            self._fill_floor(0)
        table = self.table("preflight")
        if not with_signal:  # pinned pools alone, without signal, would teach nothing either
            raise NoSignal(f"no task of the training mix has signal (a group with unequal rewards in at least "
                           f"{self.min_signal:.0%} of its groups) at the start:\n{table}\nFix: easier levels of "
                           f"these tasks (task options in the source), few-shot demos (shots=2), another answer "
                           f"format (answer=stated), more samples per prompt (rollout.n), a higher "
                           f"rollout.temperature, or curriculum.min_signal lower")
        return table

    # ------------------------------------------------------------------ reporting
    def table(self, title: str) -> str:
        rows = [f"{title}: {len(self.names(ACTIVE))} of {len(self.pools)} pools active",
                f"{'pool':<34}{'groups':>8}{'reward':>9}{'signal':>9}{'share':>8}  status"]
        shares = self.shares_now()
        for name, p in self.pools.items():
            status = (p.status if p.status == ACTIVE else f"held ({self.why_held(p)})") + (" (pinned)" if name in self.pinned else "")
            rows.append(f"{name:<34}{p.groups:>8}{p.pass_rate:>9.3f}{p.signal:>9.3f}{shares[name]:>8.3f}  {status}")
        return "\n".join(rows)

    def shares_now(self) -> dict[str, float]:
        """Every pool's share of the active pools' prompts at the current weights (0 for a held pool;
        the probes of the held pools come on top)."""
        active = self.names(ACTIVE)
        total = sum(self.weight(n) for n in active)
        return {n: (self.weight(n) / total if n in active else 0.0) for n in self.pools}

    def metrics(self) -> dict[str, float]:
        out = {"curriculum/active_pools": float(len(self.names(ACTIVE))),
               "curriculum/held_pools": float(len(self.names(HELD)))}
        shares = self.shares_now()
        for name, p in self.pools.items():
            out[f"curriculum/share/{name}"] = shares[name]
            out[f"curriculum/signal/{name}"] = p.signal
            out[f"curriculum/pass_rate/{name}"] = p.pass_rate
            out[f"curriculum/active/{name}"] = float(p.status == ACTIVE)
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"kind": "curriculum", "consumed": self.consumed, "turn": dict(self.turn),
                "probe_debt": self.probe_debt, "step": self.step, "credit": dict(self.credit),
                "pools": {n: {"source": p.source.state_dict(), "status": p.status, "signal": p.signal,
                              "pass_rate": p.pass_rate, "groups": p.groups, "changes": [list(c) for c in p.changes]}
                          for n, p in self.pools.items()}}

    def load_state_dict(self, s: dict) -> None:
        if s.get("kind") != "curriculum" or set(s["pools"]) != set(self.pools):
            raise ValueError(f"the checkpoint's prompt source (pools {sorted(s.get('pools', {}))}) does not match "
                             f"this run's curriculum pools {sorted(self.pools)}; resume with the run's own data config")
        self.consumed, self.turn, self.probe_debt, self.step = s["consumed"], dict(s["turn"]), s["probe_debt"], s["step"]
        self.credit = dict(s.get("credit", {}))  # a checkpoint from before shares="signal" has none (equal shares)
        for n, d in s["pools"].items():
            p = self.pools[n]
            p.source.load_state_dict(d["source"])
            p.status, p.signal, p.pass_rate, p.groups = d["status"], d["signal"], d["pass_rate"], d["groups"]
            p.changes = [tuple(c) for c in d["changes"]]


def prompt_source(cfg: Config, rows: list[dict]) -> PromptSource | Curriculum:
    """The run's training prompts: one shuffled stream, or pools chosen by signal (``curriculum.enabled``)."""
    c = cfg.curriculum
    if not c.enabled:
        return PromptSource(rows, seed=cfg.data.shuffle_seed)
    return Curriculum(rows, seed=cfg.data.shuffle_seed, min_signal=c.min_signal, probe_frac=c.probe_frac, window=c.window,
                      min_active=c.min_active, signal_by=c.signal_by,
                      pinned=tuple(c.pinned), shares=c.shares)
