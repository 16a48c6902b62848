"""The console of a run (issue 27): only the project's lines, no carriage return through a pipe;
the engines' and Ray's output in the run's log folder, and on the console with ``--verbose``."""

from __future__ import annotations

import io
import json
import os
import re

from prorl_async.console import bar
from tests.conftest import cli

# Every line the project writes to a run's console, by its format (actors/driver.py, actors/checkpointing.py,
# prorl_async/{models,outputs,refill,curriculum,console}.py). Anything else is foreign: an engine's,
# DeepSpeed's, torch's, Ray's line.
PROJECT_LINES = [re.compile(p) for p in (
    r"run directory: \S+$",
    r"actors: \S+ on \S+.*; weight sync: \w+(, store \S+)?$",  # where each actor runs (actors/placement.py)
    r"weight sync re-formed \(group \d+, store \S+\): \S+ on \S+.*",  # where the generators are after a failure
    r"building the built-in model tiny-arith \(.*\) into \S+$",
    r"converting SmolLM2-135M-Instruct from .*",
    r"  converted in \d+s$",
    r"\d+/\d+  .+",  # a progress bar's plain line (warm-up, preflight, evaluation)
    r"step +\d+/\d+  reward .* left\]$",
    r"held-out at step \d+: pass@1 .*",
    r"held-out metric +before +after +change$",
    r"val/\S+ +-?\d+\.\d{3} +-?\d+\.\d{3} +[-+]\d+\.\d{3}$",  # a row of that table
    r"checkpoint \S+ \(\w+, [\d.]+s\)$",
    r"resumed from .*",
    r"dynamic sampling: refill round .*",
    r"preflight: .*", r"\(preflight: \d+s\)$", r"pool +groups +reward +signal +status$", r"curriculum at .*",
    r"\S+ +\d+ +-?[\d.]+ +-?[\d.]+ +\w.*",  # a row of the curriculum table
    r"done: \d+ steps in \d+s; run dir \S+$",
    r"best: val/\S+ -?\d+\.\d{3} at step \d+ (-> \S+|\(\S+\))$", r"best so far: val/\S+ .*",  # train.keep_best
    r"stopping: val/\S+ .*", r"stopped early: val/\S+ .*",  # train.stop_at
    r"(warning|error): .+",  # the project's warnings and errors (an actor's: "warning: [grader] ...")
    r"domain +pass@1 +pass@\d+ +se@1( +se@\d+)?( +prior@1( +prior@\d+)?)?$",  # prorl-async eval's table
    r"\S+ +\d\.\d{3} +(\d\.\d{3}|nan)( +(\d\.\d{3}|-)){0,4}$", r"prior@: what the answers alone score, .*",
    r"se@: one standard error over the prompts .*",
    r"wrote \S+$", r"actors' output: \S+$",  # prorl-async eval
)]

TINY = ["train.total_steps=2", "train.prompts_per_step=4", "rollout.n=2", "rollout.prompts_per_request=4",
        "train.eval_interval=0", "train.eval_samples=1", "data.eval=builtin:arithmetic?n=8&seed=2&split=eval",
        "ray.num_cpus=2", "algo.max_refill_rounds=0", "tracking.enabled=false"]


def foreign_lines(console: str) -> list[str]:
    """Console lines no format of the project's accounts for (blank lines are the project's too)."""
    return [line for line in console.splitlines() if line.strip() and not any(p.match(line) for p in PROJECT_LINES)]


def test_project_line_formats_tell_the_projects_lines_from_an_engines():
    """The classifier the CLI tests count with, on lines from a real run's log before issue 27."""
    ours = ["run directory: /tmp/x/run", "actors: generator-0 on 10.0.0.2 (gloo 10.0.0.2); grader on 10.0.0.1; "
            "learner-0 on 10.0.0.3 (world 10.0.0.3:4100, gloo 10.0.0.3, placement group 1a2b3c4d); "
            "weight sync: gloo, store 10.0.0.3:4200",
            "weight sync re-formed (group 2, store 10.0.0.3:4300): generator-0 on 10.0.0.4 (gloo 10.0.0.4)",
            "step    2/2  reward 0.250  acc 0.250  kl 0.00e+00  stale 1  gen 8 tok/s  "
            "train 102 tok/s  [55s elapsed, ~0s left]", "held-out at step 2: pass@1 0.250  pass@2 0.500",
            "3/8  sampled held-out evaluation, step 0", "done: 2 steps in 51s; run dir /tmp/x/run",
            "best: val/pass@1 0.062 at step 2 -> /tmp/x/run/best", "best: val/pass@1 0.062 at step 2 (/tmp/x/run/best)",
            "stopped early: val/pass@1 0.031 >= 0 at step 2 (train.stop_at=val/pass@1>=0)",
            "warning: [grader] code sandbox: no namespace isolation available"]
    theirs = ["\x1b[36m(GeneratorActor pid=1661)\x1b[0m (MainProcess pid=1661) WARNING 11-25 19:33:45 "
              "[arg_utils.py:1945] The global random seed is set to 0.",
              "[2026-11-25 19:40:36,765] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
              "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  2.43it/s]",
              "[W1125 19:33:48.182083888 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
              "2026-11-25 19:33:45,123\tINFO worker.py:1821 -- Started a local Ray instance."]
    assert foreign_lines("\n".join(ours)) == []
    assert foreign_lines("\n".join(theirs)) == theirs


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_redraws_on_a_terminal_and_prints_plain_lines_elsewhere():
    tty = _Terminal()
    for done in range(1, 4):
        bar("eval", done, 3, out=tty)
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().endswith("3/3  eval   \n")
    piped = io.StringIO()
    for t in (0.0, 3.0, 9.9, 10.5, 12.0):  # seconds: one line at most every 10 s
        bar("warm-up", int(t) + 1, 50, out=piped, now=t)
    bar("warm-up", 50, 50, out=piped, now=13.0)  # and the last
    assert piped.getvalue() == "1/50  warm-up\n11/50  warm-up\n50/50  warm-up\n"


def test_cli_console_through_a_pipe_holds_only_the_projects_lines(tmp_path, model_cache):
    """The tiny default run through the real CLI, stdout and stderr to pipes: every console line is
    the project's, no carriage return; what the actors printed is in the run's logs/ folder."""
    run_dir = tmp_path / "run"
    res = cli("train", *TINY, f"run_dir={run_dir}", f"model.cache_dir={model_cache}", cwd=tmp_path, timeout=1500,
              raw=True, fresh=True)  # a new interpreter: what its imports print counts too
    stdout, console = res.stdout.decode(errors="replace"), (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0, console[-4000:]
    assert "step    2/2" in stdout and "done: 2 steps" in stdout, console[-4000:]
    assert b"\r" not in res.stdout + res.stderr, console[-4000:]
    assert foreign_lines(console) == [], console[-4000:]
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"generator-0.log", "learner.log", "grader.log", "buffer.log"} <= logs, logs
    assert (run_dir / "logs" / "learner.log").read_text().startswith("--- learner, pid ")


def test_cli_verbose_streams_the_actors_output_to_the_console(tmp_path, model_cache):
    """``--verbose``: what the actors print reaches the console as Ray streams it, prefixed by Ray."""
    run_dir = tmp_path / "run"
    res = cli("train", "--verbose", *TINY, f"run_dir={run_dir}", f"model.cache_dir={model_cache}", cwd=tmp_path,
              timeout=1500)
    console = res.stdout + res.stderr
    assert res.returncode == 0, console[-4000:]
    assert re.search(r"\((GeneratorActor|LearnerActor|GraderActor) pid=\d+\)", console), console[-4000:]


def test_setup_hook_sends_a_process_fd_1_and_2_to_its_role_file(tmp_path):
    """The hook in a fresh process (no Ray): Python, a child process's (C-level) output and an
    engine's log record land in ``<role>.log``, nothing on the process's own stdout or stderr;
    the project's warning is also held for the driver."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = """if True:
        import json, logging, os, sys
        from prorl_async import console
        console.actor_output_to_file()
        print("python stdout"); print("python stderr", file=sys.stderr)
        os.system("echo a child process on fd 1; echo on fd 2 >&2")
        logging.getLogger("vllm").warning("an engine's warning")
        logging.getLogger("prorl_async.rewards").warning("the project's own warning")
        open(sys.argv[1], "w").write(json.dumps(console.HELD.drain()))
    """
    held = tmp_path / "held.json"
    res = subprocess.run([sys.executable, "-c", code, str(held)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PRORL_ASYNC_LOG_DIR": str(tmp_path / "logs"),
                              "PRORL_ASYNC_ROLE": "generator-0"})
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res
    text = (tmp_path / "logs" / "generator-0.log").read_text()
    for line in ("python stdout", "python stderr", "a child process on fd 1", "on fd 2", "an engine's warning",
                 "the project's own warning"):
        assert line in text, (line, text)
    assert json.loads(held.read_text()) == ["warning: [generator-0] the project's own warning"]


def test_a_warning_raised_in_an_actor_reaches_the_driver_and_its_output_the_file(ray_cluster, tmp_path):
    """The actor side as the setup hook leaves it (output to ``<role>.log``, the project's warnings
    held), drained by the driver's :class:`ActorWarnings` without a method of the actor's own."""
    from prorl_async.console import ActorWarnings

    @ray_cluster.remote(num_cpus=0)
    class Probe:
        def __init__(self, log_dir: str):
            import os

            from prorl_async import console

            os.environ.update({console.LOG_DIR_ENV: log_dir, console.ROLE_ENV: "probe"})
            console.actor_output_to_file()  # what the hook runs before the class is loaded

        def work(self) -> None:
            import logging
            import os

            os.write(1, b"an engine's line on fd 1\n")
            logging.getLogger("prorl_async.engines").warning("the project's own warning")
            logging.getLogger("vllm").warning("an engine's warning")

    probe = Probe.remote(str(tmp_path))
    ray_cluster.get(probe.work.remote())
    lines = ActorWarnings().poll([probe], wait_s=60.0)
    assert lines == ["warning: [probe] the project's own warning"]
    text = (tmp_path / "probe.log").read_text()
    assert text.startswith("--- probe, pid ") and "an engine's line on fd 1" in text
    assert "the project's own warning" in text and "an engine's warning" in text  # both in the file
    ray_cluster.kill(probe)
