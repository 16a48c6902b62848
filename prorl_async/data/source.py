"""An endless, reproducible stream of prompts with a resumable cursor.

Rows are shuffled per epoch by a generator seeded with the pair (``seed``, epoch), so no two
pairs share an order (with ``seed + epoch``, seed 1's first epoch was seed 0's second).
``state_dict`` is (epoch, position, consumed, seed, order), enough to resume exactly where a run
stopped, epoch boundaries included. A checkpoint written before the pair keyed the shuffle has
no ``order`` and resumes with the order its run used (``Random(seed + epoch)``, "legacy").
"""

from __future__ import annotations

import random

ORDER = "seed-epoch"  # the shuffle of new sources; "legacy": Random(seed + epoch)


class PromptSource:
    def __init__(self, rows: list[dict], seed: int = 0):
        if not rows:
            raise ValueError("the training dataset is empty; check data.train")
        self.rows, self.seed, self.order = rows, seed, ORDER
        self.epoch, self.pos, self.consumed = 0, 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        key = self.seed + epoch if self.order == "legacy" else f"prompts-{self.seed}-{epoch}"
        random.Random(key).shuffle(order)
        return order

    def next(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.rows[self._order[self.pos]])
            self.pos += 1
        self.consumed += k
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "consumed": self.consumed, "seed": self.seed,
                "order": self.order}

    def load_state_dict(self, s: dict) -> None:
        self.seed, self.epoch, self.pos, self.consumed = s["seed"], s["epoch"], s["pos"], s["consumed"]
        self.order = s.get("order", "legacy")
        self._order = self._shuffle(self.epoch)
