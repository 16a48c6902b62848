"""Config: YAML + dotted overrides, and one clear message per mistake."""

import pytest

from actors.cli import main
from prorl_async.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n: 4\nalgo:\n  clip_eps_high: 0.3\n")
    cfg = load_config(str(p), ["algo.clip_eps_high=0.28", "rollout.n=8", "train.lr=5e-4"])
    assert cfg.rollout.n == 8 and cfg.algo.clip_eps_high == 0.28 and cfg.train.lr == 5e-4
    assert cfg.algo.clip_eps_low == 0.2  # untouched default
    with pytest.raises(Exception):
        cfg.rollout.n = 3  # frozen


@pytest.mark.parametrize("override, needle", [
    ("rollout.nn=3", "unknown config key 'rollout.nn'"),
    ("bogus.x=1", "unknown config key 'bogus'"),
    ("rollout.n=abc", "rollout.n: expected an integer"),
    ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling: expected true/false"),
    ("train.max_staleness=-1", "train.max_staleness: must be >= 0"),
    ("train.checkpoint_every_s=-5", "train.checkpoint_every_s: must be >= 0"),
    ("train.mini_batches=3", "train.mini_batches: must divide train.prompts_per_step=64"),
    ("train.micro_batch_size=100", "train.micro_batch_size: must divide the mini-batch of 128"),
    ("algo.is_mode=foo", "algo.is_mode: must be tis, icepop or none"),
    ("rollout.vllm_engine_core=thread", "rollout.vllm_engine_core: must be auto, inline or process"),
    ("rollout", "not of the form section.field=value"),
    ("data.eval=", "data.eval: is empty: give held-out prompts"),
    ("data.train=", "data.train: is empty and data.mix is not set"),
    ("curriculum.pinned=rg:gcd@hard", "curriculum.pinned: pins pools of the curriculum (['rg:gcd@hard']); set curriculum.enabled=true"),
])
def test_config_errors_name_the_field(override, needle, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert main(["train", override]) == 2  # the CLI prints one line and exits 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml", [])


def test_auto_resolves_against_the_machine_facts_it_is_given():
    from prorl_async.machine import MachineFacts

    overrides = ["model.dtype=auto", "train.num_threads=2", "rollout.num_threads=2", "ray.omp_wait_policy=auto"]
    gpu_like = load_config(None, overrides, machine=MachineFacts(cpus=8, omp_wait_policy_set=False, bf16=True))
    assert gpu_like.model.dtype == "bfloat16" and gpu_like.ray.omp_wait_policy == "keep"  # 4 threads on 8 CPUs
    small = load_config(None, overrides, machine=MachineFacts(cpus=2, omp_wait_policy_set=False, bf16=False))
    assert small.model.dtype == "float32" and small.ray.omp_wait_policy == "passive"  # 4 threads on 2 CPUs
    user_set = load_config(None, overrides, machine=MachineFacts(cpus=2, omp_wait_policy_set=True, bf16=False))
    assert user_set.ray.omp_wait_policy == "keep"  # $OMP_WAIT_POLICY wins
    with pytest.raises(ValueError, match="model.dtype=auto: the machine facts lack bf16"):
        load_config(None, overrides, machine=MachineFacts(cpus=8, omp_wait_policy_set=False))


def test_config_is_a_leaf():
    """config.py and its rules (config_rules.py) import nothing of the engines, models, learners,
    data or rewards, at the top or in a function."""
    import ast
    import inspect

    import prorl_async.config as config
    import prorl_async.config_rules as config_rules

    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(config) + inspect.getsource(config_rules))):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert {"prorl_async.machine", "prorl_async.algo.choices"} <= imported  # the walk sees both files' imports
    heavy = ("engines", "models", "learners", "data", "rewards")
    assert not [m for m in imported if m.split(".")[:2] in [["prorl_async", h] for h in heavy]], imported


@pytest.mark.parametrize("value", ["{CPU: 1}", "{learn_node: 0}", "{learn_node: -1}", "{learn_node: true}",
                                   "{learn_node: lots}", "[learn_node]", "learn_node"])
@pytest.mark.parametrize("key", ["rollout.generator_resources", "train.learner_resources", "reward.grader_resources"])
def test_custom_resources_must_map_names_to_positive_amounts(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert str(e.value).startswith(f"{key}: ") and str(e.value).count("\n") == 0, str(e.value)


def test_custom_resources_pin_actors_from_yaml_or_a_dotted_key():
    cfg = load_config(None, ["train.learner_resources={learn_node: 1}", "rollout.generator_resources.gen_node=0.5",
                             'reward.grader_resources={"node:__internal_head__": 0.01}'])
    assert cfg.train.learner_resources == {"learn_node": 1} and cfg.rollout.generator_resources == {"gen_node": 0.5}
    assert cfg.reward.grader_resources == {"node:__internal_head__": 0.01}
    assert load_config(None, []).train.learner_resources == {}  # none: actors go wherever Ray puts them


# GPU layouts that pass field by field but cannot run (issue 26, item 7): one error each, naming
# every field involved, and the neighbouring layout that can run still passes.
NCCL = "ray.weight_sync_backend=nccl"


@pytest.mark.parametrize("overrides, fields", [
    (["train.learner=deepspeed", "train.num_learners=2", "train.learner_num_gpus=0.5"],
     ["train.learner_num_gpus", "train.num_learners", "train.learner_num_gpus=1"]),
    ([NCCL, "train.learner_num_gpus=0.5", "rollout.generator_num_gpus=0.5"],
     ["ray.weight_sync_backend", "train.learner_num_gpus=0.5", "rollout.generator_num_gpus=0.5",
      "ray.weight_sync_backend=auto"]),
    ([NCCL, "train.learner_num_gpus=0", "rollout.generator_num_gpus=1"],
     ["ray.weight_sync_backend", "train.learner_num_gpus=0", "rollout.generator_num_gpus=1"]),
    (["ray.weight_sync_backend=ipc", "rollout.engine=vllm", "rollout.tensor_parallel_size=2",
      "rollout.generator_num_gpus=2", "train.learner_num_gpus=1"],
     ["ray.weight_sync_backend", "rollout.tensor_parallel_size=2", "rollout.generator_num_gpus=2",
      "rollout.tensor_parallel_size=1"]),
], ids=["learner-ranks-share-a-gpu", "nccl-colocated", "nccl-on-cpu", "ipc-tensor-parallel"])
def test_impossible_gpu_layouts_are_one_error_naming_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).count("\n") == 0
    missing = [f for f in fields if f not in str(e.value)]
    assert not missing, (missing, str(e.value))


@pytest.mark.parametrize("overrides", [
    ["train.learner=deepspeed", "train.num_learners=2", "train.learner_num_gpus=1"],  # a GPU per rank
    ["train.learner=deepspeed", "train.num_learners=2", "train.learner_num_gpus=0.6",  # no two ranks fit one GPU
     "rollout.generator_num_gpus=0.4"],
    ["train.learner=deepspeed", "train.num_learners=2", "train.learner_num_gpus=0"],  # CPU ranks (gloo)
    [NCCL, "train.learner_num_gpus=1", "rollout.generator_num_gpus=0.5"],  # the learner's GPU is its own
    [NCCL, "train.learner_num_gpus=0.6", "rollout.generator_num_gpus=0.6"],  # cannot share: separate GPUs
    ["train.learner_num_gpus=0.5", "rollout.generator_num_gpus=0.5"],  # colocated with auto (-> ipc)
    ["ray.weight_sync_backend=ipc", "train.learner_num_gpus=0.5", "rollout.generator_num_gpus=0.5"],
    ["ray.weight_sync_backend=ipc", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"],  # CPU: shared memory
    [NCCL, "rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.generator_num_gpus=2",
     "train.learner_num_gpus=1"],
], ids=["gpu-per-rank", "ranks-on-separate-gpus", "cpu-ranks", "nccl-learner-gpu", "nccl-separate-fractions",
        "auto-colocated", "ipc-colocated", "ipc-tp-on-cpu", "nccl-tensor-parallel"])
def test_the_layouts_beside_the_impossible_ones_still_validate(overrides):
    load_config(None, overrides)


def test_a_config_file_can_start_from_a_base_file(tmp_path):
    """``base: OTHER.yaml`` (relative to the file): the base's settings, with this file's over them
    key by key; a chain of bases; one error for a missing base or a cycle."""
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "root.yaml").write_text("algo:\n  kl_coef: 0.01\n  clip_eps_high: 0.27\ntrain:\n  lr: 0.001\n  total_steps: 7\n")
    (tmp_path / "parts" / "mid.yaml").write_text("base: root.yaml\ntrain:\n  total_steps: 9\n")
    (tmp_path / "top.yaml").write_text("base: parts/mid.yaml\nalgo:\n  clip_eps_high: 0.4\n")
    cfg = load_config(str(tmp_path / "top.yaml"), ["train.lr=0.002"])
    assert (cfg.algo.clip_eps_high, cfg.algo.kl_coef, cfg.train.total_steps, cfg.train.lr) == (0.4, 0.01, 9, 0.002)
    assert load_config(str(tmp_path / "parts" / "root.yaml")).algo.clip_eps_high == 0.27  # the base itself unchanged
    (tmp_path / "gone.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml' \(the base of .*gone.yaml'\) does not exist"):
        load_config(str(tmp_path / "gone.yaml"))
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"is a cycle \(a.yaml -> b.yaml -> a.yaml\)"):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "num.yaml").write_text("base: 3\n")
    with pytest.raises(ConfigError, match="base must name another config file"):
        load_config(str(tmp_path / "num.yaml"))
