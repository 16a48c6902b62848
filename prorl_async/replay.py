"""``prorl-async replay RUN_DIR --step N``: one learner step recomputed offline from the ledger.

The learner's state before step N is rebuilt exactly: the newest checkpoint at or before
version N-1 (or, when none is kept, the run's initial model: a torch learner starts from the
model folder alone), then every step between the checkpoint and N re-applied from the ledger
(:mod:`prorl_async.ledger`: the batch each step trained on, row for row, and the held-out scores
the learner received before it, which can reset the reference). Step N itself then runs on its
recorded batch with the run's config and ``train.num_threads`` torch threads, and its loss, KL,
entropy and gradient norm are compared with the values ``history.jsonl`` logged for step N.

How exact: the recorded batch makes the replay independent of the run's timing, so synchronous
and asynchronous runs replay alike; in fp32 on CPU the recomputation is deterministic and equals
the logged values (tested to 1e-6 relative, ``tests/test_ledger.py``; in practice bit for bit).
Kernels that are not deterministic (GPU atomics, a different thread count) loosen that to float
rounding: ``--rtol 1e-3`` is the tolerance to state there. Replay needs the torch learner with
one rank (``train.learner=torch``): DeepSpeed's checkpoint is ZeRO-partitioned.

Pure: no Ray.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

from prorl_async.checkpoint import Checkpoint, _verify, is_run_dir, list_checkpoints
from prorl_async.ledger import LedgerError, batch_table, read_step, recorded_steps

#: the step metrics a replay recomputes and compares (the loss is their sum with the run's coefficients)
COMPARED = ("actor/pg_loss", "kl/loss_term", "actor/entropy", "actor/grad_norm", "actor/approx_kl",
            "is/weight_mean", "actor/updates")
RTOL, ATOL = 1e-6, 1e-12


@dataclasses.dataclass(frozen=True)
class Compared:
    metric: str
    logged: Optional[float]
    replayed: float

    @property
    def rel(self) -> float:
        if self.logged is None:
            return float("nan")
        diff = abs(self.replayed - self.logged)
        return 0.0 if diff <= ATOL else diff / max(abs(self.logged), abs(self.replayed))


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    step: int
    start: str                 # the checkpoint replay started from, or "initial model"
    reapplied: list[int]       # steps re-applied from the ledger before ``step``
    compared: list[Compared]
    worst_reapplied: float     # the largest relative difference over the re-applied steps' metrics

    def ok(self, rtol: float = RTOL) -> bool:
        return all(c.logged is not None and c.rel <= rtol for c in self.compared) and self.worst_reapplied <= rtol

    def table(self) -> str:
        lines = [f"{'metric':<20}{'logged':>16}{'replayed':>16}{'rel. diff':>12}"]
        for c in self.compared:
            logged = "not logged" if c.logged is None else f"{c.logged:.9g}"
            lines.append(f"{c.metric:<20}{logged:>16}{c.replayed:>16.9g}{c.rel:>12.2e}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"step": self.step, "start": self.start, "reapplied": self.reapplied,
                "worst_reapplied_rel": self.worst_reapplied,
                "compared": {c.metric: {"logged": c.logged, "replayed": c.replayed, "rel": c.rel} for c in self.compared}}


def step_range(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}..{b}"


def read_run_history(run_dir: Path) -> dict[int, dict]:
    """``history.jsonl`` of the run (or, if newer, of its newest checkpoint) by step."""
    from prorl_async.outputs import HISTORY, read_history

    found: dict[int, dict] = {}
    paths = [p / HISTORY for p in list_checkpoints(run_dir)] + [run_dir / HISTORY]
    for path in paths:
        if path.is_file():
            for h in read_history(path):
                found.setdefault(int(h["step"]), h)
    return found


def _start(run_dir: Path, step: int, steps: set[int]) -> Optional[Checkpoint]:
    """The newest complete checkpoint at version < ``step`` whose following steps the ledger
    holds; None: start from the initial model (the ledger holds 1 .. step-1)."""
    for p in reversed(list_checkpoints(run_dir)):
        manifest = _verify(p)
        if manifest is None:
            continue
        ck = Checkpoint(p, int(manifest["step"]), manifest)
        if ck.version < step and all(k in steps for k in range(ck.version + 1, step)):
            return ck
    if all(k in steps for k in range(1, step)):
        return None
    have = sorted(steps)
    raise LedgerError(f"step {step} of {run_dir} cannot be rebuilt: no kept checkpoint before it is followed by a "
                      f"ledger of every step up to {step - 1} (checkpoints: "
                      f"{[p.name for p in list_checkpoints(run_dir)] or 'none'}; ledger steps {have[0]}..{have[-1]}); "
                      f"replay a step that follows a kept checkpoint, or keep more (train.keep_last)")


def replay(run_dir, step: int, log: Callable[[str], None] = print) -> ReplayResult:
    """Step ``step`` of ``run_dir`` recomputed from its checkpoint and ledger (module docstring)."""
    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.torch_learner import TorchLearner
    from prorl_async.models import resolve_model_path

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not is_run_dir(run_dir):
        why = "no such directory" if not run_dir.is_dir() else "no config.yaml"
        raise LedgerError(f"{run_dir} is not a prorl-async run: {why}; pass a run directory (runs/<name>)")
    if step < 1:
        raise LedgerError(f"--step must be >= 1 (history step N is the update that made policy version N), got {step}")
    read_step(run_dir, step)  # a clear error before anything is loaded
    cfg = load_config(str(run_dir / "config.yaml"))
    if cfg.train.learner != "torch" or cfg.train.num_learners != 1:
        raise LedgerError(f"{run_dir} trained with train.learner={cfg.train.learner}, train.num_learners="
                          f"{cfg.train.num_learners}; replay rebuilds the torch learner with one rank only")
    ck = _start(run_dir, step, set(recorded_steps(run_dir)))
    torch.set_num_threads(cfg.train.num_threads)  # the learner's reductions, as in the run
    device = "cuda" if cfg.train.learner_num_gpus > 0 and torch.cuda.is_available() else "cpu"
    if ck is None:
        learner = TorchLearner(cfg, resolve_model_path(cfg.model, seed=cfg.train.seed, log=log), device=device)
        first, start = 1, "initial model"
    else:
        learner = TorchLearner(cfg, str(ck.path / "policy"), device=device)
        learner.load_checkpoint(ck.path)
        first, start = ck.version + 1, str(ck.path)
    log(f"replay of step {step}: from {start}" + (f", re-applying {step_range(first, step - 1)} from the ledger"
                                                  if first < step else ""))
    history = read_run_history(run_dir)
    worst, metrics = 0.0, {}
    for k in range(first, step + 1):
        rows, observed = read_step(run_dir, k)
        for obs in observed:  # held-out scores the learner got before step k (a val_stall reset)
            if not (ck is not None and k == first and obs.get("checkpointed")):
                learner.observe_validation(int(obs["step"]), float(obs["score"]))
        metrics = learner.train_step(batch_table(rows), step=k - 1)
        if k < step and k in history:
            worst = max([worst] + [Compared(m, history[k].get(m), metrics[m]).rel for m in COMPARED
                                   if m in metrics and history[k].get(m) is not None])
    logged = history.get(step, {})
    compared = [Compared(m, logged.get(m), float(metrics[m])) for m in COMPARED if m in metrics]
    a = cfg.algo  # the step's loss: what its updates minimised, token-mean over its mini-batches
    replayed_loss = total_loss(metrics, a.kl_coef, a.entropy_coef)
    if replayed_loss is not None:
        compared.insert(0, Compared("loss", total_loss(logged, a.kl_coef, a.entropy_coef), replayed_loss))
    return ReplayResult(step, start, list(range(first, step)), compared, worst)


def total_loss(m: dict, kl_coef: float, entropy_coef: float) -> Optional[float]:
    """``actor/pg_loss + kl_coef * kl/loss_term - entropy_coef * actor/entropy`` of a step's metrics."""
    if m.get("actor/pg_loss") is None:
        return None
    return float(m["actor/pg_loss"] + kl_coef * m.get("kl/loss_term", 0.0) - entropy_coef * m.get("actor/entropy", 0.0))


def reset_step(run_dir, reset: int) -> tuple[int, str]:
    """The history step of the ``reset``-th reference reset (1-based) and its cause."""
    from prorl_async.ledger import reset_steps

    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise LedgerError(f"{run_dir} is not a prorl-async run: no config.yaml; pass a run directory")
    history = [read_run_history(run_dir)[k] for k in sorted(read_run_history(run_dir))]
    resets = reset_steps(history)
    if not 1 <= reset <= len(resets):
        raise LedgerError(f"--reset {reset}: {run_dir} logged {len(resets)} reference reset(s)"
                          + (f" (at steps {', '.join(f'{s} ({c})' for s, c in resets)})" if resets else "")
                          + "; pass one of those")
    return resets[reset - 1]


def dump_json(result: ReplayResult, path: str) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
