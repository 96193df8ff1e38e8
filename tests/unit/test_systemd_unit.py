"""The shipped systemd unit passes ``systemd-analyze verify`` and says what DESIGN asks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import config

UNIT = Path(__file__).parent.parent.parent / "systemd" / "reward-supervisor@.service"


def _directives(text: str) -> dict[str, str]:
    """The unit's ``Key=value`` lines (first occurrence wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), value.strip())
    return out


def test_unit_has_the_directives_the_design_requires() -> None:
    """notify + watchdog + reload by SIGHUP + bounded restarts + a stop timeout above the
    daemon's shutdown bound for the example config."""
    d = _directives(UNIT.read_text())
    assert d["Type"] == "notify"
    assert d["NotifyAccess"] == "main"
    assert d["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert d["Restart"] == "on-failure"
    assert d["WatchdogSec"].endswith("s")
    restart_sec = float(d["RestartSec"].rstrip("s"))
    burst, interval = int(d["StartLimitBurst"]), float(d["StartLimitIntervalSec"])
    assert burst * restart_sec < interval, "the start limit must be reachable"
    example = config.load(UNIT.parent / "example.toml")
    shutdown_s = config.shutdown_timeout_s(example.health.stop_grace_s)
    assert float(d["TimeoutStopSec"].rstrip("s")) > shutdown_s
    for hardening in (
        "NoNewPrivileges",
        "ProtectSystem",
        "ReadWritePaths",
        "ProtectHome",
        "PrivateTmp",
        "RuntimeDirectory",
    ):
        assert hardening in d
    assert d["ProtectSystem"] == "strict"


def test_unit_runs_as_an_unprivileged_user_in_its_sandbox() -> None:
    """A dedicated non-root user and group, no capabilities, no new privileges, a private
    0700 socket directory and the whole sandbox: nothing here may be loosened silently."""
    d = _directives(UNIT.read_text())
    assert d["User"] not in ("", "root", "0")
    assert d["Group"] not in ("", "root", "0")
    assert d["CapabilityBoundingSet"] == ""
    assert d["RuntimeDirectoryMode"] == "0700"
    assert d["UMask"] == "0027"
    for switch in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
    ):
        assert d[switch] == "yes", switch
    assert set(d["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert d["SystemCallFilter"] == "@system-service"
    assert d["SystemCallArchitectures"] == "native"


def test_every_directive_has_a_why_comment() -> None:
    """Each [Service] directive group is preceded by a comment saying why."""
    lines = UNIT.read_text().splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            j = i - 1
            while j >= 0 and "=" in lines[j] and not lines[j].startswith("#"):
                j -= 1
            assert lines[j].startswith("#"), f"no why-comment above {line!r}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_passes_without_warnings(tmp_path: Path) -> None:
    """systemd itself accepts every line (it exits 0 even on unknown keys, so no output either)."""
    binary = Path(sys.executable).with_name("reward-supervisor")
    text = UNIT.read_text().replace("/usr/local/bin/reward-supervisor", str(binary))
    unit = tmp_path / "reward-supervisor@demo.service"
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
    assert result.stderr.strip() == ""
