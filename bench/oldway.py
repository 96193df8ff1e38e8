"""The baseline: the seed's mechanisms (``reward_workers_ctl.py``), re-implemented minimally.

The seed itself cannot run here (it imports ``areal`` and hard-codes its paths), so this is a
faithful copy of what it does, and nothing more:

- every action is ``ssh -o BatchMode=yes -o ConnectTimeout=20 HOST 'script'``: a fresh ``ssh``
  process (handshake, login, the remote user's shell and rc files) per command; here with
  ``-i KEY -o UserKnownHostsFile=... -F /dev/null -p PORT`` added to reach the test sshd;
- hosts are handled one after another (``start``, ``stop``; ``watch`` restarts one host at a
  time);
- the remote scripts are the seed's f-string shell scripts, with its paths, pid files and
  sleeps: ``start`` with the respawn wrapper (``ctl/<host>.wrap.sh``: ``while [ ! -f STOP ]``
  run the worker, ``wait``, ``sleep 2``; the start script itself kills old pids and sleeps
  1 s twice, then waits up to 5 s for the pid file in 0.5 s steps) or without it
  (``--no-respawn``: ``nohup python -m ... &``);
- ``start`` then polls every status file every 0.5 s until all are ready (heartbeat younger
  than the stale time by the local clock, ``ready: true``);
- ``stop`` writes the stop sentinel, SIGTERMs wrapper and worker and polls ``/proc/PID`` with
  ``sleep 1`` until it is gone (a zombie still counts as alive);
- ``watch`` polls every status file every ``interval`` (1 s here; the seed's default is 10 s)
  and runs ``restart-host`` (the respawn start script above) for a host whose heartbeat is
  older than the stale time or not ready, once per cooldown (0 here; the seed's is 30 s).

The worker is the reference worker (``python -m supervisor.demo.worker``), as for our daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import old_ssh_argv, read_json, write_atomic
from tests.sshd import OpenSsh

WORKER_MODULE = "supervisor.demo.worker"
#: The seed matches ``*MODULE*--host*HOST*`` against ``ps`` output to kill strays; that
#: pattern also matches the remote shell running the script (its command line is the
#: script), so the seed's respawn start kills itself halfway (ssh exits 255). The one
#: change made to the seed's scripts: ``[s]upervisor`` matches the same workers, not itself.
SELF_SAFE_MODULE = "[" + WORKER_MODULE[0] + "]" + WORKER_MODULE[1:]
#: ``_all_ready``'s poll period in the seed's ``start``.
START_POLL_S = 0.5


@dataclass(frozen=True)
class OldHost:
    """One host as the seed's ``workers`` list has it, plus where its sshd listens."""

    name: str
    shard: int
    address: str
    concurrency: int = 2


class OldWay:
    """The seed's start / stop / restart-host / watch against one run root."""

    def __init__(self, sshd: OpenSsh, root: Path, hosts: Sequence[OldHost], python: str):
        self.sshd = sshd
        self.root = root
        self.hosts = list(hosts)
        self.python = python
        self.venv = str(Path(python).parent.parent)

    # --- paths (the seed's) -----------------------------------------------------------

    def pidfile(self, host: str) -> Path:
        """``ctl/<host>.pid``: the worker's pid."""
        return self.root / "ctl" / f"{host}.pid"

    def wrap_pidfile(self, host: str) -> Path:
        """``ctl/<host>.wrap.pid``: the respawn wrapper's pid."""
        return self.root / "ctl" / f"{host}.wrap.pid"

    def stop_sentinel(self, host: str) -> Path:
        """``ctl/<host>.stop``: the sentinel that ends the respawn loop."""
        return self.root / "ctl" / f"{host}.stop"

    def status(self, host: str) -> Path:
        """``status/<host>.json``: the worker's heartbeat file."""
        return self.root / "status" / f"{host}.json"

    def prepare(self) -> None:
        """The run directory and manifest the seed's ``start`` writes before any ssh."""
        for sub in ("ctl", "status", "outbox", *(f"inbox/{h.shard}" for h in self.hosts)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        manifest = {
            "experiment_name": "bench",
            "trial_name": "old",
            "run_id": "old-1",
            "reward_fn": "supervisor.demo.worker.exact_match",
            "shard_count": len(self.hosts),
            "workers": [{"host": h.name, "shard": h.shard, "concurrency": 2} for h in self.hosts],
        }
        write_atomic(self.root / "manifest.json", json.dumps(manifest).encode())

    # --- ssh ---------------------------------------------------------------------------

    async def ssh(self, host: OldHost, script: str, timeout_s: float = 120) -> tuple[int, str]:
        """The seed's ``_ssh``: a fresh ssh process; (exit code, stdout+stderr)."""
        process = await asyncio.create_subprocess_exec(
            *old_ssh_argv(self.sshd, host.address, script),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        async with asyncio.timeout(timeout_s):
            out, _ = await process.communicate()
        return process.returncode or 0, out.decode(errors="replace")

    # --- the seed's scripts --------------------------------------------------------------

    def _worker_cmd(self, host: OldHost) -> str:
        """The worker's command line, as the seed's scripts quote it."""
        return (
            f"'{self.python}' -m {WORKER_MODULE} --root '{self.root}' --shard {host.shard}"
            f" --host '{host.name}' --concurrency {host.concurrency}"
        )

    def start_script(self, host: OldHost, *, respawn: bool) -> str:
        """``_start_one_host``'s remote script (and, with respawn, its wrapper file)."""
        root, name = self.root, host.name
        pid_path, stop_path = self.pidfile(name), self.stop_sentinel(name)
        wrap_pid_path = self.wrap_pidfile(name)
        log_path = root / "ctl" / f"{name}.log"
        wrap_log = root / "ctl" / f"{name}.wrap.log"
        wrap_sh = root / "ctl" / f"{name}.wrap.sh"
        if respawn:
            wrap_sh.write_text(
                f"""#!/usr/bin/env bash
set +e
STOP="{stop_path}"
PIDF="{pid_path}"
LOG="{log_path}"
WLOG="{wrap_log}"
export PATH="/usr/bin:/bin:{self.venv}/bin:/usr/local/bin"
while [ ! -f "$STOP" ]; do
  echo "[wrap $(date -u +%Y-%m-%dT%H:%M:%SZ)] starting worker" >> "$WLOG"
  {self._worker_cmd(host)} >>"$LOG" 2>&1 &
  wpid=$!
  echo "$wpid" > "$PIDF"
  wait "$wpid"
  rc=$?
  echo "[wrap $(date -u +%Y-%m-%dT%H:%M:%SZ)] worker pid=$wpid exited rc=$rc" >> "$WLOG"
  if [ -f "$STOP" ]; then break; fi
  sleep 2
done
echo "[wrap $(date -u +%Y-%m-%dT%H:%M:%SZ)] stop sentinel seen; exit" >> "$WLOG"
""",
                encoding="utf-8",
            )
            return f"""
set -euo pipefail
export PATH='/usr/bin:/bin:{self.venv}/bin:/usr/local/bin'
mkdir -p '{root}/ctl' '{root}/inbox/{host.shard}' '{root}/outbox' '{root}/status'
rm -f '{stop_path}'
for pf in '{wrap_pid_path}' '{pid_path}'; do
  if [ -f "$pf" ]; then
    old=$(cat "$pf" || true)
    if [ -n "${{old:-}}" ] && [ -d /proc/$old ]; then
      kill -TERM "$old" 2>/dev/null || true
    fi
  fi
done
sleep 1
ps -eo pid=,args= | while read -r pid args; do
  case "$args" in
    *{SELF_SAFE_MODULE}*--host*{name}*) kill -TERM "$pid" 2>/dev/null || true;;
  esac
done || true
sleep 1
chmod +x '{wrap_sh}'
nohup bash '{wrap_sh}' >>'{wrap_log}' 2>&1 &
echo $! > '{wrap_pid_path}'
for i in 1 2 3 4 5 6 7 8 9 10; do
  if [ -s '{pid_path}' ]; then break; fi
  sleep 0.5
done
echo started host={name} wrap_pid=$(cat '{wrap_pid_path}') \\
  worker_pid=$(cat '{pid_path}' 2>/dev/null || echo none) respawn=1
"""
        return f"""
set -euo pipefail
export PATH='/usr/bin:/bin:{self.venv}/bin:/usr/local/bin'
mkdir -p '{root}/ctl' '{root}/inbox/{host.shard}' '{root}/outbox' '{root}/status'
rm -f '{stop_path}'
if [ -f '{pid_path}' ]; then
  old=$(cat '{pid_path}' || true)
  if [ -n "${{old:-}}" ] && [ -d /proc/$old ]; then
    kill -TERM "$old" 2>/dev/null || true
    sleep 1
  fi
fi
nohup {self._worker_cmd(host)} \\
  >>'{log_path}' 2>&1 &
echo $! > '{pid_path}'
echo started host={name} pid=$(cat '{pid_path}') respawn=0
"""

    def stop_script(self, host: OldHost, grace_s: int = 60) -> str:
        """``cmd_stop``'s remote script for one host."""
        name = host.name
        pid_path, stop_path = self.pidfile(name), self.stop_sentinel(name)
        wrap_pid_path = self.wrap_pidfile(name)
        return f"""
set +e
export PATH=/usr/bin:/bin:/usr/local/bin
mkdir -p '{self.root}/ctl'
echo stop > '{stop_path}'
for pf in '{wrap_pid_path}' '{pid_path}'; do
  if [ -f "$pf" ]; then
    pid=$(cat "$pf")
    if [ -n "$pid" ] && [ -d /proc/$pid ]; then
      kill -TERM "$pid" 2>/dev/null
      echo TERM $pid on {name} via $pf
      for i in $(seq 1 {grace_s}); do
        if [ ! -d /proc/$pid ]; then echo exited $pid; break; fi
        sleep 1
      done
      if [ -d /proc/$pid ]; then
        echo WARN still alive after {grace_s}s
      fi
    else
      echo pidfile stale $pf on {name}
    fi
  fi
done
ps -eo pid=,args= | while read -r pid args; do
  case "$args" in
    *{SELF_SAFE_MODULE}*--host*{name}*) kill -TERM "$pid" 2>/dev/null; echo TERM_match $pid;;
    *{name}.wrap.sh*) kill -TERM "$pid" 2>/dev/null; echo TERM_wrap_sh $pid;;
  esac
done || true
true
"""

    # --- commands ----------------------------------------------------------------------

    async def start(self, *, respawn: bool, stale_s: float, timeout_s: float = 300) -> None:
        """``start``: each host in turn, then poll every status file until all are ready."""
        for host in self.hosts:
            rc, out = await self.ssh(host, self.start_script(host, respawn=respawn))
            if rc != 0:
                raise RuntimeError(f"old start of {host.name} failed ({rc}): {out[-500:]}")
        deadline = time.monotonic() + timeout_s
        while not self.all_ready(stale_s):
            if time.monotonic() > deadline:
                raise TimeoutError("old start: workers not ready in time")
            await asyncio.sleep(START_POLL_S)  # wait-ok: the seed's poll period

    async def stop(self, grace_s: int = 60) -> None:
        """``stop``: each host in turn (TERM, then ``sleep 1`` until gone)."""
        for host in self.hosts:
            await self.ssh(host, self.stop_script(host, grace_s), timeout_s=grace_s + 30)

    async def restart_host(self, host: OldHost) -> None:
        """``restart-host``: remove the stop sentinel, run the respawn start script."""
        self.stop_sentinel(host.name).unlink(missing_ok=True)
        rc, out = await self.ssh(host, self.start_script(host, respawn=True))
        if rc != 0:
            raise RuntimeError(f"old restart-host {host.name} failed ({rc}): {out[-500:]}")

    def healthy(self, host: OldHost, stale_s: float) -> bool:
        """``_host_health(...)["ok"]``: status readable, heartbeat young, ready."""
        status = read_json(self.status(host.name))
        if status is None:
            return False
        age = time.time() - float(status.get("heartbeat_at", 0))
        return age <= stale_s and bool(status.get("ready"))

    def all_ready(self, stale_s: float) -> bool:
        """``_all_ready``."""
        return all(self.healthy(h, stale_s) for h in self.hosts)

    async def watch(self, *, stale_s: float, interval_s: float, cooldown_s: float) -> None:
        """``watch``: poll every status file each interval; restart unhealthy hosts in turn."""
        last_restart: dict[str, float] = {}
        while True:
            for host in self.hosts:
                if self.healthy(host, stale_s):
                    continue
                now = time.time()
                if now - last_restart.get(host.name, 0.0) < cooldown_s:
                    continue
                await self.restart_host(host)
                last_restart[host.name] = now
            await asyncio.sleep(interval_s)  # wait-ok: the seed's poll period

    def kill_everything(self) -> None:
        """Bench cleanup (not the seed's): stop sentinels, then SIGKILL wrappers and workers."""
        import signal

        for host in self.hosts:
            self.stop_sentinel(host.name).parent.mkdir(parents=True, exist_ok=True)
            self.stop_sentinel(host.name).write_text("stop")
        pids: set[int] = set()
        for host in self.hosts:
            for path in (self.wrap_pidfile(host.name), self.pidfile(host.name)):
                with contextlib.suppress(OSError, ValueError):
                    pids.add(int(path.read_text().strip()))
        # Workers the old way lost track of (a hung one its restart left behind).
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if str(self.root).encode() in args or any(
                    a.endswith(b".wrap.sh") and str(self.root).encode() in a for a in args
                ):
                    pids.add(int(entry))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
