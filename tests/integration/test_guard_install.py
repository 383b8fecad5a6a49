"""The guard is its own distribution (issue 37): `pip install ./guard` into a clean
virtualenv gives an agent loopwatch's detectors without the stream service's dependencies
(no faust, rocksdict or confluent-kafka), and a decision works there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json
from loopwatch_guard import Guard
from loopwatch_guard.detectors.policy import policy_from_mapping
guard = Guard(policy_from_mapping({"guard": {"mode": "enforce"}}))
run = guard.run("clean-venv")
actions = []
for i in range(3):
    d = run.before_tool("lookup_order", {"order_id": "A12"}, call_id=f"c{i}")
    actions.append(d.action)
    if d.allowed:
        run.after_tool(d.call_id, result={"status": "delivered"})
absent = [m for m in ("faust", "rocksdict", "confluent_kafka", "aiokafka", "detectors", "streams")
          if importlib.util.find_spec(m) is None]
print(json.dumps({"actions": actions, "absent": absent}))
"""


@pytest.mark.slow
def test_pip_install_guard_into_a_clean_virtualenv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT / "guard")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "loopwatch-guard" in names
    assert names.isdisjoint({"faust-streaming", "rocksdict", "confluent-kafka", "aiokafka"}), names
    probe = subprocess.run(
        [python, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = json.loads(probe.stdout)
    # the seeds' boundary: with allowed_repeats 2, the third stalled identical call
    assert found["actions"] == ["allow", "allow", "deny"]
    # nothing of the service, and loopwatch's detectors only under the guard's own name
    assert found["absent"] == [
        "faust",
        "rocksdict",
        "confluent_kafka",
        "aiokafka",
        "detectors",
        "streams",
    ]
