"""Two gloo ranks each compute REINFORCE++-baseline advantages on half the groups with the
all-reduced whitening of prorl_async.learners.batch.prepare_batch; rank 0 also computes
the whole batch alone. Results go to <out>/rank{r}.pt and <out>/full.pt."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, out: str, port: int) -> None:
    from prorl_async.algo.shaping import LengthPenaltySchedule
    from prorl_async.config import load_config
    from prorl_async.learners.batch import prepare_batch
    from tests.learners._batches import graded_table

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config(None, ["train.prompts_per_step=6", "rollout.n=4", "train.mini_batches=1"])
    table = graded_table(groups=6, n=4, seed=3)
    sched = LengthPenaltySchedule(1, 1, 0)
    share = table.slice(rank * 12, 12)  # whole groups per rank

    def reduce(s):
        dist.all_reduce(s)
        return s

    b, _ = prepare_batch(share, 0, cfg, 0, sched, stats_reduce=reduce)
    torch.save(b["advantages"], os.path.join(out, f"rank{rank}.pt"))
    if rank == 0:
        full, _ = prepare_batch(table, 0, cfg, 0, sched)
        torch.save(full["advantages"], os.path.join(out, "full.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    from prorl_async.weight_sync import free_port
    mp.spawn(run, args=(sys.argv[1], free_port()), nprocs=2)
