"""Entry point for the 2-process gloo test (kept tiny: spawned children import only this)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from prorl_async.algo import reinforce_pp_baseline


def rank_main(rank: int, world_size: int, port: int, out_dir: str, shards) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        rewards, group_index, mask = shards[rank]
        adv = reinforce_pp_baseline(
            rewards, group_index, mask, stats_reduce=lambda s: dist.all_reduce(s)
        )
        torch.save(adv, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
