"""The Learner protocol is the whole contract between the learner actor and a learner, LearnerOps
the one between the shared update loop and a learner: both learners define each of their methods
themselves (no capability is probed with hasattr or getattr)."""

from __future__ import annotations

from prorl_async.learners.base import Learner, LearnerOps
from prorl_async.learners.deepspeed import DeepSpeedLearner
from prorl_async.learners.torch_learner import TorchLearner
from tests.offline import assert_defines_every_method, public_methods

METHODS = {"train_step", "ledger_rows", "named_tensors", "observe_validation", "base_optimizer", "save_model",
           "save_checkpoint", "load_checkpoint"}


def test_the_protocol_lists_what_the_learner_actor_calls():
    methods = public_methods(Learner)
    assert methods == METHODS
    assert set(Learner.__annotations__) == {"device", "version"}


def test_every_learner_defines_every_method_with_the_protocols_parameters():
    assert_defines_every_method(Learner, (TorchLearner, DeepSpeedLearner), METHODS)


def test_every_learner_defines_what_the_update_loop_calls():
    methods = public_methods(LearnerOps)
    assert methods == {"reduce", "zero_grad", "backward", "finish_update", "reset_reference"}
    assert_defines_every_method(LearnerOps, (TorchLearner, DeepSpeedLearner), methods)
    for cls in (TorchLearner, DeepSpeedLearner):
        assert isinstance(vars(cls).get("refused_updates"), property), cls.__name__  # no getattr of a guard


def test_the_update_loop_reads_the_torch_learners_refusals(tiny_model):
    from prorl_async.config import load_config
    from tests.learners._batches import graded_table

    cfg = load_config(None, [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4",
                             "train.mini_batches=1", "train.micro_batch_size=16", "train.max_update_ratio=1e-12"])
    learner = TorchLearner(cfg, tiny_model)
    assert learner.compiled is False and learner.refused_updates == 0  # train.compile=auto: CUDA only
    metrics = learner.train_step(graded_table(groups=4, n=4, seed=3))
    assert learner.refused_updates == 1 == metrics["actor/refused_updates"]  # the one update moves more than 1e-12
