"""Fixtures shared by every test tier.

``openssh``: one real OpenSSH ``sshd`` for the whole session (see ``tests/sshd.py``), listening
on 127.0.0.1, 127.0.0.2 and 127.0.0.3 at one port, with generated keys. Build a config for a
run directory with ``openssh.config(root, hosts=N, ...)``; take the server down with
``openssh.stop()`` and back with ``openssh.start()`` (a test that stops it must start it again,
in a ``finally``); drop established connections with ``openssh.kill_sessions(address)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests import shared
from tests.sshd import OpenSsh

# Machines here are shared and noisy: a test must not fail because generating or running an
# example took long. Correctness checks stay; wall-clock ones (deadline, too_slow) go.
settings.register_profile(
    "reward-supervisor",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("reward-supervisor")


def pytest_configure(config: pytest.Config) -> None:
    """Start from default SIGINT and SIGQUIT whoever launched pytest.

    A background job of a non-interactive shell (``./.ci/run &`` in a script) has both
    ignored, and every process a test starts would inherit that: ``status --watch`` would
    shrug off the SIGINT a test sends it, and signal masks would carry the runner's choice.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def openssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenSsh]:
    """A running OpenSSH server on loopback aliases, stopped at the end of the session."""
    server = OpenSsh.create(tmp_path_factory.mktemp("openssh"))
    try:
        yield server
    finally:
        server.stop()


#: Set by ./dev test (and so CI): a skipped test is a failure unless marked optional_env,
#: because on the CI machine every tool a test needs is installed by the project itself. The
#: one other skip taken is for the team's shared files truly absent (``tests/shared.py``).
STRICT_SKIPS = os.environ.get("REWARD_SUPERVISOR_STRICT_SKIPS") == "1"


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: ``16m``) at ``mount_point`` while in the block;
    skips the test where mounting is not allowed (not root)."""
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@contextlib.contextmanager
def mounted(target: Path, command: list[str]) -> Iterator[Path]:
    """Mount with ``command + [target]`` (made here) while in the block, or skip loudly when
    mounting is not permitted."""
    target.mkdir()
    result = subprocess.run(
        [*command, str(target)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount here ({' '.join(command)}): {result.stderr.strip()}")
    try:
        yield target
    finally:
        _unmount(target)


def pids_of(program: str, argument: str) -> list[int]:
    """Pids whose argv[0] ends with ``program`` and whose argv contains ``argument``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.fsdecode(argv[0]).endswith(program) and os.fsencode(argument) in argv:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def bindfs_mount(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A FUSE mount (bindfs over a fresh directory) at ``tmp_path/fuse`` while in the block,
    and its server's pid, which a test may stop (SIGSTOP) to hang every access to it; skips
    where bindfs is missing."""
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (apt-get install bindfs): FUSE mount test not run")
    backing = tmp_path / "backing"
    backing.mkdir()
    with mounted(tmp_path / "fuse", ["bindfs", "--no-allow-other", str(backing)]) as mount:
        servers = pids_of("bindfs", str(mount))
        assert len(servers) == 1, servers
        yield mount, servers[0]


def _unmount(target: Path) -> None:
    """umount ``target``, waiting while it is busy: a thread just let out of a hung mount
    may still be inside it for a moment."""
    deadline = time.monotonic() + 60
    while True:
        done = subprocess.run(
            ["umount", str(target)], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"umount {target} failed: {done.stderr.strip()}")
        time.sleep(0.05)  # wait-ok: polling interval of a condition loop


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """In strict mode, turn an unexpected skip into a failure that says why it skipped. A skip
    for truly absent shared files (``tests/shared.py``) is expected: it is marked on its report
    instead, for the count at the end of the run."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped:
        return
    if call.excinfo is not None and isinstance(call.excinfo.value, shared.SharedFilesAbsent):
        report.user_properties.append((shared.ABSENT_PROPERTY, call.excinfo.value.name))
        return
    if STRICT_SKIPS and item.get_closest_marker("optional_env") is None:
        report.outcome = "failed"
        report.longrepr = f"skipped in strict mode (CI installs everything): {report.longrepr}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name every test skipped for absent shared files, and say how many loudly, last: a green
    run must not hide them. With ``$REWARD_SUPERVISOR_SHARED_REPORT`` (set by ./dev test), the
    count is appended to that file too, for ./dev to repeat at the very end of its run. Nothing
    at all when none was skipped so."""
    if hasattr(terminalreporter.config, "workerinput"):
        return  # a pytest-xdist worker: its controller has every report and counts them once
    absent = absent_shared_skips(terminalreporter.stats.get("skipped", []))
    if not absent:
        return
    names = sorted({name for _, name in absent})
    terminalreporter.section("skipped: shared files absent (tests/shared.py)", sep="-")
    for nodeid, name in absent:
        terminalreporter.line(f"SKIPPED {nodeid}: no {name}")
    line = shared.summary_line(len(absent), names, sys.version_info[:2])
    terminalreporter.write_line(line, red=True, bold=True)
    target = os.environ.get(shared.REPORT_ENV)
    if target:
        with open(target, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def absent_shared_skips(reports: list[pytest.TestReport]) -> list[tuple[str, str]]:
    """``(node id, files' name)`` of each report of a skip for absent shared files."""
    found = []
    for report in reports:
        for key, value in getattr(report, "user_properties", ()):
            if key == shared.ABSENT_PROPERTY:
                found.append((report.nodeid, str(value)))
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    """The path of Prometheus' ``promtool``; skips without it, which strict mode (./dev test,
    which installs it) turns into a failure."""
    import shutil

    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not found: ./dev setup installs it (Debian's prometheus package)")
    return found


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of Debian's headless-capable ``chromium``; skips without it, which strict
    mode (./dev test, which installs it) turns into a failure."""
    from tests.browser import find_chromium

    found = find_chromium()
    if found is None:
        pytest.skip("chromium not found: ./dev setup installs it (Debian's chromium package)")
    return found


@pytest.fixture(scope="session")
def seed_script() -> Path:
    """``reward_workers_ctl.py``, the script we replace, from ``../shared/seed`` or
    ``$REWARD_SUPERVISOR_SEED``: skips, named, where it is truly absent; fails where it is
    broken (``tests/shared.py``)."""
    return shared.require(shared.SEED)


@pytest.fixture(scope="session")
def areal_fs() -> Path:
    """The areal-fs directory (the real AReaL worker and client), from ``../shared/areal-fs``
    or ``$REWARD_SUPERVISOR_AREAL``: skips, named, where it is truly absent; fails where it is
    broken (``tests/shared.py``)."""
    return shared.require(shared.AREAL)
