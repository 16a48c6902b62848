"""SIMULATION (not a measurement): learner utilisation and staleness at 8-256 generators.

A discrete-event simulation on a simulated clock (no sleeps) of the driver's schedule with
the real pieces and a latency model in place of GPUs:

* **real**: the dispatch rule (:func:`prorl_async.staleness.plan_requests`, which the driver
  calls, built on :func:`admission_budget`), the driver's bookkeeping of ``consumed`` /
  ``live`` / ``buffered`` groups (mirrored line by line from ``actors/driver.py``: a request
  counts as live from dispatch, dropped groups leave ``live`` when the buffer reports them,
  taken groups move to ``consumed``), and the replay buffer itself
  (:class:`prorl_async.buffer.ReplayBuffer`: grouping, dynamic sampling, oldest-first
  ``take`` with the staleness re-check), fed with real Arrow batches in the rollout schema;
* **modelled**: generator request time, learner step time and weight-sync time.

Latency model (every figure is a parameter; defaults for a ~1.5B-parameter policy, the ProRL
v2 scale, on H100s):

* response length ~ lognormal(median ``--len-median`` = 1500 tokens, sigma 1.0), clipped to
  ``--max-len`` = 8192 (a clipped response is ``finish_reason=length``); long-tailed like
  reasoning traces (ProRL, Liu et al. 2025, arXiv 2505.24864, trains at 8K-16K context);
* a generator is one vLLM engine that decodes all ``prompts_per_request * n`` sequences of a
  request together; a request ends with its longest response: ``prefill + max_len_in_request *
  tpot``. ``--tpot-ms`` = 15 ms per decode step: the order of the time-per-output-token vLLM
  reports for an 8B model on one H100 under load (vLLM blog, "vLLM v0.6.0: 2.7x Throughput
  Improvement and 5x Latency Reduction", 2024-09-05, https://blog.vllm.ai/2024/09/05/perf-update.html);
  a 1.5B model decodes faster per step, so this is conservative. The engine serves one request
  at a time (as the project's generator actor does), so it idles on a request's tail;
* learner: ``--learner-gpus`` (8) GPUs at ``--learner-mfu`` (0.4) of ``--gpu-peak-tflops`` (989,
  H100 SXM dense bf16) training ``6 * params * tokens`` FLOPs (prompt + response tokens);
* weight sync: one broadcast of the bf16 weights at ``--bcast-gbps`` (40 GB/s: NCCL-tests
  bus bandwidth across nodes on 400 Gb/s InfiniBand is ~40-50 GB/s per GPU, and 460-480 GB/s
  inside an 8xH100 NVSwitch node, per NVIDIA/nccl-tests reference runs as summarised in
  https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests) plus ``--reload-s``
  (0.5 s, vLLM in-place weight reload, an assumption) when a generator applies new weights at
  its next request. The learner is busy during the broadcast (the driver queues the next
  ``train_step`` behind ``broadcast_weights`` on the same actor).

Rewards: each prompt has a success rate p ~ Uniform(0, 1) and each sample is correct with
probability p, so dynamic sampling drops the all-equal groups (about 2/(n+1) of them).

Reports, per number of generators and ``max_staleness`` in {0, 1, 2, 4}: learner utilisation
(busy / wall, busy = training + broadcast), generator utilisation, staleness of trained
samples (mean / max), samples/s and simulated wall time of ``--steps`` learner steps.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from pathlib import Path

from _common import OUT_DIR, arg_parser, machine, plt, table, write_json


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--generators", default="8,16,32,64,128,256", help="numbers of generators to simulate")
    p.add_argument("--modes", default="0,1,2,4", help="max_staleness values")
    p.add_argument("--steps", type=int, default=20, help="learner steps per simulation")
    p.add_argument("--prompts-per-step", type=int, default=256, help="train.prompts_per_step")
    p.add_argument("--n", type=int, default=16, help="samples per prompt (group size)")
    p.add_argument("--prompts-per-request", type=int, default=8, help="rollout.prompts_per_request")
    p.add_argument("--prompt-len", type=int, default=300, help="prompt tokens")
    p.add_argument("--len-median", type=float, default=1500.0, help="median response length (tokens)")
    p.add_argument("--len-sigma", type=float, default=1.0, help="lognormal sigma of the response length")
    p.add_argument("--max-len", type=int, default=8192, help="response length cap (rollout.max_new_tokens)")
    p.add_argument("--tpot-ms", type=float, default=15.0, help="decode time per step per engine (ms)")
    p.add_argument("--prefill-s", type=float, default=0.2, help="prefill time per request (s)")
    p.add_argument("--params-b", type=float, default=1.5, help="policy parameters (billions)")
    p.add_argument("--learner-gpus", type=int, default=8, help="learner GPUs")
    p.add_argument("--learner-mfu", type=float, default=0.4, help="learner model-FLOPs utilisation")
    p.add_argument("--gpu-peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (TFLOP/s)")
    p.add_argument("--bcast-gbps", type=float, default=40.0, help="weight broadcast bus bandwidth (GB/s)")
    p.add_argument("--reload-s", type=float, default=0.5, help="generator weight reload time (s)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (same draws for every mode)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


@dataclass
class Result:
    generators: int
    max_staleness: int
    wall_s: float
    learner_util: float
    generator_util: float
    staleness_mean: float
    staleness_max: float
    samples_s: float
    requests: int
    groups_dropped: int
    stale_dropped: int


def simulate(num_gen: int, max_staleness: int, a, rng_seed: int) -> Result:
    import numpy as np

    from prorl_async.buffer import ReplayBuffer
    from prorl_async.data.schema import rollout_batch
    from prorl_async.staleness import plan_requests

    rng = np.random.default_rng(rng_seed)
    G, n, ppr = a.prompts_per_step, a.n, a.prompts_per_request
    flops_per_token = 6 * a.params_b * 1e9
    learner_tok_s = a.learner_gpus * a.learner_mfu * a.gpu_peak_tflops * 1e12 / flops_per_token
    sync_s = 2 * a.params_b * 1e9 / (a.bcast_gbps * 1e9)  # bf16 weights

    buffer = ReplayBuffer(max_staleness, dynamic_sampling=True)
    lengths: dict[str, int] = {}  # sample_id -> response tokens (the Arrow rows carry no token ids here)
    # driver state (actors/loop_state.py LoopState)
    version = consumed = live = buffered = requests = 0
    gen_version, gen_busy, gen_weights = [0] * num_gen, [False] * num_gen, [0] * num_gen
    gen_intervals: list[tuple[float, float]] = []  # (start, end) of every request, for utilisation
    training = False
    learner_free_at = 0.0
    learner_busy_s = 0.0
    stale_sum = stale_n = 0.0
    stale_max = 0
    stale_dropped = 0
    trained_samples = 0
    events: list = []  # (time, seq, kind, payload)
    seq = 0
    now = 0.0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def make_request(i: int, k: int, policy: int):
        nonlocal requests
        requests += 1
        p = rng.random(k)
        rows = k * n
        L = np.minimum(np.round(rng.lognormal(math.log(a.len_median), a.len_sigma, rows)), a.max_len).astype(int)
        L = np.maximum(L, 1)
        correct = (rng.random(rows) < np.repeat(p, n)).astype(np.float32)
        ids = [f"q{requests}-{j}" for j in range(rows)]
        for sid, ln in zip(ids, L):
            lengths[sid] = int(ln)
        batch = rollout_batch({
            "sample_id": ids, "prompt_id": [f"q{requests}-p{j // n}" for j in range(rows)],
            "domain": ["math"] * rows, "prompt_ids": [[]] * rows, "response_ids": [[]] * rows,
            "behavior_logprobs": [[]] * rows, "policy_version": [policy] * rows,
            "finish_reason": ["length" if ln >= a.max_len else "stop" for ln in L],
            "raw_reward": correct.tolist(), "reward_valid": [True] * rows,
            "gen_time_s": [0.0] * rows, "response_text": [""] * rows, "request_id": [f"req{requests}"] * rows})
        duration = a.prefill_s + int(L.max()) * a.tpot_ms / 1000.0
        return batch, duration

    def dispatch_generation():
        nonlocal live
        if version >= a.steps:
            return
        for i, k in plan_requests(gen_version, gen_busy, max_staleness, G, ppr, consumed, live):
            reload = a.reload_s if gen_weights[i] != gen_version[i] else 0.0  # apply staged weights first
            gen_weights[i] = gen_version[i]
            batch, duration = make_request(i, k, gen_weights[i])
            live += k
            gen_busy[i] = True
            gen_intervals.append((now, now + reload + duration))
            push(now + reload + duration, "generated", (i, batch))

    def dispatch_training():
        nonlocal buffered, live, consumed, training, stale_sum, stale_n, stale_max
        nonlocal stale_dropped, trained_samples
        if training or buffered < G or version + training >= a.steps:
            return
        info = buffer.take(version, G)
        table = info.table
        buffered -= info.taken + info.stale_dropped
        live -= info.taken + info.stale_dropped
        stale_dropped += info.stale_dropped
        if table is None:
            return
        consumed += info.taken
        pol = table.column("policy_version").to_numpy()
        st = version - pol
        stale_sum += float(st.sum())
        stale_n += len(st)
        stale_max = max(stale_max, int(st.max()))
        tokens = sum(lengths.pop(s) for s in table.column("sample_id").to_pylist()) + table.num_rows * a.prompt_len
        trained_samples += table.num_rows
        start = max(now, learner_free_at)
        dt = tokens / learner_tok_s
        training = True
        push(start + dt, "trained", dt)

    while version < a.steps:
        dispatch_generation()
        dispatch_training()
        if not events:
            raise RuntimeError("simulation stalled: nothing in flight and no step possible")
        now, _, kind, payload = heapq.heappop(events)
        if kind == "generated":  # _on_generated + _on_buffered (grading time ~0 at this scale)
            i, batch = payload
            gen_busy[i] = False
            info = buffer.put(batch)
            live -= info.dropped
            buffered += info.kept
        elif kind == "trained":  # _on_trained: version up, broadcast occupies the learner
            training = False
            version += 1
            learner_busy_s += payload + sync_s
            learner_free_at = now + sync_s
            push(now + sync_s, "synced", version)
        elif kind == "synced":  # _on_sync_received on every generator
            gen_version[:] = [max(v, payload) for v in gen_version]
    wall = now
    c = buffer.counters
    gen_busy_total = sum(min(end, wall) - start for start, end in gen_intervals)  # in-flight requests count up to wall
    return Result(num_gen, max_staleness, wall, min(1.0, learner_busy_s / wall),
                  gen_busy_total / (wall * num_gen), stale_sum / max(stale_n, 1), stale_max,
                  trained_samples / wall, requests,
                  int(c["groups_dropped_all_correct"] + c["groups_dropped_all_wrong"]), stale_dropped)


def main(argv=None) -> dict:
    args = parse_args(argv)
    gens = [int(x) for x in args.generators.split(",")]
    modes = [int(x) for x in args.modes.split(",")]
    t0 = time.perf_counter()
    results = []
    for g in gens:
        for s in modes:
            r = simulate(g, s, args, args.seed)
            results.append(r.__dict__)
    by = {(r["generators"], r["max_staleness"]): r for r in results}
    for r in results:
        base = by.get((r["generators"], 0))
        r["speedup_vs_sync"] = r["samples_s"] / base["samples_s"] if base else None
    print("SIMULATION - latency model, not a measurement (see the module docstring for every assumption)\n")
    print(table(results, [("generators", "generators", "{:d}"), ("max_staleness", "max_stale", "{:d}"),
                          ("wall_s", "sim wall s", "{:.0f}"), ("learner_util", "learner util", "{:.1%}"),
                          ("generator_util", "gen util", "{:.1%}"), ("staleness_mean", "stale mean", "{:.2f}"),
                          ("staleness_max", "stale max", "{:.0f}"), ("samples_s", "samples/s", "{:.0f}"),
                          ("speedup_vs_sync", "vs sync", "{:.2f}x"), ("requests", "requests", "{:d}"),
                          ("stale_dropped", "stale dropped", "{:d}")]))
    elapsed = time.perf_counter() - t0
    print(f"\n({len(results)} simulations in {elapsed:.1f}s of real time on {machine()['cpu']})")
    payload = {"benchmark": "scale_sim", "SIMULATION": True, "machine": machine(),
               "args": {**vars(args), "out": str(args.out)}, "results": results}
    path = write_json("bench_scale_sim", payload, args.out)
    plot(results, gens, modes, args.out / "bench_scale_sim.png")
    print(f"wrote {path} and {args.out / 'bench_scale_sim.png'}")
    return payload


def plot(results, gens, modes, path):
    pyplot = plt()
    fig, ax = pyplot.subplots(1, 3, figsize=(16, 4.5))
    for j, s in enumerate(modes):
        rs = [r for r in results if r["max_staleness"] == s]
        kw = dict(marker="o", color=f"C{j}", label=f"max_staleness={s}")
        ax[0].plot([r["generators"] for r in rs], [r["learner_util"] for r in rs], **kw)
        ax[1].plot([r["generators"] for r in rs], [r["samples_s"] for r in rs], **kw)
        ax[2].plot([r["generators"] for r in rs], [r["staleness_mean"] for r in rs], **kw)
        ax[2].plot([r["generators"] for r in rs], [r["staleness_max"] for r in rs], ls=":", color=f"C{j}")
    for a_ in ax:
        a_.set_xscale("log", base=2)
        a_.set_xlabel("generators")
        a_.legend(fontsize=8)
    ax[0].set(ylabel="learner utilisation", title="learner busy / wall", ylim=(0, 1.05))
    ax[1].set(ylabel="trained samples / simulated s", title="throughput")
    ax[2].set(ylabel="versions", title="trained staleness (solid mean, dotted max)")
    fig.suptitle("SIMULATION: latency model (vLLM TPOT, NCCL bandwidth), real admission control and replay buffer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
