"""In-flight weight updates (PipelineRL, Piché et al. 2025) on a real vLLM engine, shared by
the in-process test and the multiprocess subprocess (``_vllm_multiprocess_main.py``).

:func:`inflight_update` pushes weights A while idle, starts a long sampled request (``ignore_eos``,
so every response runs to ``max_new_tokens``), pushes weights B from another thread once the
first tokens are out (as the generator actor receives a broadcast while it serves a request),
and recomputes every token's logprob under A and under B with a full forward pass (the
learner's computation). :func:`check_inflight` asserts what must hold: the update landed
mid-request without an abort; every token carries a version; tokens labelled A have A's
logprobs and tokens labelled B have B's (so no KV from A was served after the switch); the
response's ``policy_version`` is its oldest version and ``policy_version_end`` its newest.
"""

from __future__ import annotations

import threading

import torch

from prorl_async.engines.base import SamplingSpec
from tests.engines._weights import WeightPusher, perturbed

PROMPTS = ["12+7=", "3*4=", "(5-2)*3=", "9+9="]
LOGPROB_TOL = 1e-4  # fp32 on CPU: engine vs learner logprobs of the same tokens under the same weights


def _recompute(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def inflight_update(engine, model_path: str, max_position: int = 64) -> dict:
    """Run the scenario; findings as plain data (JSON-able, for the subprocess)."""
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    old, new = perturbed(model_path, seed=1, scale=0.05), perturbed(model_path, seed=2, scale=0.3)
    pusher = WeightPusher(engine)
    v_old, v_new = engine.version + 1, engine.version + 2
    idle = pusher.push(old, v_old)  # no request in flight: applied at once

    first_tokens = threading.Event()
    real_step = engine.engine.step

    def step():
        outs = real_step()
        if any(c.token_ids for o in outs for c in o.outputs):
            first_tokens.set()
        return outs

    spec = SamplingSpec(n=4, temperature=1.0, ignore_eos=True,
                        max_new_tokens=max_position - max(map(len, prompts)) - 1)
    result: dict = {}
    engine.engine.step = step
    try:
        gen = threading.Thread(target=lambda: result.update(out=engine.generate(prompts, spec)))
        gen.start()
        sender = pusher.send_async(new, v_new)
        if not first_tokens.wait(300):
            raise TimeoutError("no tokens within 300 s")
        resets = engine.prefix_cache_resets
        mid = engine.receive_weights()  # from this thread, while the request runs
        sender.join(120)
        gen.join(600)
    finally:
        engine.engine.step = real_step
    samples = []
    for p, group in zip(prompts, result["out"]):
        for c in group:
            samples.append({"versions": c.token_versions, "policy_version": c.policy_version,
                            "policy_version_end": c.policy_version_end, "finish_reason": c.finish_reason,
                            "logprobs": c.logprobs, "under_old": _recompute(old, p, c.token_ids),
                            "under_new": _recompute(new, p, c.token_ids)})
    return {"v_old": v_old, "v_new": v_new, "idle": {k: idle[k] for k in ("version", "applied")},
            "mid": {k: mid[k] for k in ("version", "applied")}, "max_new_tokens": spec.max_new_tokens,
            "resets_by_update": engine.prefix_cache_resets - resets, "version": engine.version, "samples": samples}


def check_inflight(f: dict) -> dict:
    """The assertions, on :func:`inflight_update`'s findings; returns a summary to print."""
    v_old, v_new = f["v_old"], f["v_new"]
    assert f["idle"] == {"version": v_old, "applied": True}, f["idle"]
    assert f["mid"] == {"version": v_new, "applied": True}, f["mid"]
    assert f["version"] == v_new and f["resets_by_update"] == 1
    err = {v_old: 0.0, v_new: 0.0}
    gap, switches, spanning = 0.0, [], 0
    for s in f["samples"]:
        vs = s["versions"]
        assert s["finish_reason"] == "length" and len(vs) == len(s["logprobs"]) == f["max_new_tokens"], s
        assert set(vs) <= {v_old, v_new} and vs == sorted(vs), vs  # one switch, never back
        assert s["policy_version"] == min(vs) and s["policy_version_end"] == max(vs), s
        if len(set(vs)) == 2:
            spanning += 1
            switches.append(vs.index(v_new))
        for v, lp, a, b in zip(vs, s["logprobs"], s["under_old"], s["under_new"]):
            err[v] = max(err[v], abs(lp - (a if v == v_old else b)))
            if v == v_new:
                gap = max(gap, abs(lp - a))
    summary = {"spanning": spanning, "samples": len(f["samples"]), "switch_at": switches,
               "max_err_old": err[v_old], "max_err_new": err[v_new], "new_vs_old_weights_gap": gap}
    assert spanning > 0, f"the update did not land mid-request: {summary}"
    assert err[v_old] < LOGPROB_TOL and err[v_new] < LOGPROB_TOL, summary
    assert gap > 100 * LOGPROB_TOL, summary  # B really is a different policy, so the check has teeth
    return summary
