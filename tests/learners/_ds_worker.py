"""DeepSpeed learner ranks in their own processes (a real gloo / NCCL world), for test_multirank.py.

``python _ds_worker.py SPEC.json`` where the spec names: ``world`` (ranks), ``model``, ``device``
(cpu / cuda), ``zero`` (stage), ``steps`` (batch seeds to train on, in order), ``load`` / ``save``
(a checkpoint directory to resume from / write after the steps), ``out`` (directory for results),
optionally ``overrides`` (config overrides added last). Each rank trains on :func:`shard_groups` of
every batch and writes ``result-rank<r>.pt`` with the metrics of every step, the KL the reset policy
judged at each (``batch_kl``) and the policy's reset counts (rank 0 also the full weights after the
last step).
"""

import json
import os
import sys

import torch
import torch.multiprocessing as mp


def batch(seed: int):
    """An odd number of groups (5 x 4 samples) with some samples invalid (grader failure)."""
    import pyarrow as pa

    from tests.learners._batches import graded_table

    t = graded_table(groups=5, n=4, seed=seed)
    valid = [not (i % 7 == 3) for i in range(t.num_rows)]  # rows 3, 10, 17 invalid
    return t.set_column(t.schema.get_field_index("reward_valid"), "reward_valid", pa.array(valid))


def config(spec: dict):
    from prorl_async.config import load_config

    return load_config(None, [
        f"model.path={spec['model']}", "train.prompts_per_step=6", "rollout.n=4", "train.micro_batch_size=4",
        "train.lr=1e-3", "algo.kl_coef=0.001", "model.autocast_bf16=false", "train.learner=deepspeed",
        f"train.zero_stage={spec['zero']}", "train.mini_batches=1", f"train.num_learners={spec['world']}",
        "train.warmup_lr_steps=2", *spec.get("overrides", [])])


def run(rank: int, spec: dict, port: int) -> None:
    from prorl_async.learners.batch import shard_groups
    from prorl_async.learners.deepspeed import DeepSpeedLearner

    torch.set_num_threads(1)
    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    learner = DeepSpeedLearner(config(spec), spec["model"], device=device, rank=rank, world_size=spec["world"],
                               master_port=port)
    if spec.get("load"):
        learner.load_state(spec["load"])
    metrics, batch_kl = [], []
    for seed in spec["steps"]:
        step = learner.version
        metrics.append(learner.train_step(shard_groups(batch(seed), rank, spec["world"]), step))
        batch_kl.append(learner.core.batch_kl)
    if spec.get("save"):
        learner.save_state(spec["save"])
    weights = {n: t.detach().cpu().clone() for n, t in learner.named_tensors()}  # collective under ZeRO-3
    torch.save({"metrics": metrics, "weights": weights if rank == 0 else None, "version": learner.version,
                "batch_kl": batch_kl, "resets": learner.ref_policy.metrics(),
                "ref_device": str(next(learner.ref.parameters()).device)},
               os.path.join(spec["out"], f"result-rank{rank}.pt"))
    # Leave the world before the interpreter ends: gloo's worker threads still holding work at
    # finalisation abort the rank ("terminate called without an active exception", SIGABRT), which
    # failed a fresh-clone CI run once (the resumed leg of test_two_rank_stop_and_resume_continues_exactly).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from prorl_async.weight_sync import free_port

    spec = json.load(open(sys.argv[1]))
    # free_port's window: another process (a test on the other xdist worker) may bind the port before
    # rank 0's store listens on it; rank 0 then fails at the rendezvous (EADDRINUSE, as a fresh-clone
    # CI run did once), before anything is trained or written, so the world is spawned again on another port
    for attempt in range(3):
        try:
            mp.spawn(run, args=(spec, free_port()), nprocs=spec["world"])
            break
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            print(f"rendezvous port taken (attempt {attempt + 1}); spawning the world again", file=sys.stderr)
