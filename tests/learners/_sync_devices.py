"""Spawned members for test_devices.py: rank 0 a TorchLearner sending its weights the way
LearnerActor does, rank 1 an HFEngine receiving them (each on its own device)."""

import torch


def member(rank: int, port: int, backend: str, device: str, model: str, q) -> None:
    try:
        from prorl_async.weight_sync import tensor_checksum

        dev = f"cuda:{rank}" if device == "cuda" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank)
        if rank == 0:
            from prorl_async.config import load_config
            from prorl_async.learners.core import sync_device
            from prorl_async.learners.torch_learner import TorchLearner
            from prorl_async.weight_sync import WeightSyncGroup
            from tests.learners._batches import graded_table

            cfg = load_config(None, [f"model.path={model}", "train.prompts_per_step=4", "rollout.n=4",
                                     "train.micro_batch_size=16", "train.mini_batches=1", "train.lr=1e-2",
                                     "model.autocast_bf16=false"])
            learner = TorchLearner(cfg, model, device=dev)
            learner.train_step(graded_table(groups=4, n=4, seed=1))  # weights now differ from the file
            group = WeightSyncGroup("127.0.0.1", port, 0, 2, backend, 60.0,
                                    device=sync_device(backend, learner.device))  # as LearnerActor does
            group.send(learner.named_tensors(), learner.version)
            q.put(("sender", (learner.version, tensor_checksum([t for _, t in learner.named_tensors()]),
                              str(group.device), str(next(learner.model.parameters()).device))))
        else:
            from prorl_async.engines.base import SamplingSpec
            from prorl_async.engines.hf import HFEngine

            eng = HFEngine(model, device=dev)
            before = eng.weights_checksum()[1]
            eng.init_weight_sync("127.0.0.1", port, 1, 2, backend, 60.0)
            staged_device = None
            info = eng.receive_weights()
            staged_device = str(eng._staged[1][0][1].device)
            version, checksum = eng.weights_checksum()
            out = eng.generate([[1, 5, 6, 7]], SamplingSpec(n=2, max_new_tokens=3, seed=0))
            q.put(("receiver", (version, checksum, before, staged_device, str(next(eng.model.parameters()).device),
                                info["version"], len(out[0]))))
    except Exception as e:  # reported to the test, which fails with it
        import traceback
        q.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
