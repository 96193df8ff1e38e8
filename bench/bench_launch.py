"""The agent's launch, through the pre-started launcher and through a fresh interpreter (the
old path, still the fallback), interleaved in one run on this machine.

    .venv/bin/python bench/bench_launch.py [--runs N]

Times ``agent.answer({"op": "launch", ...})`` in-process, as the agent serves it, from the
request to the reply with the worker's pid; the worker (``sleep``) is killed and its
shepherd's exit awaited between launches, untimed. Prints medians, ranges and the ratio.
Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from supervisor import agent, remote  # noqa: E402
from tests.integration.test_launcher import make_spec  # noqa: E402

#: How often the benchmark looks for a dead shepherd between launches (untimed).
POLL_S = 0.002


def via_launcher(spec: dict[str, Any]) -> dict[str, Any]:
    """The launch as the agent serves it now."""
    return agent.answer({"id": 1, "op": "launch", "spec": spec})


def via_fresh_interpreter(spec: dict[str, Any]) -> dict[str, Any]:
    """The launch as it was served before the launcher (and still is, as the fallback)."""
    try:
        report = agent._launch_fresh(sys.executable, spec, "fresh interpreter")
        return {"ok": True, "result": agent._launch_result(report, "fresh interpreter")}
    except agent.OpError as exc:
        return {"ok": False, "error": str(exc)}


def stop_worker(spec: dict[str, Any], pid: int) -> None:
    """Kill the worker and wait until its shepherd has exited (the shard lock is free)."""
    record = json.loads(Path(spec["launch_record"]).read_text())
    shepherd = int(record["shepherd_pid"])
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not agent.is_dead(agent.proc_stat(shepherd)):
        if time.monotonic() > deadline:
            raise SystemExit(f"shepherd {shepherd} did not exit")
        time.sleep(POLL_S)


def time_launch(launch: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any]) -> float:
    """Seconds one launch took; the worker is stopped afterwards."""
    started = time.perf_counter()
    reply = launch(spec)
    elapsed = time.perf_counter() - started
    if not reply.get("ok"):
        raise SystemExit(f"launch failed: {reply}")
    stop_worker(spec, int(reply["result"]["pid"]))
    return elapsed


def summary(name: str, samples: list[float]) -> str:
    """One markdown row: median and range in ms."""
    ms = sorted(1000 * s for s in samples)
    return f"| {name} | {statistics.median(ms):.1f} | {ms[0]:.1f} - {ms[-1]:.1f} | {len(ms)} |"


def main() -> None:
    """Warm up, then alternate the two paths ``--runs`` times each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    agent._SOURCE[:] = [remote.agent_program()]
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        spec = make_spec(Path(tmp), ["sleep", "1000"])
        time_launch(via_launcher, spec)  # starts the launcher; not counted
        time_launch(via_fresh_interpreter, spec)
        samples: dict[str, list[float]] = {"launcher": [], "fresh interpreter": []}
        for _ in range(args.runs):
            samples["launcher"].append(time_launch(via_launcher, spec))
            samples["fresh interpreter"].append(time_launch(via_fresh_interpreter, spec))
    print("| launch path | median ms | range ms | runs |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        print(summary(name, values))
    ratio = statistics.median(samples["fresh interpreter"]) / statistics.median(samples["launcher"])
    print(f"\nfresh interpreter / launcher (medians): {ratio:.1f}x")


if __name__ == "__main__":
    main()
