"""Config: YAML + dotted overrides, and one clear message per mistake."""

import pytest

from actors.cli import main
from prorl_async.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n: 4\nalgo:\n  clip_eps_high: 0.3\n")
    cfg = load_config(str(p), ["algo.clip_eps_high=0.28", "rollout.n=8", "train.lr=5e-4"])
    assert cfg.rollout.n == 8 and cfg.algo.clip_eps_high == 0.28 and cfg.train.lr == 5e-4
    assert cfg.algo.clip_eps_low == 0.2  # untouched default
    with pytest.raises(Exception):
        cfg.rollout.n = 3  # frozen


@pytest.mark.parametrize("override, needle", [
    ("rollout.nn=3", "unknown config key 'rollout.nn'"),
    ("bogus.x=1", "unknown config key 'bogus'"),
    ("rollout.n=abc", "rollout.n: expected an integer"),
    ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling: expected true/false"),
    ("train.max_staleness=-1", "train.max_staleness: must be >= 0"),
    ("train.mini_batches=3", "train.mini_batches: must divide train.prompts_per_step=64"),
    ("train.micro_batch_size=100", "train.micro_batch_size: must divide the mini-batch of 128"),
    ("algo.is_mode=foo", "algo.is_mode: must be tis, icepop or none"),
    ("rollout.vllm_engine_core=thread", "rollout.vllm_engine_core: must be auto, inline or process"),
    ("rollout", "not of the form section.field=value"),
])
def test_config_errors_name_the_field(override, needle, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert main(["train", override]) == 2  # the CLI prints one line and exits 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml", [])
