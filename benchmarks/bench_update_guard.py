"""What the update guard (prorl_async/learners/update_guard.py) costs in a healthy run.

On a real model's parameters (random gradients, real ``torch.optim.AdamW``), in one run:
a plain AdamW step, the same step through :class:`UpdateGuard` at the run's learning rate,
a full parameter copy (what copying the weights before every step would add), and one norm
pass over the weights; plus the guard's bound / weight norm per step, hence how many steps go
by between its norm passes, and how many copies it took (0 expected at a sane lr).

    .venv/bin/python benchmarks/bench_update_guard.py --model /path/to/hf_folder --lr 5e-6
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, table, write_json  # noqa: E402
from prorl_async.learners.update_guard import UpdateGuard, adam_step_bound, params_norm  # noqa: E402
from prorl_async.models import load_model  # noqa: E402


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(path: str, lr: float, repeats: int) -> dict:
    model = load_model(path)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    plain = torch.optim.AdamW(params, lr=lr)
    plain.step()  # state allocated outside the timing
    guarded_opt = torch.optim.AdamW(params, lr=lr)
    guard = UpdateGuard(guarded_opt, max_update_ratio=1.0)
    guard.step()
    copies = [torch.empty_like(p) for p in params]
    with torch.no_grad():
        t_plain = timed(plain.step, repeats)
        t_guard = timed(guard.step, repeats)
        t_copy = timed(lambda: torch._foreach_copy_(copies, [p.detach() for p in params]), repeats)
        t_norm = timed(lambda: params_norm(params), repeats)
    n_params = sum(p.numel() for p in params)
    norm = params_norm(params)
    bound = lr * adam_step_bound(0.9, 0.999, 10 ** 6) * math.sqrt(n_params)
    return {"model": Path(path).name, "params_m": n_params / 1e6, "lr": lr, "adamw_s": t_plain, "guarded_s": t_guard,
            "guarded_over_plain": t_guard / t_plain, "copy_s": t_copy, "copy_over_adamw": t_copy / t_plain,
            "norm_s": t_norm, "norm_over_adamw": t_norm / t_plain, "weight_norm": norm,
            "bound_over_norm": bound / norm, "steps_per_norm_pass": int(0.5 / (bound / norm)),
            "guard_copies": guard.copies_total, "guard_refused": guard.refused_total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="HF folder (repeatable)")
    ap.add_argument("--lr", action="append", type=float, required=True, help="learning rate per --model")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = [measure(m, lr, args.repeats) for m, lr in zip(args.model, args.lr)]
    print(table(rows, [("model", "model", "{}"), ("params_m", "M params", "{:.2f}"), ("lr", "lr", "{:.0e}"),
                       ("adamw_s", "AdamW s", "{:.4f}"), ("guarded_over_plain", "guarded/plain", "{:.2f}"),
                       ("copy_over_adamw", "copy/AdamW", "{:.2f}"), ("norm_over_adamw", "norm/AdamW", "{:.3f}"),
                       ("bound_over_norm", "bound/norm", "{:.1e}"), ("steps_per_norm_pass", "steps/norm pass", "{}"),
                       ("guard_copies", "copies", "{}")]))
    print(write_json("update_guard", {"machine": machine(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
