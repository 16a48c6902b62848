"""Which configs can run: the choices a field takes, and :func:`validate`, the start-up checks
that :func:`prorl_async.config.load_config` applies to every config it builds. Each check names the
field and what would work, as one :class:`ConfigError`; the checks of several fields together
(a GPU layout that validates field by field but would fail late, in NCCL) are here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prorl_async.algo.choices import ADVANTAGE_NAMES, IS_MODES, KL_KINDS, OVERLONG_MODES
from prorl_async.selection import MODES as KEEP_BEST_MODES, check_metric, parse_stop_at

if TYPE_CHECKING:
    from prorl_async.config import Config

#: ``train.compile`` (prorl_async.learners.compile)
COMPILE_CHOICES = ("auto", "always", "never")
#: ``train.reuse_freed_memory`` (prorl_async.learners.host_memory)
REUSE_FREED_MEMORY_CHOICES = ("auto", "always", "never")
OMP_WAIT_POLICIES = ("auto", "passive", "active", "keep")
#: ``rollout.vllm_engine_core`` (prorl_async.engines.vllm.inline_engine_core)
VLLM_ENGINE_CORES = ("auto", "inline", "process")
#: ``rollout.enforce_eager`` (prorl_async.engines.vllm.runs_eager)
ENFORCE_EAGER_CHOICES = ("auto", "always", "never")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def _one_of(value, choices, key: str) -> None:
    """``value`` must be one of ``choices`` (the names of :mod:`prorl_async.algo.choices` and the like)."""
    names = list(choices)
    _require(value in names, key, f"must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}")


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


#: Ray's own resources, which have fields of their own (``*_num_cpus`` / ``*_num_gpus``)
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _check_resources(value, key: str) -> None:
    """``value`` maps custom Ray resource names to positive amounts (``.options(resources=...)``)."""
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and k and k not in BUILTIN_RESOURCES and isinstance(v, (int, float))
        and not isinstance(v, bool) and v > 0 for k, v in value.items())
    _require(ok, key, "must map custom Ray resource names to positive amounts, e.g. {learn_node: 1} (CPUs and GPUs "
             f"have their own fields, *_num_cpus and *_num_gpus); got {value!r}")


def validate(cfg: Config) -> None:
    """Start-up checks; each names the field and what would work."""
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    _require(t.max_update_ratio >= 0, "train.max_update_ratio", f"must be >= 0 (0 = off), got {t.max_update_ratio}")
    _require(t.max_staleness >= 0, "train.max_staleness", f"must be >= 0 (0 = synchronous), got {t.max_staleness}")
    _require(t.total_steps >= 1, "train.total_steps", f"must be >= 1, got {t.total_steps}")
    _require(t.checkpoint_every_s >= 0, "train.checkpoint_every_s", f"must be >= 0 (0 = off), got {t.checkpoint_every_s}")
    _require(t.prompts_per_step >= 1, "train.prompts_per_step", f"must be >= 1, got {t.prompts_per_step}")
    _require(r.n >= 1, "rollout.n", f"must be >= 1, got {r.n}")
    _require(r.num_threads >= 0, "rollout.num_threads", f"must be >= 0 (0 = train.num_threads), got {r.num_threads}")
    _require(r.num_generators >= 1, "rollout.num_generators", f"must be >= 1, got {r.num_generators}")
    _require(r.prompts_per_request >= 1, "rollout.prompts_per_request", f"must be >= 1, got {r.prompts_per_request}")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _require(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _require(r.engine in ("hf", "vllm"), "rollout.engine", f"must be hf or vllm, got {r.engine!r}")
    _require(r.vllm_engine_core in VLLM_ENGINE_CORES, "rollout.vllm_engine_core",
             f"must be {', '.join(VLLM_ENGINE_CORES[:-1])} or {VLLM_ENGINE_CORES[-1]}, got {r.vllm_engine_core!r}")
    _one_of(r.enforce_eager, ENFORCE_EAGER_CHOICES, "rollout.enforce_eager")
    _require(r.max_model_len == 0 or r.max_model_len > r.max_new_tokens, "rollout.max_model_len",
             f"must be 0 (auto) or exceed rollout.max_new_tokens={r.max_new_tokens} (room for a prompt), "
             f"got {r.max_model_len}")
    _require(t.mini_batches >= 1 and t.prompts_per_step % t.mini_batches == 0, "train.mini_batches",
             f"must divide train.prompts_per_step={t.prompts_per_step} (got {t.mini_batches}); pick a divisor")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    mini = cfg.samples_per_step // t.mini_batches
    _require(mini % t.micro_batch_size == 0 or t.micro_batch_size >= mini, "train.micro_batch_size",
             f"must divide the mini-batch of {mini} responses (prompts_per_step*n/mini_batches) or exceed it; got {t.micro_batch_size}")
    _require(t.ppo_epochs >= 1, "train.ppo_epochs", f"must be >= 1, got {t.ppo_epochs}")
    _require(t.micro_batch_tokens >= 0, "train.micro_batch_tokens",
             f"must be >= 0 (0 = padded micro-batches of train.micro_batch_size rows), got {t.micro_batch_tokens}")
    _require(t.compile in COMPILE_CHOICES, "train.compile",
             f"must be {', '.join(COMPILE_CHOICES[:-1])} or {COMPILE_CHOICES[-1]}, got {t.compile!r}")
    _require(t.reuse_freed_memory in REUSE_FREED_MEMORY_CHOICES, "train.reuse_freed_memory",
             f"must be auto, always or never, got {t.reuse_freed_memory!r}")
    _require(t.kernel_cache_entries >= 0, "train.kernel_cache_entries",
             f"must be >= 0 (0 = oneDNN's and ideep's default 1024), got {t.kernel_cache_entries}")
    _require(t.reuse_freed_memory_gb >= 0, "train.reuse_freed_memory_gb",
             f"must be >= 0 (0 = hand freed memory back after every step), got {t.reuse_freed_memory_gb}")
    _require(t.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", f"must be >= 1, got {t.logprob_chunk_tokens}")
    _one_of(a.advantage, ADVANTAGE_NAMES, "algo.advantage")
    _one_of(a.is_mode, IS_MODES, "algo.is_mode")
    _one_of(a.kl_kind, KL_KINDS, "algo.kl_kind")
    _require(a.clip_eps_low >= 0 and a.clip_eps_high >= 0, "algo.clip_eps_low",
             "clip ranges must be >= 0")
    _require(a.is_low <= a.is_high, "algo.is_low", f"must be <= algo.is_high ({a.is_low} > {a.is_high})")
    _one_of(a.overlong, OVERLONG_MODES, "algo.overlong")
    _require(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
    _require(a.max_refill_rounds >= 0, "algo.max_refill_rounds", f"must be >= 0 (0 = unlimited), got {a.max_refill_rounds}")
    _require(cfg.model.dtype in ("auto", "float32", "bfloat16"), "model.dtype",
             f"must be auto, float32 or bfloat16, got {cfg.model.dtype!r}")
    _require(cfg.reward.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {cfg.reward.num_workers}")
    _require(cfg.reward.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {cfg.reward.timeout_s}")
    _require(0 < cfg.reward.max_invalid_frac <= 1, "reward.max_invalid_frac", "must be in (0, 1]")
    _one_of(cfg.ray.omp_wait_policy, OMP_WAIT_POLICIES, "ray.omp_wait_policy")
    _check_resources(r.generator_resources, "rollout.generator_resources")
    _check_resources(t.learner_resources, "train.learner_resources")
    _check_resources(cfg.reward.grader_resources, "reward.grader_resources")
    _require(cfg.ray.weight_sync_backend in ("auto", "gloo", "nccl", "ipc"), "ray.weight_sync_backend",
             f"must be auto, gloo, nccl or ipc, got {cfg.ray.weight_sync_backend!r}")
    for i, entry in enumerate(cfg.data.mix):
        _require(isinstance(entry, dict) and set(entry) == {"source", "weight"}, f"data.mix[{i}]",
                 f"must be a mapping {{source: ..., weight: ...}}, got {entry!r}")
        _require(isinstance(entry["weight"], (int, float)) and entry["weight"] > 0, f"data.mix[{i}].weight",
                 f"must be a positive number, got {entry['weight']!r}")
    _require(bool(cfg.data.train.strip()) or bool(cfg.data.mix), "data.train",
             "is empty and data.mix is not set: give the training prompts (a JSONL/Parquet path, builtin:..., reasoning-gym:...)")
    _require(bool(cfg.data.eval.strip()), "data.eval",
             "is empty: give held-out prompts (a JSONL/Parquet path, builtin:..., reasoning-gym:...)")
    _require(bool(cfg.data.input_key) == bool(cfg.data.label_key), "data.input_key",
             f"data.input_key ({cfg.data.input_key!r}) and data.label_key ({cfg.data.label_key!r}) go together; set both or neither")
    _require(cfg.data.domain == "" or cfg.data.domain.isidentifier(), "data.domain",
             f"must be empty or a domain name such as math or code, got {cfg.data.domain!r}")
    cur = cfg.curriculum
    _require(cur.preflight_prompts >= 1, "curriculum.preflight_prompts", f"must be >= 1, got {cur.preflight_prompts}")
    _require(0 < cur.min_signal <= 1, "curriculum.min_signal", f"must be in (0, 1], got {cur.min_signal}")
    _require(0 <= cur.probe_frac < 1, "curriculum.probe_frac", f"must be in [0, 1), got {cur.probe_frac}")
    _require(cur.window >= 1, "curriculum.window", f"must be >= 1, got {cur.window}")
    _require(cur.min_active >= 1, "curriculum.min_active", f"must be >= 1, got {cur.min_active}")
    _one_of(cur.signal_by, ("reward", "solved"), "curriculum.signal_by")
    _require(cur.enabled or not cur.pinned, "curriculum.pinned",
             f"pins pools of the curriculum ({cur.pinned!r}); set curriculum.enabled=true or leave it empty")
    _require(not cur.enabled or r.n >= 2, "curriculum.enabled",
             f"a pool's signal is the share of groups with unequal rewards: it needs rollout.n >= 2, got {r.n}")
    _require(t.eval_samples >= 1, "train.eval_samples", f"must be >= 1, got {t.eval_samples}")
    _require(t.eval_temperature >= 0, "train.eval_temperature",
             f"must be >= 0 (0 = rollout.temperature), got {t.eval_temperature}")
    _one_of(t.keep_best_mode, KEEP_BEST_MODES, "train.keep_best_mode")
    try:
        if t.keep_best:
            check_metric(t.keep_best, t.eval_samples)
    except ValueError as e:
        raise ConfigError(f"train.keep_best: {e}") from None
    try:
        parse_stop_at(t.stop_at, t.eval_samples)
    except ValueError as e:
        raise ConfigError(f"train.stop_at: {e}") from None
    _require(not t.stop_at or t.eval_interval > 0, "train.stop_at",
             f"is checked at the periodic evaluations; set train.eval_interval > 0 (got {t.eval_interval})")
    _require(t.learner in ("torch", "deepspeed"), "train.learner", f"must be torch or deepspeed, got {t.learner!r}")
    _require(t.zero_stage in (0, 1, 2, 3), "train.zero_stage", f"must be 0, 1, 2 or 3, got {t.zero_stage}")
    _require(t.num_learners == 1 or t.learner == "deepspeed", "train.num_learners",
             f"data-parallel learners (got {t.num_learners}) need train.learner=deepspeed")
    _require(t.num_learners >= 1 and t.prompts_per_step % t.num_learners == 0, "train.num_learners",
             f"must divide train.prompts_per_step={t.prompts_per_step} (got {t.num_learners}); groups are not split across learners")
    _require(r.tensor_parallel_size >= 1 and (r.tensor_parallel_size == 1 or r.engine == "vllm"), "rollout.tensor_parallel_size",
             f"must be >= 1, and > 1 only with rollout.engine=vllm; got {r.tensor_parallel_size}")
    _require(r.generator_num_gpus <= 1 or float(r.generator_num_gpus).is_integer(), "rollout.generator_num_gpus",
             f"above 1 must be a whole number (one placement-group bundle on one node), got {r.generator_num_gpus}")
    _require(r.tensor_parallel_size == 1 or r.generator_num_gpus in (0, r.tensor_parallel_size), "rollout.generator_num_gpus",
             f"must equal rollout.tensor_parallel_size={r.tensor_parallel_size} on GPU (one GPU per TP rank), got {r.generator_num_gpus}")
    _check_gpu_layout(cfg)


def _check_gpu_layout(cfg: Config) -> None:
    """GPU layouts that validate field by field but cannot run: they would fail late, in NCCL.
    Ray packs fractional GPU reservations that fit together onto one GPU (two ``num_gpus=0.5``
    actors share a device), and a whole-GPU reservation is a GPU of its own."""
    r, t, backend = cfg.rollout, cfg.train, cfg.ray.weight_sync_backend
    _require(not (t.num_learners > 1 and 0 < t.learner_num_gpus <= 0.5), "train.learner_num_gpus",
             f"{t.learner_num_gpus:g} with train.num_learners={t.num_learners}: two learner ranks fit on one GPU, "
             "where Ray places them, and their NCCL world refuses two ranks on one device; give each rank "
             "its own GPU (train.learner_num_gpus=1)")
    _require(backend != "nccl" or (t.learner_num_gpus > 0 and r.generator_num_gpus > 0), "ray.weight_sync_backend",
             f"nccl moves CUDA tensors only, but train.learner_num_gpus={t.learner_num_gpus:g} and "
             f"rollout.generator_num_gpus={r.generator_num_gpus:g} put a side on CPU; set "
             "ray.weight_sync_backend=auto (gloo on CPU) or give both GPUs")
    _require(backend != "nccl" or t.learner_num_gpus + r.generator_num_gpus > 1, "ray.weight_sync_backend",
             f"nccl with train.learner_num_gpus={t.learner_num_gpus:g} and rollout.generator_num_gpus="
             f"{r.generator_num_gpus:g}: learner and generator fit on one GPU, where Ray colocates them, and NCCL "
             "refuses two ranks on one device; set ray.weight_sync_backend=auto (ipc on a shared GPU) or ipc, "
             "or reserve whole GPUs (train.learner_num_gpus=1, rollout.generator_num_gpus=1)")
    _require(backend != "ipc" or r.tensor_parallel_size == 1 or r.generator_num_gpus == 0, "ray.weight_sync_backend",
             f"ipc with rollout.tensor_parallel_size={r.tensor_parallel_size}: ipc maps the learner's GPU memory, "
             "but a TP engine holds whole GPUs of its own (rollout.generator_num_gpus="
             f"{r.generator_num_gpus:g}), none of them the learner's; set ray.weight_sync_backend=auto or nccl, "
             "or rollout.tensor_parallel_size=1")
