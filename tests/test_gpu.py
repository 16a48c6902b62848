"""The GPU code paths (CUDA learner with bf16 autocast, CUDA generation engine). They need a
CUDA device and skip cleanly without one; NCCL weight sync is in tests/learners/test_weight_sync.py
and the vLLM engine on GPU in tests/engines/test_vllm.py."""

import math

import pytest
import torch

from prorl_async.config import load_config
from tests.learners._batches import graded_table

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_torch_learner_step_on_cuda_with_bf16_autocast(tiny_model):
    from prorl_async.learners.torch_learner import TorchLearner

    cfg = load_config(None, ["model.autocast_bf16=true", "train.mini_batches=1", "train.prompts_per_step=4",
                             "rollout.n=4", "train.micro_batch_size=16"])
    learner = TorchLearner(cfg, tiny_model, device="cuda")
    assert learner.autocast
    before = [p.detach().clone() for p in learner.model.parameters()]
    m = learner.train_step(graded_table(groups=4, n=4))
    assert math.isfinite(m["actor/pg_loss"]) and m["actor/updates"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))


def test_hf_engine_generates_on_cuda(tiny_model):
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine

    eng = HFEngine(tiny_model, device="cuda")
    out = eng.generate([eng.tokenizer("12+34=")["input_ids"]], SamplingSpec(n=3, max_new_tokens=4, seed=1))
    assert len(out[0]) == 3 and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in out[0])
    assert all(lp <= 0 for c in out[0] for lp in c.logprobs)
