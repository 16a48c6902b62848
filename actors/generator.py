"""Generator actor: an engine, a policy version, and the receive side of weight sync.

Threaded (``max_concurrency=2``) so a weight broadcast can be received into staging memory
while a request is being generated; staged weights are applied at the next request
boundary, so every response is produced by exactly one policy version, which it carries.
"""

from __future__ import annotations

import threading
import time
import uuid

import ray
import torch

from prorl_async.data.schema import rollout_batch
from prorl_async.engines import SamplingSpec, make_engine
from prorl_async.learners.weight_sync import WeightSyncGroup, tensor_checksum


def encode_prompt(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):  # chat messages
        if getattr(tokenizer, "chat_template", None):
            return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        prompt = "\n".join(m["content"] for m in prompt)
    return tokenizer(prompt)["input_ids"]


@ray.remote(max_concurrency=2)
class GeneratorActor:
    def __init__(self, cfg, model_path: str, index: int):
        torch.set_num_threads(cfg.train.num_threads)
        self.cfg, self.index = cfg, index
        self.engine = make_engine(cfg.rollout.engine, model_path, dtype=cfg.model.dtype)
        self.tokenizer = self.engine.tokenizer
        self.version = 0          # version of the weights in use
        self._staged = None       # (version, [(name, tensor)]) received, not yet applied
        self._lock = threading.Lock()
        self._sync = None
        self._requests = 0

    def ready(self) -> int:
        return self.index

    # ------------------------------------------------------------------ weights
    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str) -> bool:
        self._sync = WeightSyncGroup(host, port, rank, world_size, backend, self.cfg.train.sync_timeout_s)
        return True

    def receive_weights(self) -> dict:
        shapes = [(n, tuple(t.shape), t.dtype) for n, t in self.engine.named_tensors()]
        t0 = time.perf_counter()
        version, tensors = self._sync.receive(shapes)
        with self._lock:
            self._staged = (version, [(n, t.clone()) for n, t in tensors])
        return {"version": version, "seconds": time.perf_counter() - t0}

    def _apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.engine.load_weights(staged[1])
            self.version = staged[0]

    def weights_checksum(self) -> tuple[int, float]:
        self._apply_staged()
        return self.version, tensor_checksum([t for _, t in self.engine.named_tensors()])

    # ------------------------------------------------------------------ generation
    def generate(self, rows: list[dict], n: int, seed: int, greedy: bool = False):
        """One request: ``n`` samples for each row -> a RecordBatch in the rollout schema."""
        self._apply_staged()
        r = self.cfg.rollout
        spec = SamplingSpec(n=n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                            seed=seed, greedy=greedy)
        prompt_ids = [encode_prompt(self.tokenizer, row["prompt"]) for row in rows]
        t0 = time.perf_counter()
        outs = self.engine.generate(prompt_ids, spec)
        dt = time.perf_counter() - t0
        request_id = uuid.uuid4().hex[:12]
        cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids",
                                "behavior_logprobs", "policy_version", "finish_reason", "gen_time_s",
                                "response_text", "request_id")}
        for row, pids, comps in zip(rows, prompt_ids, outs):
            for j, c in enumerate(comps):
                cols["sample_id"].append(f"{request_id}-{row['id']}-{j}")
                cols["prompt_id"].append(str(row["id"]))
                cols["domain"].append(row.get("domain", ""))
                cols["prompt_ids"].append(pids)
                cols["response_ids"].append(c.token_ids)
                cols["behavior_logprobs"].append(c.logprobs)
                cols["policy_version"].append(self.version)
                cols["finish_reason"].append(c.finish_reason)
                cols["gen_time_s"].append(dt / max(1, len(rows) * n))
                cols["response_text"].append(self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                cols["request_id"].append(request_id)
        self._requests += 1
        return rollout_batch(cols)
