"""pagedjax.reserved_cpus: PAGEDJAX_CPU_NUM_OF_RESERVED_CPU keeps the last N CPUs from XLA's
threads and gives them to the grammar compile threads; bad values name the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedjax.reserved_cpus import ENV, split


@pytest.mark.parametrize(
    ("value", "cpus", "steps", "reserved"),
    [
        (None, {0, 1, 2, 3}, {0, 1, 2, 3}, set()),
        ("", {0, 1}, {0, 1}, set()),
        ("0", {0, 1}, {0, 1}, set()),
        ("1", {0, 1, 2, 3}, {0, 1, 2}, {3}),
        (" 2 ", {0, 1, 2, 3}, {0, 1}, {2, 3}),
        ("1", {0, 2, 5}, {0, 2}, {5}),  # the last in number order, not the last index
    ],
)
def test_split_reserves_the_last_cpus(value, cpus, steps, reserved):
    assert split(value, cpus) == (frozenset(steps), frozenset(reserved))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("abc", "whole number"),
        ("1.5", "whole number"),
        ("-1", "whole number"),
        ("²", "whole number"),
        ("4", "no CPU"),
    ],
)
def test_split_refuses_bad_values_naming_the_variable(value, message):
    with pytest.raises(ValueError, match=message) as e:
        split(value, {0, 1, 2, 3})
    assert ENV in str(e.value)


# Imports pagedjax, runs a jax computation (XLA's thread pool starts), starts the grammar
# pools' threads, and prints each thread's allowed CPUs by name.
CHILD = """
import glob, json, os
import pagedjax
import jax.numpy as jnp
from pagedjax.structured_output.compilation import CompilePools
(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
pools = CompilePools(1)
idle = pools.idle.submit(lambda: sorted(os.sched_getaffinity(0))).result()
normal = pools.normal.submit(lambda: sorted(os.sched_getaffinity(0))).result()
xla = set()
for task in glob.glob("/proc/self/task/*"):
    if open(task + "/comm").read().startswith("tf_XLA"):
        xla.add(tuple(sorted(os.sched_getaffinity(int(task.rsplit("/", 1)[1])))))
import subprocess, sys
code = "import os, pagedjax; from pagedjax.reserved_cpus import reserved; "
code += "print(sorted(os.sched_getaffinity(0)), sorted(reserved()))"
child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.strip()
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "idle": idle, "normal": normal,
                  "xla": sorted(xla), "child": child}))
pools.shutdown()
"""


def _child(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and 2 CPUs",
)
def test_reserved_cpus_go_to_the_compile_threads_and_not_to_xla():
    cpus = sorted(os.sched_getaffinity(0))
    proc = _child("1")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["main"] == cpus[:-1]
    assert got["idle"] == got["normal"] == cpus[-1:]
    assert got["xla"] == [cpus[:-1]]  # XLA's pool threads exist, all off the reserved CPU
    # a child process importing pagedjax keeps the same split (it does not reserve 1 more)
    assert got["child"] == f"{cpus[:-1]} {cpus[-1:]}"
    proc = _child(None)  # unset: every thread may run anywhere
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["main"] == got["idle"] == got["normal"] == cpus
    assert got["child"] == f"{cpus} []"
    assert got["xla"] == [cpus]


def test_a_bad_value_fails_the_import_naming_the_variable():
    proc = subprocess.run(
        [sys.executable, "-c", "import pagedjax"],
        env={**os.environ, ENV: "many"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"ValueError: {ENV}='many'" in proc.stderr
