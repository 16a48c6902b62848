"""The tests' CLI runner (tests/_cli_fork.py): a forked child answers as a fresh ``prorl-async`` does."""

from __future__ import annotations

from tests.conftest import cli


def test_a_forked_cli_run_answers_as_a_fresh_one(tmp_path, model_cache):
    """The same bad input through a fresh interpreter and through the fork server: the same exit
    status and the same one ``error:`` line; the child runs in the call's working directory (the
    relative dataset path resolves there, or the error would name a missing file instead)."""
    (tmp_path / "rows.jsonl").write_text('{"id": "a", "domain": "arithmetic", "prompt": "1+1=", "answer": "2"}\n'
                                         '{"id": "b", "domain": "arithmetic"}\n')
    args = ("train", "data.train=rows.jsonl", "data.strict=true", f"run_dir={tmp_path / 'run'}",
            f"model.cache_dir={model_cache}")
    fresh = cli(*args, cwd=tmp_path, fresh=True)
    forked = cli(*args, cwd=tmp_path)
    errors = [[line for line in r.stderr.splitlines() if line.startswith("error:")] for r in (fresh, forked)]
    assert fresh.returncode == forked.returncode == 2, (fresh.stderr[-2000:], forked.stderr[-2000:])
    assert errors[0] == errors[1] and len(errors[0]) == 1 and "line 2" in errors[0][0], errors
    assert "Traceback" not in forked.stderr and "Traceback" not in fresh.stderr
    # an unknown subcommand: argparse's usage error and status 2 in both
    bad = [cli("trian", cwd=tmp_path, fresh=f) for f in (True, False)]
    assert bad[0].returncode == bad[1].returncode == 2 and "invalid choice: 'trian'" in bad[1].stderr
