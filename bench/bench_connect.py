"""Connecting a fleet: N ``RemoteHost``s to N in-process SSH endpoints, the daemon's way.

    .venv/bin/python -m bench.bench_connect [--hosts 1000] [--handshakes 8]

Measures, in one process, the wall time until every host reports its connection up, and
this process's CPU time over it (client *and* server side: both run here, so the number
is an upper bound of the daemon's share). ``known_hosts`` has one line per host, as a real
fleet's does. Prints one markdown line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import SCRATCH, raise_nofile
from bench.fleetsim import InprocFleet
from supervisor.config import HostConfig, SshConfig
from supervisor.remote import RemoteHost


async def connect_all(hosts: int, handshakes: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to connect ``hosts`` hosts."""
    with tempfile.TemporaryDirectory(prefix="bench-connect-", dir=SCRATCH) as tmp:
        names = [f"h{i}" for i in range(hosts)]
        fleet = InprocFleet(Path(tmp), names)
        await fleet.start()
        ssh = SshConfig(
            username=os.environ.get("USER") or "root",
            known_hosts=fleet.known_hosts_path,
            client_keys=(fleet.client_key_path,),
            connect_timeout_s=120.0,
        )
        up: set[str] = set()
        all_up = asyncio.Event()

        def on_connection(name: str) -> Callable[[bool, str], None]:
            """The connection callback of host ``name``: counts it up once."""

            def report(is_up: bool, _reason: str) -> None:
                if is_up:
                    up.add(name)
                    if len(up) == hosts:
                        all_up.set()

            return report

        gate = asyncio.Semaphore(handshakes)
        remotes = [
            RemoteHost(
                HostConfig(name=name, shard=i, address=addr, port=port),
                ssh,
                python=sys.executable,
                handshakes=gate,
                on_connection=on_connection(name),
            )
            for i, (name, (addr, port)) in enumerate(fleet.endpoints.items())
        ]
        cpu0, t0 = time.process_time(), time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for remote in remotes:
                tg.create_task(remote.maintain())
            await all_up.wait()
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            for remote in remotes:
                await remote.aclose()
        await fleet.aclose()
        return wall, cpu


def main() -> None:
    """Run once and print the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--handshakes", type=int, default=8)
    args = parser.parse_args()
    raise_nofile()
    wall, cpu = asyncio.run(connect_all(args.hosts, args.handshakes))
    print(f"| {args.hosts} hosts | {wall:.1f} s wall | {cpu:.1f} s CPU (client + server) |")


if __name__ == "__main__":
    main()
