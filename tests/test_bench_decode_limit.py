"""Generation against its compute limit (issue 28): ``benchmarks/bench_generation.py --limit``
run for real on SmolLM2-135M through the inline vLLM engine, fp32 and bf16, at a small size;
its JSON read back through ``prorl-async bench``'s summary of the ``decode_limit`` job.

The limit is ``2·N`` FLOPs per generated token over the torch.mm peak measured in the same
process: the test recomputes it from the row's own numbers and from the model's parameter count,
and checks that the engine stays below it (a row above it would mean a wrong peak or count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_generation_tok_s_is_reported_as_a_share_of_the_compute_limit_per_dtype(tmp_path, smollm2_model,
                                                                               model_cache):
    from actors.bench import jobs, sum_decode_limit
    from prorl_async.machine import cpu_has_bf16
    from prorl_async.models import load_model

    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/bench_generation.py", "--models", "smollm2", "--skip-hf", "--vllm-core",
           "inline", "--prompts", "2", "--n", "2", "--max-new-tokens", "16", "--repeats", "2",
           "--dtypes", "float32,bfloat16", "--limit", "--json-name", "limit"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540,
                       env={**os.environ, "PRORL_ASYNC_CACHE": model_cache, "PRORL_BENCH_OUT": str(out)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    payload = json.loads((out / "limit.json").read_text())
    rows = payload["rows"]
    assert [(x["engine"], x["dtype"]) for x in rows] == [("vllm", "float32"), ("vllm", "bfloat16")]

    params = sum(p.numel() for p in load_model(smollm2_model, "float32").parameters())
    timed = [x for x in rows if "tok_s" in x]
    assert rows[0] in timed  # fp32 runs on every CPU
    for x in timed:
        assert x["batch"] == 4 and 0 < x["tokens"] <= 4 * 16 and x["tok_s"] == pytest.approx(x["tokens"] / x["seconds"])
        assert x["params_m"] == pytest.approx(params / 1e6)
        peak = payload["matmul_peak_gflops"][x["dtype"]]
        assert x["peak_gflops"] == pytest.approx(peak) and peak > 0
        assert x["limit_tok_s"] == pytest.approx(peak * 1e9 / (2 * params))
        # the model's linear layers alone in torch at the decode's shapes (a yardstick for the
        # engine, not a bound: vLLM's prepacked kernels can beat torch's)
        assert x["linear_tok_s"] > 0 and x["prefill_s"] > 0
        # decode alone: the request's time less that of the same request with one new token each;
        # timings are the machine's (no order between them is asserted): where the one-token request
        # took nearly as long, the row says so instead of a rate
        if x["decode_tok_s"] is None:
            assert "not measured: the one-token request took" in x["decode_note"] and x["limit_frac"] is None
            continue
        assert x["decode_tok_s"] == pytest.approx((x["tokens"] - 4) / (x["seconds"] - x["prefill_s"]))
        assert x["limit_frac"] == pytest.approx(x["decode_tok_s"] / x["limit_tok_s"]) and x["limit_frac"] > 0
        assert x["linear_frac"] == pytest.approx(x["decode_tok_s"] / x["linear_tok_s"])
        assert f"{x['limit_frac']:.1%} of the" in r.stdout
    bf16 = rows[1]
    if cpu_has_bf16():
        assert bf16 in timed and payload["matmul_peak_gflops"]["bfloat16"] > 0
    else:  # without AMX / AVX-512 bf16 the row says why it did not run, and nothing was timed
        assert bf16 not in timed and "no AMX / AVX-512 bf16" in bf16["skipped"] and bf16["limit_frac"] is None

    # what `prorl-async bench` prints from this JSON, and that its job runs this very mode
    table = sum_decode_limit(payload)
    assert [t["ratio"] for t in table] == [f"vLLM decode tok/s at batch 4 / compute limit (smollm2, {d})"
                                           for d in ("float32", "bfloat16")]
    assert table[0]["value"] == rows[0]["limit_frac"]
    assert ("GFLOP/s torch.mm peak" if rows[0]["decode_tok_s"] else "not measured") in table[0]["detail"]
    assert table[1]["value"] == rows[1]["limit_frac"]  # None without bf16 (or a decode too noisy to time)
    job = jobs(quick=True, cache_dir="")["decode_limit"]
    assert job.script == "bench_generation.py" and job.json_name == "bench_generation_limit"
    assert {"--limit", "float32,bfloat16", "inline"} <= set(job.quick) and job.quick == job.full
