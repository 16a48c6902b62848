"""The Learner protocol is the whole contract between the learner actor and a learner: both
learners define each of its methods themselves (no capability is probed with hasattr)."""

from __future__ import annotations

import inspect

from prorl_async.learners.base import Learner
from prorl_async.learners.deepspeed import DeepSpeedLearner
from prorl_async.learners.torch_learner import TorchLearner

METHODS = {"train_step", "named_tensors", "observe_validation", "base_optimizer", "save_model",
           "save_checkpoint", "load_checkpoint"}


def test_the_protocol_lists_what_the_learner_actor_calls():
    methods = {n for n, v in vars(Learner).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == METHODS
    assert set(Learner.__annotations__) == {"device", "version"}


def test_every_learner_defines_every_method_with_the_protocols_parameters():
    for cls in (TorchLearner, DeepSpeedLearner):
        for name in METHODS:
            own = vars(cls).get(name)
            assert inspect.isfunction(own), f"{cls.__name__} does not define {name}"
            want = list(inspect.signature(getattr(Learner, name)).parameters)
            assert list(inspect.signature(own).parameters) == want, (cls.__name__, name)
