"""Custom verifiers that misbehave, registered for the GraderPool tests (imported via extra_modules)."""

import os
import time

from prorl_async.rewards import Grade, register


def _hang(row, response):
    while True:
        time.sleep(3600)


def _spin(row, response):
    while True:  # a tight loop in Python; no sleep to interrupt
        pass


def _boom(row, response):
    raise RuntimeError("verifier exploded")


def _nan(row, response):
    return Grade(float("nan"), True, "nan", "nan")


def _die(row, response):
    os._exit(13)


def _echo(row, response):
    return Grade(float(response == row["answer"]), True, "echo", "echo")


register("hang", _hang)
register("spin", _spin)
register("boom", _boom)
register("nan", _nan)
register("die", _die)
register("echo", _echo)
