"""Peak memory of each ZeRO-3 rank while the learner gathers its weights for a sync and a checkpoint.

Two DeepSpeed ranks (ZeRO-3, a gloo world, CPU) hold the model sharded. A weight sync and a
checkpoint need it whole: ``after`` is the learner as shipped (one parameter gathered at a time,
and only rank 0, which sends and saves, keeps a copy: ``DeepSpeedLearner.named_tensors``);
``before`` reproduces the previous way (every parameter gathered at once, and every rank cloning
the whole model). Each rank samples its own RSS every 2 ms during the call; the table gives the
peak above the RSS just before it, per rank, for ``named_tensors()`` (what a sync sends) and for
``save_checkpoint`` (which gathers the same way), each call in fresh processes of its own (a
checkpoint after a sync in the same process would start from what the allocator kept of the sync).

    .venv/bin/python benchmarks/bench_zero3_gather.py --model builtin:smollm2-135m-instruct

Writes benchmarks/out/bench_zero3_gather.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

from _common import ROOT, arg_parser, machine, table, write_json


class PeakRss:
    """The largest RSS of this process between ``start`` and ``stop``, sampled every 2 ms."""

    def __enter__(self):
        import psutil

        self._p, self._stop = psutil.Process(), threading.Event()
        self.base = self.peak = self._p.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._p.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._p.memory_info().rss)

    @property
    def above_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def gather_all_on_every_rank(learner):
    """The previous ``named_tensors``: all parameters gathered at once, every rank cloning them."""
    import deepspeed
    import torch

    dtype = getattr(torch, learner.cfg.model.dtype)
    with deepspeed.zero.GatheredParameters(list(learner.model.parameters()), modifier_rank=None):
        return [(n, p.detach().to(dtype).clone()) for n, p in learner.model.named_parameters()]


def rank_main(rank: int, world: int, port: int, model: str, arm: str, call: str, out: str) -> None:
    import gc

    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.deepspeed import DeepSpeedLearner

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={model}", "model.dtype=float32", "model.autocast_bf16=false",
                             "train.learner=deepspeed", "train.zero_stage=3", f"train.num_learners={world}",
                             "algo.kl_coef=0.001", "train.micro_batch_size=4"])
    learner = DeepSpeedLearner(cfg, model, device="cpu", rank=rank, world_size=world, master_port=port)
    if arm == "before":
        learner.named_tensors = lambda: gather_all_on_every_rank(learner)  # what save_checkpoint calls too
    gc.collect()
    held = 0.0
    if call == "sync":
        with PeakRss() as peak:
            named = learner.named_tensors()
            held = sum(t.numel() * t.element_size() for _, t in named) / 2**20
            del named
    else:
        with tempfile.TemporaryDirectory() as d, PeakRss() as peak:
            learner.save_checkpoint(d)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in learner.model.parameters())
    with open(os.path.join(out, f"{arm}-{call}-rank{rank}.json"), "w") as f:
        json.dump({"arm": arm, "rank": rank, f"{call}_peak_mb": peak.above_mb, f"{call}_rss_before_mb": peak.base / 2**20,
                   **({"sync_kept_mb": held} if call == "sync" else {}), "model_fp32_mb": params * 4 / 2**20}, f)


def main() -> None:
    import subprocess

    ap = arg_parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    from prorl_async.config import load_config
    from prorl_async.models import resolve_model_path

    model = resolve_model_path(load_config(None, [f"model.path={args.model}"]).model)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for arm in ("before", "after"):  # each arm and call its own processes, one after the other
            for call in ("sync", "checkpoint"):
                code = (f"import sys; sys.path[:0] = [{str(ROOT / 'benchmarks')!r}, {str(ROOT)!r}]\n"
                        "import torch.multiprocessing as mp, bench_zero3_gather as b\n"
                        "from prorl_async.weight_sync import free_port\n"
                        f"mp.spawn(b.rank_main, args=({args.world}, free_port(), {model!r}, {arm!r}, {call!r}, {out!r}), "
                        f"nprocs={args.world})\n")
                subprocess.run([sys.executable, "-c", code], check=True)
            rows += [{**json.load(open(os.path.join(out, f"{arm}-sync-rank{r}.json"))),
                      **json.load(open(os.path.join(out, f"{arm}-checkpoint-rank{r}.json")))} for r in range(args.world)]
    print(f"model {args.model}: {rows[0]['model_fp32_mb']:.0f} MB in fp32, ZeRO-3, {args.world} ranks, CPU (gloo)")
    print(table(rows, [("arm", "gather", "{}"), ("rank", "rank", "{}"), ("sync_rss_before_mb", "RSS before sync (MB)", "{:.0f}"),
                       ("sync_peak_mb", "sync: peak above (MB)", "{:.0f}"), ("sync_kept_mb", "sync: kept (MB)", "{:.0f}"),
                       ("checkpoint_rss_before_mb", "RSS before checkpoint (MB)", "{:.0f}"),
                       ("checkpoint_peak_mb", "checkpoint: peak above (MB)", "{:.0f}")]))
    print("wrote", write_json("bench_zero3_gather", {"machine": machine(), "model": args.model, "rows": rows}))


if __name__ == "__main__":
    main()
