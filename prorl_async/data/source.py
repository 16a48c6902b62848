"""An endless, reproducible stream of prompts with a resumable cursor.

Rows are shuffled per epoch with ``seed + epoch``; ``state_dict`` is (epoch, position,
consumed), enough to resume exactly where a run stopped, epoch boundaries included.
"""

from __future__ import annotations

import random


class PromptSource:
    def __init__(self, rows: list[dict], seed: int = 0):
        if not rows:
            raise ValueError("the training dataset is empty; check data.train")
        self.rows, self.seed = rows, seed
        self.epoch, self.pos, self.consumed = 0, 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
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
        return {"epoch": self.epoch, "pos": self.pos, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, s: dict) -> None:
        self.seed, self.epoch, self.pos, self.consumed = s["seed"], s["epoch"], s["pos"], s["consumed"]
        self._order = self._shuffle(self.epoch)
