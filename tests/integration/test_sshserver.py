"""The in-process SSH server, driven by a real asyncssh client with known_hosts enforced."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import stat
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from supervisor.demo.sshserver import LocalSshServer

# Generous: the machine is shared and noisy; a passing test never waits this long.
TIMEOUT_S = 30.0
HOSTS = ("alpha", "beta")

ECHO_AGENT = """
import json, sys
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps({"id": request["id"], "double": request["n"] * 2}), flush=True)
print("agent: stdin closed", file=sys.stderr, flush=True)
"""


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[LocalSshServer]:
    """A server for two fake hosts, closed after the test."""
    async with LocalSshServer(tmp_path / "ssh", HOSTS) as srv:
        yield srv


async def connect(
    server: LocalSshServer, host: str, **overrides: Any
) -> asyncssh.SSHClientConnection:
    """A client connection as the daemon makes it: explicit key and known_hosts, no ssh config."""
    address, port = server.endpoints[host]
    options: dict[str, Any] = {
        "username": server.username,
        "client_keys": [str(server.client_key_path)],
        "known_hosts": str(server.known_hosts_path),
        "config": None,
        "agent_path": None,
        "gss_host": None,
        "connect_timeout": TIMEOUT_S,
    }
    options.update(overrides)
    return await asyncssh.connect(address, port, **options)


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped mid-read
        return False
    return fields[0] != "Z"


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds, polling; fail after TIMEOUT_S."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            # ASYNC110: the conditions live outside the loop (files, /proc, peer state).
            while not predicate():  # noqa: ASYNC110 - nothing to wait on but the condition
                await asyncio.sleep(0.01)  # wait-ok: poll interval of a deadline loop
    except TimeoutError:
        pytest.fail(f"timed out after {TIMEOUT_S}s waiting for {what}")


def is_gone(pid: int) -> bool:
    """True once ``pid`` has no /proc entry at all: dead and reaped."""
    return not Path(f"/proc/{pid}").exists()


def has_pid(path: Path) -> bool:
    """True once ``path`` holds a complete pid line."""
    return path.exists() and path.read_text().endswith("\n")


def kill_quietly(pid: int) -> None:
    """SIGKILL a test's leftover process, if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- keys and files ------------------------------------------------------------------------


async def test_key_files_and_known_hosts_are_written(server: LocalSshServer) -> None:
    """The client key is owner-only and known_hosts has one [127.0.0.1]:port entry per host."""
    assert stat.S_IMODE(server.client_key_path.stat().st_mode) == 0o600
    lines = server.known_hosts_path.read_text().splitlines()
    assert len(lines) == len(HOSTS)
    for host in HOSTS:
        address, port = server.endpoints[host]
        assert address == "127.0.0.1"
        assert any(line.startswith(f"[127.0.0.1]:{port} ssh-ed25519 ") for line in lines)
    assert len({port for _, port in server.endpoints.values()}) == len(HOSTS)


# -- exec ----------------------------------------------------------------------------------


async def test_exec_returns_stdout_stderr_and_exit_status(server: LocalSshServer) -> None:
    """A command's stdout, stderr and exit status reach the client unchanged."""
    async with await connect(server, "alpha") as conn:
        result = await conn.run("echo out; echo err >&2; exit 3", timeout=TIMEOUT_S)
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_status == 3
    assert result.exit_signal is None


async def test_command_runs_through_sh_with_stdin_until_eof(server: LocalSshServer) -> None:
    """The command string goes to /bin/sh -c; client input and its EOF reach the command."""
    async with await connect(server, "alpha") as conn:
        result = await conn.run("tr a-z A-Z | sed 's/^/> /'", input="hello\nworld\n")
    assert result.stdout == "> HELLO\n> WORLD\n"
    assert result.exit_status == 0


async def test_exit_by_signal_is_reported_as_exit_signal(server: LocalSshServer) -> None:
    """A command killed by a signal is reported with exit-signal, not an exit status."""
    async with await connect(server, "alpha") as conn:
        result = await conn.run("kill -KILL $$", timeout=TIMEOUT_S)
    assert result.exit_signal is not None
    assert result.exit_signal[0] == "KILL"
    assert result.returncode == -signal.SIGKILL


async def test_signal_request_reaches_the_command(server: LocalSshServer) -> None:
    """An SSH signal request is delivered to the command's process group."""
    async with (
        await connect(server, "alpha") as conn,
        conn.create_process("echo started; exec sleep 60") as process,
    ):
        assert await process.stdout.readline() == "started\n"
        process.send_signal("TERM")
        result = await process.wait(timeout=TIMEOUT_S)
    assert result.exit_signal is not None
    assert result.exit_signal[0] == "TERM"


async def test_server_environment_is_inherited_and_env_requests_dropped(
    server: LocalSshServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commands see the server's environment; SSH env requests are ignored, as without AcceptEnv."""
    monkeypatch.setenv("SSHSERVER_TEST_MARKER", "from-server")
    async with await connect(server, "alpha") as conn:
        result = await conn.run(
            'echo "$SSHSERVER_TEST_MARKER/${INJECTED-unset}"', env={"INJECTED": "x"}
        )
    assert result.stdout == "from-server/unset\n"


async def test_commands_run_in_their_own_session(server: LocalSshServer) -> None:
    """Like sshd without a pty, the command leads a new session and process group."""
    async with await connect(server, "alpha") as conn:
        result = await conn.run("ps -o pid=,pgid=,sid= -p $$", timeout=TIMEOUT_S)
    pid, pgid, sid = str(result.stdout).split()
    assert pid == pgid == sid
    assert int(sid) != os.getsid(0)


async def test_long_lived_channel_carries_json_lines_both_ways(server: LocalSshServer) -> None:
    """An `exec python -u -c` agent answers JSON-line requests one by one and pipelined."""
    command = f"exec {shlex.quote(sys.executable)} -u -c {shlex.quote(ECHO_AGENT)}"
    async with (
        await connect(server, "alpha") as conn,
        conn.create_process(command) as process,
        asyncio.timeout(TIMEOUT_S),
    ):
        for i in range(20):
            process.stdin.write(json.dumps({"id": i, "n": i}) + "\n")
            answer = json.loads(await process.stdout.readline())
            assert answer == {"id": i, "double": 2 * i}
        process.stdin.write("".join(json.dumps({"id": i, "n": i}) + "\n" for i in range(500)))
        answers = [json.loads(await process.stdout.readline()) for _ in range(500)]
        assert answers == [{"id": i, "double": 2 * i} for i in range(500)]
        process.stdin.write_eof()
        result = await process.wait()
    assert result.exit_status == 0
    assert result.stderr == "agent: stdin closed\n"


async def test_large_transfers_flow_both_ways(server: LocalSshServer) -> None:
    """Megabytes through stdin and back arrive intact (flow control on both pipes)."""
    payload = os.urandom(4 * 1024 * 1024)
    async with await connect(server, "alpha") as conn:
        result = await conn.run("cat", input=payload, encoding=None, timeout=TIMEOUT_S)
    assert result.exit_status == 0
    assert result.stdout == payload


async def test_thirty_concurrent_channels_on_one_connection(
    server: LocalSshServer, tmp_path: Path
) -> None:
    """30 channels open at the same time on one connection all run and report their status."""
    gate = tmp_path / "gate"
    gate.mkdir()
    # Each command waits until all 30 have started, so they really are open at once.
    script = 'touch "$1/$2"; while [ "$(ls "$1" | wc -l)" -lt 30 ]; do sleep 0.01; done; echo "$2"'
    async with await connect(server, "alpha") as conn:
        async with asyncio.timeout(TIMEOUT_S):
            results = await asyncio.gather(
                *(
                    conn.run(f"sh -c {shlex.quote(script)} sh {shlex.quote(str(gate))} {i}")
                    for i in range(30)
                )
            )
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(30)]
    assert all(r.exit_status == 0 for r in results)


async def test_pty_shell_sftp_and_forwarding_are_refused(server: LocalSshServer) -> None:
    """Only exec is served: pty, shell, sftp and port forwarding requests fail."""
    async with await connect(server, "alpha") as conn:
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.create_process("true", term_type="xterm")
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.create_process()
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.start_sftp_client()
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.open_connection("127.0.0.1", server.endpoints["beta"][1])
        assert (await conn.run("echo still fine")).stdout == "still fine\n"


# -- detached commands ---------------------------------------------------------------------


async def test_setsid_command_survives_channel_and_connection_close(
    server: LocalSshServer, tmp_path: Path
) -> None:
    """`setsid -f cmd >log 2>&1 </dev/null` returns at once and outlives the connection."""
    pidfile = shlex.quote(str(tmp_path / "bg.pid"))
    inner = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 60"
    command = f"setsid -f sh -c {shlex.quote(inner)} >/dev/null 2>&1 </dev/null"
    leftovers: list[int] = []
    try:
        async with await connect(server, "alpha") as conn:
            result = await conn.run(command, timeout=TIMEOUT_S)
            assert result.exit_status == 0
        await eventually(lambda: has_pid(tmp_path / "bg.pid"), "the detached command's pid")
        pid = int((tmp_path / "bg.pid").read_text())
        leftovers.append(pid)
        server.drop_connections("alpha")
        await eventually(lambda: server.connection_count("alpha") == 0, "the server-side close")
        assert is_alive(pid)
    finally:
        for pid in leftovers:
            kill_quietly(pid)


async def test_foreground_command_survives_channel_close_and_is_still_reaped(
    server: LocalSshServer,
) -> None:
    """A command whose channel and connection close keeps running, and is reaped when it dies."""
    leftovers: list[int] = []
    try:
        async with await connect(server, "alpha") as conn:
            process = await conn.create_process("echo $$; exec sleep 60 >/dev/null </dev/null")
            line = await process.stdout.readline()
            leftovers.append(int(line))
            process.close()
            await process.wait_closed()
        pid = leftovers[0]
        await eventually(lambda: server.connection_count("alpha") == 0, "the server-side close")
        assert is_alive(pid)
        os.kill(pid, signal.SIGKILL)
        leftovers.clear()
        await eventually(lambda: is_gone(pid), "the killed command to be reaped, not a zombie")
    finally:
        for pid in leftovers:
            kill_quietly(pid)


# -- authentication ------------------------------------------------------------------------


async def test_wrong_client_key_is_refused(server: LocalSshServer) -> None:
    """A key other than the generated client key cannot log in."""
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(asyncssh.PermissionDenied):
        await connect(server, "alpha", client_keys=[stranger])


async def test_other_user_name_is_refused(server: LocalSshServer) -> None:
    """The right key for another user name cannot log in."""
    with pytest.raises(asyncssh.PermissionDenied):
        await connect(server, "alpha", username=f"{server.username}-other")


async def test_unknown_host_key_is_refused_by_the_client(
    server: LocalSshServer, tmp_path: Path
) -> None:
    """A client whose known_hosts holds a different key for the endpoint refuses to connect."""
    _, port = server.endpoints["alpha"]
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"[127.0.0.1]:{port} {other}\n")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        await connect(server, "alpha", known_hosts=str(wrong))
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        await connect(server, "alpha", known_hosts=str(empty))


# -- fault injection -----------------------------------------------------------------------


async def test_dropping_a_host_is_seen_by_its_client_as_connection_loss(
    server: LocalSshServer,
) -> None:
    """drop_connections(host) aborts that host's connections only; a running command gets None."""
    async with await connect(server, "alpha") as alpha, await connect(server, "beta") as beta:
        process = await alpha.create_process("cat")
        process.stdin.write("ping\n")
        assert await process.stdout.readline() == "ping\n"
        assert server.drop_connections("alpha") == 1
        async with asyncio.timeout(TIMEOUT_S):
            await alpha.wait_closed()
            result = await process.wait()
        assert result.exit_status is None  # asyncssh's way of saying "connection lost"
        assert (await beta.run("echo beta")).stdout == "beta\n"
    async with await connect(server, "alpha") as again:
        assert (await again.run("echo back")).stdout == "back\n"


async def test_stop_accepting_refuses_new_connections_until_started_again(
    server: LocalSshServer,
) -> None:
    """A host that stops accepting refuses connections, keeps open ones, and returns on its port."""
    port_before = server.endpoints["alpha"]
    async with await connect(server, "alpha") as existing:
        await server.stop_accepting("alpha")
        assert not server.accepting("alpha")
        with pytest.raises(ConnectionRefusedError):
            await connect(server, "alpha")
        assert (await existing.run("echo kept")).stdout == "kept\n"
        async with await connect(server, "beta") as beta:
            assert (await beta.run("true")).exit_status == 0
        await server.start_accepting("alpha")
    assert server.endpoints["alpha"] == port_before
    async with await connect(server, "alpha") as again:
        assert (await again.run("echo back")).stdout == "back\n"


async def test_aclose_disconnects_clients_and_is_idempotent(tmp_path: Path) -> None:
    """Closing the server ends client connections; closing twice is harmless."""
    srv = LocalSshServer(tmp_path / "ssh", ["solo"])
    await srv.start()
    conn = await connect(srv, "solo")
    try:
        await srv.aclose()
        async with asyncio.timeout(TIMEOUT_S):
            await conn.wait_closed()
        await srv.aclose()
        with pytest.raises(ConnectionRefusedError):
            await connect(srv, "solo")
    finally:
        conn.close()
        await srv.aclose()


async def test_duplicate_host_names_are_refused(tmp_path: Path) -> None:
    """Two hosts with one name would share an endpoint: refused up front."""
    with pytest.raises(ValueError, match="duplicate"):
        LocalSshServer(tmp_path, ["a", "a"])
