"""Generator actor: an engine, a policy version, and the receive side of weight sync.

Threaded (``max_concurrency=3``) so a weight broadcast can be received into staging memory
while a request is being generated. The engine owns the receive side of weight sync
(:mod:`prorl_async.engines`): staged weights are applied at the next request boundary, so
every response is produced by one policy version, which it carries. With vLLM's optional
in-flight updates a response can span versions: it records the oldest (``policy_version``,
by which the buffer and the learner account staleness) and the newest (``policy_version_end``).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Optional

import ray
import torch

from prorl_async.data.schema import rollout_batch
from prorl_async.engines import Engine, SamplingSpec, make_engine
from prorl_async.engines.prompts import encode_prompt
from prorl_async.engines.vllm import engine_options
from prorl_async.metrics import rss_mb
from prorl_async.weight_sync import bind_gloo

from actors.placement import ActorPlace, here, local_ip


@ray.remote(max_concurrency=3)  # a request, a weight receive, and a group re-formation
class GeneratorActor:
    def __init__(self, cfg, model_path: str, index: int, longest_prompt: int = 0):
        """``longest_prompt``: the run's longest prompt in tokens (0 = unknown), for vLLM's
        ``max_model_len`` (:func:`prorl_async.engines.vllm.engine_options`)."""
        torch.set_num_threads(cfg.rollout.num_threads or cfg.train.num_threads)
        bind_gloo(local_ip())  # its weight-sync group listens on this node's IP
        self.cfg, self.index = cfg, index
        r = cfg.rollout
        on_gpu = r.generator_num_gpus > 0
        extra = engine_options(r, on_gpu, longest_prompt) if r.engine == "vllm" else {}
        self.engine: Engine = make_engine(r.engine, model_path, dtype=cfg.model.dtype, seed=r.seed * 7919 + index,
                                          tensor_parallel_size=r.tensor_parallel_size,
                                          inflight_weight_updates=r.inflight_weight_updates,
                                          gpu_memory_utilization=r.gpu_memory_utilization,
                                          device="cuda" if on_gpu else "cpu", **extra)  # the GPU Ray reserved
        self.tokenizer = self.engine.tokenizer
        self._requests = 0

    @property
    def version(self) -> int:
        return self.engine.version

    def ready(self) -> int:
        return self.index

    def where(self) -> ActorPlace:
        return here(f"generator-{self.index}")

    def stats(self) -> dict:
        """Requests served by this incarnation of the actor, and its weights version."""
        return {"requests": self._requests, "version": self.version, "pid": os.getpid()}

    # ------------------------------------------------------------------ weights (the engine does the work)
    def weight_sync_ranks(self) -> int:
        return self.engine.weight_sync_ranks

    def device_key(self) -> str:
        """The GPU (UUID) or host this generator's engine runs on."""
        from prorl_async.weight_ipc import device_key

        return device_key("cuda" if self.cfg.rollout.generator_num_gpus > 0 else "cpu")

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str) -> str:
        """Join as ``rank``; returns the dtype the engine announces (the ipc sender casts to it)."""
        return self.engine.init_weight_sync(host, port, rank, world_size, backend, self.cfg.train.sync_timeout_s)

    def receive_weights(self, sent: Optional[dict] = None) -> dict:
        """One update. ``sent``: the learner's ``broadcast_weights`` result (ipc: its handles)."""
        got = self.engine.receive_weights(sent["weights"]) if sent is not None else self.engine.receive_weights()
        return {**got, "rss_mb": rss_mb()}

    def weights_checksum(self) -> tuple[int, int]:
        return self.engine.weights_checksum()

    def abort(self) -> None:
        self.engine.abort()

    # ------------------------------------------------------------------ generation
    def generate(self, rows: list[dict], n: int, seed: int, greedy: bool = False, temperature: float = 0.0):
        """One request: ``n`` samples for each row -> a RecordBatch in the rollout schema; at
        ``temperature`` (an evaluation's), else ``rollout.temperature``."""
        r = self.cfg.rollout
        spec = SamplingSpec(n=n, temperature=temperature or r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                            seed=seed, greedy=greedy)
        prompt_ids = [encode_prompt(self.tokenizer, row["prompt"], row.get("id", "?")) for row in rows]
        t0 = time.perf_counter()
        outs = self.engine.generate(prompt_ids, spec)
        dt = time.perf_counter() - t0
        request_id = uuid.uuid4().hex[:12]
        cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids",
                                "behavior_logprobs", "policy_version", "policy_version_end", "finish_reason",
                                "gen_time_s", "response_text", "request_id")}
        for k, (row, pids, comps) in enumerate(zip(rows, prompt_ids, outs)):
            for j, c in enumerate(comps):  # unique even if a prompt repeats within a request
                cols["sample_id"].append(f"{request_id}-{k}-{row['id']}-{j}")
                cols["prompt_id"].append(str(row["id"]))
                cols["domain"].append(row.get("domain", ""))
                cols["prompt_ids"].append(pids)
                cols["response_ids"].append(c.token_ids)
                cols["behavior_logprobs"].append(c.logprobs)
                cols["policy_version"].append(c.policy_version)  # the oldest weights in the response
                cols["policy_version_end"].append(c.policy_version_end)
                cols["finish_reason"].append(c.finish_reason)
                cols["gen_time_s"].append(dt / max(1, len(rows) * n))
                cols["response_text"].append(self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                cols["request_id"].append(request_id)
        self._requests += 1
        return rollout_batch(cols)
