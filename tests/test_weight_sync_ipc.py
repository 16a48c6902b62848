"""Same-device weight sync (``ray.weight_sync_backend=ipc``): handles to the learner's snapshot
instead of a collective. On CPU the handles name shared-memory files (the same
``reduce_tensor`` mechanism that gives CUDA IPC handles on a GPU), so the real path runs here:
real Ray actors, a real learner and engine, the real CLI. The one-GPU colocated runs are at the
end, marked ``gpu``."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from prorl_async.weight_ipc import IpcWeightReceiver, IpcWeightSender
from prorl_async.weight_sync import WeightSyncError, tensor_checksum
from tests.conftest import cli
from tests.learners._batches import graded_table

SMALL = ["train.prompts_per_step=4", "rollout.n=4", "train.micro_batch_size=16", "train.mini_batches=1",
         "train.lr=1e-2", "model.autocast_bf16=false", "rollout.generator_num_cpus=0.5",
         "train.learner_num_cpus=0.5", "ray.weight_sync_backend=ipc"]


def _named(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(600, 500, generator=g)),  # a bucket of its own (>= 1 MiB)
            ("norm.weight", torch.randn(7, generator=g)),
            ("proj.weight", torch.randn(5, 3, generator=g).t()),  # not contiguous: packed
            ("step", torch.arange(4, dtype=torch.int64))]


def _receive_in_child(payload, rank, q):
    try:
        version, named = IpcWeightReceiver(rank).receive(payload)
        q.put(("ok", version, [(n, t.numpy().copy()) for n, t in named]))  # by value, not by a handle
    except Exception as e:
        q.put(("error", f"{type(e).__name__}: {e}", None))


def _in_child(payload, rank: int = 1):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receive_in_child, args=(payload, rank, q))
    p.start()
    try:
        kind, version, got = q.get(timeout=120)
        return kind, version, [(n, torch.from_numpy(a)) for n, a in got or []]
    finally:
        p.join(timeout=30)


def test_handles_map_the_snapshot_bit_exact_in_another_process():
    named = _named()
    sender = IpcWeightSender(2, verify="full")
    payload, metrics = sender.send(named, 3)
    assert sender.held_versions == [3]
    # handles, not bytes: the payload is a small fraction of the 1.2 MB it names
    assert len(pickle.dumps(payload)) < 0.05 * sum(t.numel() * t.element_size() for _, t in named)
    assert metrics["perf/sync_gb"] > 0 and metrics["perf/sync_s"] >= 0
    for rank in (1, 2):  # each receiver maps its own handles
        kind, version, got = _in_child(payload, rank)
        assert kind == "ok", version
        assert version == 3 and [n for n, _ in got] == [n for n, _ in named]
        for (_, a), (_, b) in zip(named, got):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert sender.release() == [3] and sender.held_versions == []


def test_snapshot_is_a_copy_the_optimizer_cannot_touch():
    named = _named()
    sender = IpcWeightSender(1)
    payload, _ = sender.send(named, 1)
    before = named[0][1].clone()
    named[0][1].add_(1.0)  # an optimizer step after the send, before the receiver maps the snapshot
    kind, _, got = _in_child(payload)
    assert kind == "ok" and torch.equal(got[0][1], before) and not torch.equal(got[0][1], named[0][1])


def test_wire_dtype_casts_floating_tensors_only():
    named = _named()
    sender = IpcWeightSender(1, wire_dtype="bfloat16")
    payload, metrics = sender.send(named, 2)
    version, got = IpcWeightReceiver(1).receive(payload)  # same process: the shared-memory path all the same
    assert [t.dtype for _, t in got] == [torch.bfloat16] * 3 + [torch.int64]
    assert torch.equal(got[0][1], named[0][1].to(torch.bfloat16)) and torch.equal(got[3][1], named[3][1])


def test_wrong_model_wrong_rank_and_a_tampered_checksum_are_refused():
    named = _named()
    sender = IpcWeightSender(1)
    payload, _ = sender.send(named, 5)
    expected = [(n, tuple(t.shape), t.dtype) for n, t in named]
    with pytest.raises(WeightSyncError, match="models differ"):
        IpcWeightReceiver(1).receive(payload, expected[:-1] + [("other", (4,), torch.int64)])
    with pytest.raises(WeightSyncError, match="receiver rank 2 has no handles"):
        IpcWeightReceiver(2).receive(payload)
    bad = {**payload, "checksums": [c + 1 for c in payload["checksums"]]}  # the smallest possible difference
    with pytest.raises(WeightSyncError, match="checksum mismatch.*version 5 discarded"):
        IpcWeightReceiver(1).receive(bad, expected)
    with pytest.raises(WeightSyncError, match="not on this host"):
        IpcWeightReceiver(1).receive({**payload, "device": "host:elsewhere"}, expected)
    version, got = IpcWeightReceiver(1).receive(payload, expected)  # the good payload still works
    assert version == 5 and tensor_checksum([t for _, t in got]) == tensor_checksum([t for _, t in named])


def test_one_flipped_low_bit_in_a_snapshot_is_refused():
    """The lowest bit of the first word of a bucket moves its checksum by 1 (of about 2^31): the
    receiver compares exactly, so the update is refused."""
    named = _named()
    sender = IpcWeightSender(1, verify="full")
    payload, _ = sender.send(named, 7)
    flat = sender._held[7][-1]
    flat.view(-1).view(torch.uint8)[0] ^= 1  # the snapshot the receiver maps, after its checksum was taken
    with pytest.raises(WeightSyncError, match="checksum mismatch.*version 7 discarded"):
        IpcWeightReceiver(1).receive(payload)
    flat.view(-1).view(torch.uint8)[0] ^= 1
    version, got = IpcWeightReceiver(1).receive(payload)
    assert version == 7 and tensor_checksum([t for _, t in got]) == tensor_checksum([t for _, t in named])


def test_a_low_bit_flip_in_any_word_is_refused():
    """Full verification: the lowest bit of a word anywhere in any bucket (the sampled check reads
    every 251st word only) moves that bucket's checksum, and the receiver compares exactly."""
    named = _named()
    sender = IpcWeightSender(1, verify="full")
    payload, _ = sender.send(named, 8)
    g = torch.Generator().manual_seed(8)
    for flat in sender._held[8]:
        words = flat.view(-1).view(torch.uint8)
        for byte in (int(torch.randint(0, words.numel() // 4, (1,), generator=g)) * 4, words.numel() - 4):
            words[byte] ^= 1  # little-endian: bit 0 of the word that starts at this byte
            with pytest.raises(WeightSyncError, match="checksum mismatch.*version 8 discarded"):
                IpcWeightReceiver(1).receive(payload)
            words[byte] ^= 1
    assert IpcWeightReceiver(1).receive(payload)[0] == 8


def test_two_swapped_same_shape_tensors_are_refused():
    """Two same-shape tensors, each a bucket of its own, delivered in each other's place with
    their checksums swapped too: each bucket's checksum is seeded with its index, so the swap is
    refused, and a learner/generator comparison of ``tensor_checksum`` sees it as well."""
    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(600, 500, generator=g)), ("b.weight", torch.randn(600, 500, generator=g))]
    for verify in ("sampled", "full"):
        sender = IpcWeightSender(1, verify=verify)  # holds the snapshot while receivers map it
        payload, _ = sender.send(named, 9)
        assert len(payload["checksums"]) == 2
        swapped = {**payload, "handles": [payload["handles"][0][::-1]], "checksums": payload["checksums"][::-1]}
        with pytest.raises(WeightSyncError, match="checksum mismatch.*version 9 discarded"):
            IpcWeightReceiver(1).receive(swapped)
        assert IpcWeightReceiver(1).receive(payload)[0] == 9
    assert tensor_checksum([named[1][1], named[0][1]]) != tensor_checksum([t for _, t in named])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_by_the_receiver(bad):
    named = _named()
    poisoned = [(n, t.clone()) for n, t in named]
    poisoned[2][1][1, 4] = bad  # in a packed bucket, not the first tensor of it
    sender = IpcWeightSender(1, verify="full")
    payload, _ = sender.send(poisoned, 4)
    with pytest.raises(WeightSyncError, match=r"version 4 hold non-finite values \(NaN or inf in proj.weight\)"):
        IpcWeightReceiver(1).receive(payload)
    payload, _ = sender.send(named, 5)
    assert IpcWeightReceiver(1).receive(payload)[0] == 5


def _actors(cfg, model, learner_cls=None):
    import ray

    from actors.cluster import Actors
    from actors.generator import GeneratorActor
    from actors.learner import start_learner

    learner = start_learner(cfg, model)
    gen = GeneratorActor.options(num_cpus=0.5, max_restarts=0).remote(cfg, model, 0)
    ray.get([gen.ready.remote(), learner.ready.remote()])
    actors = Actors([gen], None, None, learner)
    actors.form_weight_sync(cfg)
    return actors


def test_two_ray_actors_sync_train_and_sync_again(ray_cluster, tiny_model):
    """Learner actor -> generator actor by shared-memory handles: bit-exact after each sync,
    the version advances, and the second sync after an optimizer step moves the new values."""
    import ray

    from actors.cluster import RunError
    from prorl_async.config import load_config

    cfg = load_config(None, [f"model.path={tiny_model}", *SMALL])
    actors = _actors(cfg, tiny_model)
    learner, gen = actors.learner, actors.generators[0]
    try:
        assert actors.sync_backend == "ipc"
        v0 = ray.get(learner.weights_checksum.remote())
        assert actors.sync_all(cfg, "first sync") == [0]
        assert ray.get(gen.weights_checksum.remote()) == v0
        assert ray.get(learner.release_weights.remote()) == []  # sync_all freed the snapshot once answered
        m = ray.get(learner.train_step.remote(graded_table(groups=4, n=4, seed=1), 0))
        assert m["actor/updates"] == 1 and math.isfinite(m["actor/pg_loss"])
        v1 = ray.get(learner.weights_checksum.remote())
        assert v1[0] == 1 and v1[1] != v0[1]  # the optimizer step moved the weights
        assert ray.get(gen.weights_checksum.remote()) == v0  # nothing reached the generator yet
        assert actors.sync_all(cfg, "second sync") == [1]
        assert ray.get(gen.weights_checksum.remote()) == v1  # the new values, bit-exact
        # the driver's asynchronous path: the learner holds the snapshot until told every receiver answered
        sent = learner.broadcast_weights.remote()
        info = ray.get(gen.receive_weights.remote(*actors.receive_args(sent)))
        assert info["version"] == 1 and "weights" in ray.get(sent)
        assert ray.get(learner.release_weights.remote()) == [1]
        # a dead receiver: one clear error, not a hang
        ray.kill(gen, no_restart=True)
        with pytest.raises(RunError, match="third sync failed: generator-0 died"):
            actors.sync_all(cfg, "third sync")
        assert ray.get(learner.release_weights.remote()) == []  # and its snapshot was freed all the same
    finally:
        for a in (learner, gen):
            ray.kill(a)


def test_auto_picks_a_collective_on_cpu_and_ipc_is_refused_on_a_bad_value(ray_cluster, tiny_model):
    from prorl_async.config import ConfigError, load_config

    cfg = load_config(None, [f"model.path={tiny_model}", *SMALL[:-1], "ray.weight_sync_backend=auto"])
    actors = _actors(cfg, tiny_model)
    try:
        assert actors.sync_backend == "gloo"  # no GPUs reserved: gloo, as before
    finally:
        import ray
        for a in (actors.learner, *actors.generators):
            ray.kill(a)
    with pytest.raises(ConfigError, match="ray.weight_sync_backend.*auto, gloo, nccl or ipc"):
        load_config(None, ["ray.weight_sync_backend=cuda-ipc"])


def test_cli_run_with_ipc_weight_sync(tmp_path, model_cache):
    """A few steps of tiny-arith through the real CLI with the ipc transport."""
    run_dir = tmp_path / "run"
    res = cli("train", "train.total_steps=3", "train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4",
              "train.eval_interval=0", "model.warmup_steps=200", "train.micro_batch_size=32", "ray.num_cpus=2",
              "algo.max_refill_rounds=0", "tracking.enabled=false", "ray.weight_sync_backend=ipc",
              f"run_dir={run_dir}", f"model.cache_dir={model_cache}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all("weights" not in h for h in history)  # the handles never reach the metrics
    assert all(h["perf/sync_gb"] > 0 for h in history[1:])  # (a step logs the sync before it)
    assert all(math.isfinite(h["actor/pg_loss"]) for h in history)
    # the generator served the synced versions: nothing trained on is staler than the bound, and
    # tokens sampled with the learner's current weights (version >= 1 after the first step) have
    # the learner's logprobs (logprob parity: the engine holds exactly the synced weights)
    assert all(h["async/trained_staleness_max"] <= 1 for h in history)
    synced = [h for h in history[1:] if h["mismatch/tokens"] > 0]
    assert synced, [(h["step"], h["mismatch/tokens"]) for h in history]
    assert all(h["mismatch/logprob_abs_diff_max"] < 1e-3 for h in synced), [h["mismatch/logprob_abs_diff_max"]
                                                                          for h in synced]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["weight_sync_backend"] == "ipc"
