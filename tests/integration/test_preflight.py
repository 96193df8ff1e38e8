"""``preflight`` against a real OpenSSH sshd on loopback: a healthy fleet, then each check
failing once, for a real reason (a wrong key, a missing interpreter, a mount the host sees
differently, a full filesystem, a host that never answers).

A host that "sees another filesystem" is an sshd started in its own mount namespace, where
the run root is covered by another directory (or status/ is mounted read-only): the same
path names different files for the host than for us, as on a misconfigured fleet.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from supervisor import preflight
from supervisor.config import Config, parse
from supervisor.preflight import Check, CheckName, Options, Report, Status
from tests import areal as A
from tests import ports
from tests.conftest import mounted_tmpfs
from tests.sshd import WORKER_ARGV, OpenSsh

pytestmark = pytest.mark.openssh

#: Generous per-host time for checks that should pass or fail on their own, not by timing out.
ROOMY = Options(host_timeout_s=30, timeout_s=60, min_free_bytes=1 << 20)
#: For the hang tests: short, since a hung host is what is waited for.
SHORT_S = 1.5


def make_config(server: OpenSsh, root: Path, hosts: int = 1, **overrides: Any) -> Config:
    """A config for ``hosts`` hosts on ``server``, with ``[[hosts]]`` entries patched by
    ``host_<i>={...}`` overrides and the rest passed to ``config_dict``."""
    patches = {k: overrides.pop(k) for k in list(overrides) if k.startswith("host_")}
    raw = server.config_dict(root, hosts, **overrides)
    for key, patch in patches.items():
        raw["hosts"][int(key.removeprefix("host_"))].update(patch)
    return parse(raw, root.parent / "rs.toml")


def quiet_sshd(workdir: Path, **options: Any) -> OpenSsh:
    """An OpenSSH server whose sessions get an empty ``$HOME`` (no rc files, as a service
    account has): root's ``~/.bashrc`` here costs every session ~150 ms of CPU, and these
    tests start a few dozen. What they check does not depend on rc files."""
    home = workdir / "empty-home"
    home.mkdir(parents=True)
    return OpenSsh.create(workdir, extra_config=(f"SetEnv HOME={home}",), **options)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenSsh]:
    """This module's OpenSSH server on the three loopback aliases, sessions without rc files."""
    server = quiet_sshd(tmp_path_factory.mktemp("preflight-sshd"))
    try:
        yield server
    finally:
        server.stop()


async def check(config: Config, options: Options = ROOMY) -> Report:
    """Run preflight as the CLI does, minus the printing."""
    return await preflight.check_fleet(config, options)


def checks_of(report: Report, host: str = "worker-0") -> dict[CheckName, Check]:
    """The checks of ``host``, by name."""
    [row] = [h for h in report.hosts if h.host == host]
    return {c.name: c for c in row.checks}


def assert_only_failing(report: Report, host: str, name: CheckName, code: str) -> None:
    """``name`` fails on ``host`` with ``code``, and no other check of that host fails."""
    found = checks_of(report, host)
    assert (found[name].status, found[name].code) == (Status.FAIL, code), found[name]
    assert [c.name for c in found.values() if c.status is Status.FAIL] == [name]


def leftovers(root: Path) -> list[Path]:
    """Files preflight wrote under ``root`` and did not remove."""
    return sorted(p for p in root.rglob("*") if p.name.startswith(".preflight-"))


async def test_a_healthy_fleet_passes_every_check_and_leaves_no_file(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """Three hosts: every check passes, the clock interval holds the true offset (zero: one
    machine), the module is found where it is, no nonce or probe file remains, and the
    report names every directory it created, the run root's parent included."""
    root = tmp_path / "shared" / "run 1"
    config = make_config(sshd, root, hosts=3)
    report = await check(config)
    assert report.ok, preflight.render(report, ROOMY)
    # Exactly the directories that exist now and did not before, parents first.
    made = [root.parent, root, *(root / d for d in ("ctl", "status", "outbox", "inbox"))]
    made += [root / "inbox" / str(shard) for shard in range(3)]
    assert list(report.created) == [str(p) for p in made]
    assert {str(p) for p in root.parent.rglob("*") if p.is_dir()} | {str(root.parent)} == set(
        report.created
    )
    for host in ("worker-0", "worker-1", "worker-2"):
        found = checks_of(report, host)
        assert [c.status for c in found.values()] == [
            Status.INFO if n is CheckName.CLOCK else Status.OK for n in CheckName
        ]
        assert found[CheckName.PYTHON].values["version"] == platform.python_version()
        module = found[CheckName.MODULE].values
        assert module["module"] == "supervisor.demo.worker"
        assert Path(module["origin"]) == Path(preflight.__file__).parent / "demo" / "worker.py"
        clock = found[CheckName.CLOCK].values
        assert abs(clock["offset_s"]) <= clock["within_s"] + 1e-3
    assert leftovers(root) == []
    assert preflight._prepare(config) == []  # existing directories are not "created"


async def test_a_spare_is_checked_like_a_host(sshd: OpenSsh, tmp_path: Path) -> None:
    """``[[spares]]`` are in the report beside the hosts, every check run on them: a spare
    must be able to serve any shard the moment it is needed; one that cannot be reached
    fails the run as a host would."""
    root = tmp_path / "run"
    raw = sshd.config_dict(root, 1)
    raw["spares"] = [
        {"name": "spare-0", "address": sshd.addresses[1], "port": sshd.port},
        {"name": "spare-1", "address": sshd.addresses[2], "port": ports.reserve(sshd.addresses[2])},
    ]
    report = await check(parse(raw, root.parent / "rs.toml"))
    assert [h.host for h in report.hosts] == ["worker-0", "spare-0", "spare-1"]
    assert all(c.status is not Status.FAIL for c in checks_of(report, "spare-0").values())
    assert checks_of(report, "spare-1")[CheckName.SSH].status is Status.FAIL
    assert not report.ok
    assert leftovers(root) == []


async def test_wrong_host_key_and_refused_login_are_told_apart(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """A host whose key is not the one in known_hosts fails ``ssh`` as ``host_key``; a user
    the host refuses fails it as ``login``; nothing after ``ssh`` is attempted."""
    root = tmp_path / "run"
    wrong_key = make_config(sshd, root, ssh={"known_hosts": str(sshd.wrong_known_hosts)})
    assert_only_failing(await check(wrong_key), "worker-0", CheckName.SSH, "host_key")
    stranger = make_config(sshd, root, hosts=2, host_1={"username": "rs-no-such-user"})
    report = await check(stranger)
    assert checks_of(report, "worker-0")[CheckName.SSH].status is Status.OK
    assert_only_failing(report, "worker-1", CheckName.SSH, "login")
    assert {
        c.status for n, c in checks_of(report, "worker-1").items() if n is not CheckName.SSH
    } == {Status.SKIP}
    assert preflight.failures(report) == ["worker-1: ssh"]


async def test_an_untrusted_host_key_says_which_known_hosts_line_is_missing(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """A host on a port other than 22 that known_hosts has no line for fails ``ssh`` with the
    line it needs, in OpenSSH's ``[address]:port`` form; one whose key differs is told apart
    (a changed key is checked on the host, never replaced blindly)."""
    root = tmp_path / "run"
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    report = await check(make_config(sshd, root, ssh={"known_hosts": str(empty)}))
    detail = checks_of(report)[CheckName.SSH].detail
    assert f"it has no line for '[127.0.0.1]:{sshd.port}'" in detail, detail
    assert "reward-supervisor init --scan" in detail
    wrong = make_config(sshd, root, ssh={"known_hosts": str(sshd.wrong_known_hosts)})
    detail = checks_of(await check(wrong))[CheckName.SSH].detail
    assert f"the key it has for 127.0.0.1 on port {sshd.port} is not the one" in detail, detail


async def test_a_missing_python_fails_python_and_skips_what_needs_it(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """A ``worker.python`` the host does not have fails ``python`` as not found (exit 127);
    module, run root, writability and disk are reported as not checked."""
    config = make_config(sshd, tmp_path / "run", python=str(tmp_path / "no" / "python3"))
    report = await check(config)
    assert_only_failing(report, "worker-0", CheckName.PYTHON, "not_found")
    found = checks_of(report)
    after = list(CheckName)[list(CheckName).index(CheckName.PYTHON) + 1 :]
    assert [found[n].status for n in after] == [Status.SKIP] * len(after)


PYTHON36 = Path.home() / ".pyenv" / "versions" / "3.6.15" / "bin" / "python"
PYTHON37 = Path.home() / ".pyenv" / "versions" / "3.7.16" / "bin" / "python"


@pytest.mark.optional_env
@pytest.mark.skipif(not PYTHON37.exists(), reason="no Python 3.7 interpreter on this machine")
async def test_the_oldest_python_the_agent_runs_on_passes(sshd: OpenSsh, tmp_path: Path) -> None:
    """A host whose ``worker.python`` is 3.7, the agent's oldest, passes every check."""
    argv = [sys.executable, *WORKER_ARGV[1:]]
    report = await check(make_config(sshd, tmp_path / "run", python=str(PYTHON37), argv=argv))
    assert report.ok, preflight.render(report, ROOMY)
    assert checks_of(report)[CheckName.PYTHON].values["version"].startswith("3.7.")


@pytest.mark.optional_env
@pytest.mark.skipif(not PYTHON36.exists(), reason="no Python 3.6 interpreter on this machine")
async def test_a_python_older_than_the_agent_needs_fails_with_its_version(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """A ``worker.python`` that runs but is older than 3.7 (the agent's oldest) fails
    ``python`` as too old."""
    argv = [sys.executable, *WORKER_ARGV[1:]]
    report = await check(make_config(sshd, tmp_path / "run", python=str(PYTHON36), argv=argv))
    assert_only_failing(report, "worker-0", CheckName.PYTHON, "too_old")
    assert checks_of(report)[CheckName.PYTHON].values["version"].startswith("3.6.")


async def test_the_module_is_looked_up_with_worker_env(sshd: OpenSsh, tmp_path: Path) -> None:
    """The module after ``-m`` is found only where ``worker.env`` makes it visible to the
    worker's interpreter: without its PYTHONPATH it fails as ``not_found``, with it it is ok;
    it is located, not run, unless ``--import-module`` (then its import-time error shows)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "rs_preflight_probe.py").write_text("raise SystemExit('never imported')\n")
    argv = ["{python}", "-m", "rs_preflight_probe", "--shard", "{shard}"]
    root = tmp_path / "run"
    without = await check(make_config(sshd, root, argv=argv))
    assert_only_failing(without, "worker-0", CheckName.MODULE, "not_found")
    config = make_config(sshd, root, argv=argv, env={"PYTHONPATH": str(lib)})
    with_env = await check(config)
    assert with_env.ok, preflight.render(with_env, ROOMY)
    found = checks_of(with_env)[CheckName.MODULE]
    assert found.values["origin"] == str(lib / "rs_preflight_probe.py")
    imported = await check(config, replace(ROOMY, import_module=True))
    assert_only_failing(imported, "worker-0", CheckName.MODULE, "import_failed")
    assert "SystemExit: never imported" in checks_of(imported)[CheckName.MODULE].detail


async def test_the_reward_fn_is_looked_up_with_worker_env_and_imported_on_request(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """``run.reward_fn``'s module is found only where ``worker.env`` makes it visible to the
    worker's interpreter (``not_found`` without it); it is located, not imported, unless
    ``--import-module``, which then imports it and needs the function in it
    (``no_function``), and shows the error of a module that raises (``import_failed``)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "rs_reward_probe.py").write_text("def score(*args, **kwargs):\n    return 1.0\n")
    (lib / "rs_reward_broken.py").write_text("raise RuntimeError('a broken reward module')\n")
    root = tmp_path / "run"
    env = {"PYTHONPATH": str(lib)}
    imported = replace(ROOMY, import_module=True)

    def reward(path: str, **overrides: Any) -> Config:
        """The config with ``run.reward_fn`` = ``path``."""
        raw = sshd.config_dict(root, 1, **overrides)
        raw["run"]["reward_fn"] = path
        return parse(raw, root.parent / "rs.toml")

    without = await check(reward("rs_reward_probe.score"))
    assert_only_failing(without, "worker-0", CheckName.REWARD_FN, "not_found")
    assert "No module named 'rs_reward_probe'" in checks_of(without)[CheckName.REWARD_FN].detail
    for how in (ROOMY, imported):
        found = await check(reward("rs_reward_probe.score", env=env), how)
        assert found.ok, preflight.render(found, how)
        check_ = checks_of(found)[CheckName.REWARD_FN]
        assert check_.values["origin"] == str(lib / "rs_reward_probe.py")
    misspelt = reward("rs_reward_probe.scroe", env=env)
    assert (await check(misspelt)).ok  # located only: the module is there
    no_function = await check(misspelt, imported)
    assert_only_failing(no_function, "worker-0", CheckName.REWARD_FN, "no_function")
    assert "has no attribute 'scroe'" in checks_of(no_function)[CheckName.REWARD_FN].detail
    broken = await check(reward("rs_reward_broken.score", env=env), imported)
    assert_only_failing(broken, "worker-0", CheckName.REWARD_FN, "import_failed")
    assert "a broken reward module" in checks_of(broken)[CheckName.REWARD_FN].detail


async def test_the_default_reward_fn_is_one_the_real_worker_has(
    sshd: OpenSsh, tmp_path: Path, areal_fs: Path
) -> None:
    """With the real AReaL worker's package on the path (areal-fs), the default
    ``run.reward_fn`` imports and is a function, while the old default,
    ``areal.reward.gsm8k.gsm8k_reward_fn``, fails ``reward_fn`` as not found."""
    areal = areal_fs
    root = tmp_path / "run"
    raw = sshd.config_dict(root, 1, env=A.worker_env(areal))
    del raw["run"]["reward_fn"]
    config = parse(raw, root.parent / "rs.toml")
    imported = replace(ROOMY, import_module=True)
    report = await check(config, imported)
    assert report.ok, preflight.render(report, imported)
    assert checks_of(report)[CheckName.REWARD_FN].values["origin"].startswith(str(areal))
    old = replace(config, run=replace(config.run, reward_fn="areal.reward.gsm8k.gsm8k_reward_fn"))
    failed = await check(old, imported)
    assert_only_failing(failed, "worker-0", CheckName.REWARD_FN, "not_found")
    assert "areal.reward.gsm8k" in checks_of(failed)[CheckName.REWARD_FN].detail


@pytest.fixture
def tiny_root(tmp_path: Path) -> Iterator[Path]:
    """A run root on a 16 MiB tmpfs (skips where mounting is not allowed)."""
    with mounted_tmpfs(tmp_path / "small-fs", "16m") as mount_point:
        yield mount_point / "run"


async def test_too_little_free_space_on_the_run_root_fails_disk(
    sshd: OpenSsh, tiny_root: Path
) -> None:
    """A run root on a filesystem with less free space than ``--min-free-mb`` fails ``disk``
    as ``low``, with the free bytes the host saw there (at most the tmpfs's 16 MiB)."""
    low = await check(make_config(sshd, tiny_root), Options(min_free_bytes=64 << 20))
    assert_only_failing(low, "worker-0", CheckName.DISK, "low")
    free = checks_of(low)[CheckName.DISK].values["free_bytes"]
    assert 0 < free <= 16 << 20


# --- a host that sees other files at the same path ------------------------------------------


@dataclass
class Namespaced:
    """An sshd whose sessions see the run roots below differently from us."""

    server: OpenSsh
    #: Covered, on the host, by another directory that has ctl/ and status/ of its own.
    elsewhere: Path
    #: Same directory on the host, but its status/ is mounted read-only there.
    read_only_status: Path
    #: Its parent is an empty tmpfs on the host: the root does not exist there.
    unmounted: Path


@pytest.fixture
def namespaced(tmp_path: Path) -> Iterator[Namespaced]:
    """An sshd in a mount namespace of its own (needs root; skips otherwise)."""
    base = tmp_path / "ns"
    elsewhere, other = base / "run-elsewhere", base / "other"
    read_only, unmounted = base / "run-ro", base / "unmounted" / "run"
    for path in (elsewhere, other / "ctl", other / "status", read_only / "status", unmounted):
        path.mkdir(parents=True)
    script = (
        "set -e\n"
        f'mount --bind "{other}" "{elsewhere}"\n'
        f'mount --bind "{read_only / "status"}" "{read_only / "status"}"\n'
        f'mount -o remount,bind,ro "{read_only / "status"}"\n'
        f'mount -t tmpfs none "{unmounted.parent}"\n'
        'exec "$@"\n'
    )
    launcher = ("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh")
    probe = subprocess.run([*launcher, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here (needs root): {probe.stderr.strip()}")
    server = quiet_sshd(base / "sshd", addresses=("127.0.0.1",), launcher=launcher)
    try:
        yield Namespaced(server, elsewhere, read_only, unmounted)
    finally:
        server.stop()


async def test_a_host_that_sees_another_directory_fails_run_root(
    namespaced: Namespaced,
) -> None:
    """Where the run root is another directory on the host, ``run_root`` fails as
    ``different`` (our nonce is not there) and writability and disk are not judged; where it
    does not exist on the host, as ``missing``. Our nonce files are removed either way."""
    for root, code in ((namespaced.elsewhere, "different"), (namespaced.unmounted, "missing")):
        report = await check(make_config(namespaced.server, root))
        assert_only_failing(report, "worker-0", CheckName.RUN_ROOT, code)
        found = checks_of(report)
        assert (found[CheckName.WRITABLE].status, found[CheckName.DISK].status) == (
            Status.SKIP,
            Status.SKIP,
        )
        assert leftovers(root) == []


async def test_status_not_writable_from_the_host_fails_writable(
    namespaced: Namespaced,
) -> None:
    """A status/ the host sees read-only fails ``writable`` for status/ alone; the run root
    itself is the same directory, so ``run_root`` passes."""
    report = await check(make_config(namespaced.server, namespaced.read_only_status))
    assert_only_failing(report, "worker-0", CheckName.WRITABLE, "not_writable")
    assert checks_of(report)[CheckName.WRITABLE].values["failing"] == ["status"]
    assert checks_of(report)[CheckName.RUN_ROOT].status is Status.OK


# --- hosts that never answer ----------------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts TCP connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


async def test_hosts_that_hang_are_reported_hung_within_the_host_timeout(
    sshd: OpenSsh, tmp_path: Path, silent_port: int
) -> None:
    """A host that never finishes the SSH handshake, and one whose python never answers, are
    each reported hung (``ssh`` and ``python`` respectively) once ``--host-timeout`` passes;
    the run ends and leaves no probe file."""
    stalls = tmp_path / "python-that-stalls"
    # Writes a dot now and then: it ends on SIGPIPE once preflight closes the channel.
    stalls.write_text("#!/bin/sh\nwhile printf .; do sleep 0.2; done\n")
    stalls.chmod(0o755)
    root = tmp_path / "run"
    config = make_config(
        sshd,
        root,
        hosts=2,
        python=str(stalls),
        host_1={"address": "127.0.0.1", "port": silent_port},
    )
    report = await check(config, Options(host_timeout_s=SHORT_S, timeout_s=30))
    assert_only_failing(report, "worker-0", CheckName.PYTHON, "hung")
    assert_only_failing(report, "worker-1", CheckName.SSH, "hung")
    assert report.elapsed_s < 30
    assert leftovers(root) == []


def test_hostcheck_source_is_python37_syntax() -> None:
    """hostcheck.py, sent to every host, parses as Python 3.7 (as agent.py must)."""
    import ast

    ast.parse(preflight.hostcheck_source(), feature_version=(3, 7))
    assert os.path.basename(preflight.HOSTCHECK_PATH) == "hostcheck.py"


async def test_a_run_root_that_cannot_be_made_here_stops_before_any_host(
    sshd: OpenSsh, tmp_path: Path
) -> None:
    """A run root whose parent is a file cannot be created on this side: preflight says so
    (LocalProblem) before connecting anywhere."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(preflight.LocalProblem, match="cannot create the run directories"):
        await check(make_config(sshd, blocker / "run"))
