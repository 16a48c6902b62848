"""The names a config may choose among, without torch: the processes that only read a config or
count groups (the grader, the replay buffer, the driver's checks) validate against these and never
import the math. Each tuple is the key set of the module that implements it (a test holds them
equal): :data:`~prorl_async.algo.advantages.ADVANTAGE_ESTIMATORS`, the importance-sampling modes and
KL estimators of :mod:`~prorl_async.algo.losses`, the overlong modes of
:mod:`~prorl_async.algo.shaping`."""

ADVANTAGE_NAMES = ("reinforce_pp_baseline", "grpo", "rloo")
IS_MODES = ("tis", "icepop", "none")
KL_KINDS = ("k1", "k2", "k3")
OVERLONG_MODES = ("none", "filter", "soft", "zero")
