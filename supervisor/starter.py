"""``reward-supervisor init``: a starter config for a first real fleet, and its known_hosts.

Owns nothing but the two files it writes (never over an existing one, unless forced). Host
keys come from a known_hosts file the user names, looked up as OpenSSH does, or from the
hosts themselves (``--scan``), shown with their fingerprints and written only once the user
confirms them: a key is never trusted silently. The config it writes is checked the way
``check-config`` checks it before anything is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor import config as config_mod
from supervisor import preflight, remote
from supervisor.errors import RemoteError

#: Private keys ``init`` offers when none is given, in ssh's own order of preference.
DEFAULT_KEY_NAMES: Final = ("id_ed25519", "id_ecdsa", "id_rsa")
#: Hosts scanned at once: below OpenSSH's ``MaxStartups`` burst, as the daemon's handshakes.
SCAN_CONCURRENCY: Final = 8
#: One handshake per key type; a host that answers none within this is reported.
SCAN_TIMEOUT_S: Final = 10.0
#: The config's name when ``-o`` is not given.
DEFAULT_OUTPUT: Final = "fleet.toml"
#: Exit codes, as the CLI's: 1 the operation failed (a host, a key), 2 bad usage.
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


class StarterProblem(Exception):
    """``init`` cannot write the config; the message says why and what to do."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        self.code = code
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Target:
    """One host of the fleet to be: its name (status files, logs), where to reach it."""

    name: str
    address: str
    port: int

    @property
    def known_hosts_name(self) -> str:
        """The name its known_hosts line carries (OpenSSH's form)."""
        return remote.known_hosts_name(self.address, self.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What the command line asked for."""

    hosts: tuple[Target, ...]
    root: Path
    output: Path
    username: str
    client_keys: tuple[Path, ...]
    #: Read the hosts' keys from this file; None: from the hosts themselves (``--scan``).
    known_hosts_from: Path | None
    python: str = "python3"
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    worker_module: str = "areal.reward.fs_worker"
    reward_fn: str = config_mod.DEFAULT_REWARD_FN
    concurrency: int | None = None
    force: bool = False

    @property
    def known_hosts(self) -> Path:
        """The known_hosts file written beside the config."""
        return self.output.with_suffix(".known_hosts")


# --- pure: the command line's words ---------------------------------------------------------


def parse_hosts(text: str) -> tuple[Target, ...]:
    """``[NAME=]ADDRESS[:PORT],...`` (an IPv6 address with a port in brackets, as
    ``[::1]:2222``); a host without a name is named by its address. Raises StarterProblem."""
    targets = tuple(_target(item.strip()) for item in text.split(",") if item.strip())
    if not targets:
        raise StarterProblem("--hosts names no host: pass NAME=ADDRESS[:PORT],...", EXIT_USAGE)
    seen: dict[str, Target] = {}
    for target in targets:
        if target.name in seen:
            raise StarterProblem(
                f"two hosts named {target.name}: name each, as NAME=ADDRESS[:PORT]"
                f" (w0={seen[target.name].address}:{seen[target.name].port},w1=...)",
                EXIT_USAGE,
            )
        seen[target.name] = target
    return targets


def _target(item: str) -> Target:
    name, _, where = item.rpartition("=")
    address, port = _address_port(where)
    if not config_mod.is_valid_address(address):
        raise StarterProblem(f"--hosts: {address!r} is not a host name or address", EXIT_USAGE)
    name = name or address
    if not config_mod.is_valid_host_name(name):
        raise StarterProblem(
            f"--hosts: {name!r} cannot name a host (status/NAME.json): name it, as NAME={where}",
            EXIT_USAGE,
        )
    return Target(name, address, port)


def _address_port(text: str) -> tuple[str, int]:
    """``ADDRESS``, ``ADDRESS:PORT`` or ``[IPV6]:PORT``; port 22 when none is given."""
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else None
        if rest and port_text is None:
            raise StarterProblem(f"--hosts: cannot read {text!r}", EXIT_USAGE)
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
    else:
        address, port_text = text, None  # a name, an IPv4 address or a bare IPv6 one
    if port_text is None:
        return address, remote.DEFAULT_SSH_PORT
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise StarterProblem(f"--hosts: {port_text!r} is not a port (in {text!r})", EXIT_USAGE)
    return address, int(port_text)


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` items as ``worker.env``. Raises StarterProblem."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StarterProblem(f"--env {item!r}: write it KEY=VALUE", EXIT_USAGE)
        env[key] = value
    return env


def default_key(home: Path) -> Path | None:
    """The first of ``~/.ssh/id_ed25519``, ``id_ecdsa``, ``id_rsa`` that exists."""
    for name in DEFAULT_KEY_NAMES:
        candidate = home / ".ssh" / name
        if candidate.is_file():
            return candidate
    return None


# --- pure: the files written ----------------------------------------------------------------


def known_hosts_text(
    targets: Sequence[Target], keys: Mapping[str, Sequence[remote.HostKey]]
) -> str:
    """One line per host key, named as OpenSSH names the host (``[address]:port`` off 22)."""
    lines = ["# Written by `reward-supervisor init`: each host's keys, as OpenSSH looks them up."]
    written: set[str] = set()
    for target in targets:
        for key in keys[target.name]:
            line = f"{target.known_hosts_name} {key.text}"
            if line not in written:  # two names for one address:port need one line
                written.add(line)
                lines.append(line)
    return "\n".join(lines) + "\n"


def config_text(request: Request) -> str:
    """The starter config, every line commented for a first reader."""
    argv = [*config_mod.DEFAULT_ARGV]
    argv[argv.index("-m") + 1] = request.worker_module
    lines = [
        "# reward-supervisor: a starter config, written by `reward-supervisor init`.",
        "# Every key and its default: docs/CONFIG.md. Check an edit with",
        f"#   reward-supervisor check-config {request.output}",
        "",
        "[run]",
        "# The run directory, on the filesystem every host mounts at the same path.",
        f"root = {_toml(str(request.root))}",
        "# The reward fn the trainer's tasks name (a record in manifest.json; preflight checks",
        "# that the workers can import it).",
        f"reward_fn = {_toml(request.reward_fn)}",
        "",
        "[worker]",
        "# What each host runs; each {field} becomes part of one argument, never a shell's.",
        f"argv = [{', '.join(_toml(a) for a in argv)}]",
        "# The hosts' interpreter for the worker (it also runs the supervisor's agent: >= 3.7).",
        f"python = {_toml(request.python)}",
    ]
    if request.env:
        lines += ["", "[worker.env]  # the worker's environment (sent inside the launch)"]
        lines += [f"{_toml_key(k)} = {_toml(v)}" for k, v in request.env.items()]
    lines += [
        "",
        "[trainer]",
        "# What the trainer passes its FSRewardClient: the [health] defaults derive from it, so",
        "# that a worker is mended before the trainer's calls fail.",
        "heartbeat_stale_s = 15    # FSRewardClient(heartbeat_stale_seconds=15)",
        "task_timeout_s = 30       # FSRewardClient(timeout_seconds=30)",
        "",
        "[ssh]",
        f"username = {_toml(request.username)}",
        "# Keys are read from here only (not from ~/.ssh or an agent).",
        f"client_keys = [{', '.join(_toml(str(k)) for k in request.client_keys)}]",
        "# Host keys are always checked, as OpenSSH checks them; an unknown or changed one is",
        "# refused.",
        f"known_hosts = {_toml(str(request.known_hosts))}",
        "",
        "# No [control] socket: the daemon listens on a private default of this user's",
        "# (/run/reward-supervisor, /run/user/UID or /tmp/reward-supervisor-UID: docs/CONFIG.md),",
        "# logs where (control.listening), and status and the other commands find it.",
    ]
    for shard, target in enumerate(request.hosts):
        lines += ["", "[[hosts]]", f"name = {_toml(target.name)}"]
        if target.address != target.name:
            lines.append(f"address = {_toml(target.address)}")
        if target.port != remote.DEFAULT_SSH_PORT:
            lines.append(f"port = {target.port}")
        lines.append(f"shard = {shard}")
        if request.concurrency is not None:
            lines.append(f"concurrency = {request.concurrency}")
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    """``key`` bare where TOML allows it (``PYTHONPATH``), else quoted."""
    return (
        key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) else _toml(key)
    )


def _toml(text: str) -> str:
    """``text`` as a TOML basic string: quote, backslash and control characters escaped."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def next_steps(config: Path) -> list[str]:
    """The commands that take the new config to a ready fleet, each with what it does."""
    steps = [
        ("preflight", "every host: login, python, worker, reward fn, run root"),
        ("run", "the daemon, in the foreground (Ctrl-C stops the fleet)"),
        ("status", "from another terminal: is every host ready?"),
    ]
    commands = [f"reward-supervisor {name} -c {config}" for name, _ in steps]
    width = max(len(c) for c in commands)
    return ["next:"] + [
        f"  {command.ljust(width)}  # {why}"
        for command, (_, why) in zip(commands, steps, strict=True)
    ]


def key_table(targets: Sequence[Target], keys: Mapping[str, Sequence[remote.HostKey]]) -> list[str]:
    """One line per host key: host, the name it is trusted under, type, fingerprint."""
    rows = [
        (t.name, t.known_hosts_name, k.algorithm, k.fingerprint)
        for t in targets
        for k in keys[t.name]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    ]


# --- I/O ------------------------------------------------------------------------------------


def keys_from_file(path: Path, targets: Sequence[Target]) -> dict[str, list[remote.HostKey]]:
    """Each host's keys in ``path``, found as OpenSSH finds them. Raises StarterProblem
    naming every host the file has no key for, and the line it needs."""
    try:
        keys = {t.name: remote.known_host_keys(path, t.address, t.port) for t in targets}
    except FileNotFoundError:
        raise StarterProblem(
            f"no {path}: pass --scan to read the keys from the hosts (and confirm them), or"
            " --known-hosts FILE"
        ) from None
    except (OSError, ValueError) as exc:
        raise StarterProblem(f"cannot read {path}: {exc}") from None
    missing = [t for t in targets if not keys[t.name]]
    if missing:
        named = ", ".join(f"{t.name} ('{t.known_hosts_name}')" for t in missing)
        raise StarterProblem(
            f"{path} has no host key for {named}; OpenSSH would not trust "
            f"{'it' if len(missing) == 1 else 'them'} either: connect once with ssh and check"
            " the fingerprint, or pass --scan to read the keys from the hosts and confirm them"
        )
    return keys


def scan(targets: Sequence[Target]) -> dict[str, list[remote.HostKey]]:
    """Each host's keys, read from the host (``remote.scan_host_keys``). Raises
    StarterProblem naming every host that showed none, and why."""
    return asyncio.run(_scan(targets))


async def _scan(targets: Sequence[Target]) -> dict[str, list[remote.HostKey]]:
    slots = asyncio.Semaphore(SCAN_CONCURRENCY)

    async def one(target: Target) -> list[remote.HostKey] | str:
        async with slots:
            try:
                return await remote.scan_host_keys(target.address, target.port, SCAN_TIMEOUT_S)
            except RemoteError as exc:
                return str(exc)

    found = await asyncio.gather(*(one(t) for t in targets))
    failed = [
        f"{t.name} ({why})" for t, why in zip(targets, found, strict=True) if isinstance(why, str)
    ]
    if failed:
        raise StarterProblem(f"no host key from {'; '.join(failed)}: is sshd listening there?")
    return {
        t.name: keys for t, keys in zip(targets, found, strict=True) if not isinstance(keys, str)
    }


def run(request: Request, say: Callable[[str], None], confirm: Callable[[str], bool]) -> int:
    """Gather the host keys, write known_hosts and the config, say what to run next.

    Raises StarterProblem: an output file exists, a key is missing, a host has no key, the
    scanned keys were not confirmed.
    """
    _check_outputs(request)
    _check_client_keys(request.client_keys)
    if request.known_hosts_from is None:
        keys = scan(request.hosts)
        say("host keys read from the hosts; compare each fingerprint with the host's own")
        say("(on the host: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub):")
        for line in key_table(request.hosts, keys):
            say(line)
        if not confirm("are these the hosts' keys? [y/N] "):
            raise StarterProblem(
                "host keys not confirmed: nothing written. Check the fingerprints above, then"
                " run init again on a terminal and answer y (or with --yes, in a script)"
            )
        source = "read from the hosts, confirmed"
    else:
        keys = keys_from_file(request.known_hosts_from, request.hosts)
        source = f"from {request.known_hosts_from}"
    text = config_text(request)
    _check_config(request, text, known_hosts_text(request.hosts, keys))
    _write(request.known_hosts, known_hosts_text(request.hosts, keys), request.force)
    _write(request.output, text, request.force)
    count = sum(len(k) for k in keys.values())
    say(
        f"wrote {request.output} ({len(request.hosts)} host{'s' * (len(request.hosts) != 1)},"
        f" shards 0-{len(request.hosts) - 1}) and {request.known_hosts} ({count} host"
        f" key{'s' * (count != 1)}, {source})"
    )
    # As check-config would go on: the reward fn, where the worker's python is here too.
    here = preflight.reward_fn_here(config_mod.load(request.output))
    say("check-config: no problems" + (", 1 warning:" if here.problem else ""))
    say(f"warning: run.reward_fn: {here.problem}" if here.problem else here.line)
    for line in next_steps(request.output):
        say(line)
    return 0


def _check_outputs(request: Request) -> None:
    for path in (request.output, request.known_hosts):
        if os.path.lexists(path) and not request.force:
            raise StarterProblem(f"{path} exists; pick another -o, or pass --force to replace it")


def _check_client_keys(paths: Sequence[Path]) -> None:
    if not paths:
        raise StarterProblem(
            "no SSH key: pass --key PATH (make one with ssh-keygen -t ed25519, and add its .pub"
            " to ~/.ssh/authorized_keys of the login on every host)",
            EXIT_USAGE,
        )
    for path in paths:
        if not os.access(path, os.R_OK) or not path.is_file():
            raise StarterProblem(f"--key {path}: no readable file there", EXIT_USAGE)


def _check_config(request: Request, text: str, known_hosts: str) -> None:
    """The config as check-config sees it, its known_hosts in place: no problem, no warning.
    A failure here is init's own bug, or a value from the command line (a root, a user
    name) that the config refuses: either way nothing is written."""
    with tempfile.TemporaryDirectory(prefix="rs-init-") as scratch:
        trial = Path(scratch) / request.output.name
        trial_known = Path(scratch) / request.known_hosts.name
        trial.write_text(text.replace(str(request.known_hosts), str(trial_known)), "utf-8")
        trial_known.write_text(known_hosts, "utf-8")
        checked = config_mod.check(trial)
    said = [*checked.problems, *checked.warnings]
    if said:
        reasons = "; ".join(f"{p.key}: {p.reason}" for p in said)
        raise StarterProblem(f"the config would not pass check-config: {reasons}", EXIT_USAGE)


def _write(path: Path, text: str, force: bool) -> None:
    """``path`` written whole or not at all; an existing one replaced only with ``force``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temp, 0o644)
        if force:
            os.replace(temp, path)
        else:
            os.link(temp, path)  # fails if a file appeared there meanwhile
            os.unlink(temp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def request_from(
    *,
    hosts: str,
    root: str,
    output: str | None,
    username: str | None,
    keys: Sequence[str] | None,
    known_hosts: str | None,
    scan: bool,
    python: str,
    env: Sequence[str],
    worker_module: str,
    reward_fn: str,
    concurrency: int | None,
    force: bool,
    home: Path,
    user: str,
) -> Request:
    """The Request of the command line's options (paths made absolute; the defaults filled
    in: ``~/.ssh/id_ed25519`` or the like, ``~/.ssh/known_hosts``). Raises StarterProblem."""
    if not os.path.isabs(root):
        raise StarterProblem(f"--root {root}: give the absolute path every host mounts", EXIT_USAGE)
    if scan and known_hosts:
        raise StarterProblem("--scan and --known-hosts: pick one", EXIT_USAGE)
    given_keys = [_absolute(k) for k in keys or ()]
    if not given_keys and (found := default_key(home)) is not None:
        given_keys = [found]
    source = None
    if not scan:
        source = _absolute(known_hosts or str(home / ".ssh" / "known_hosts"))
    return Request(
        hosts=parse_hosts(hosts),
        root=Path(os.path.normpath(root)),
        output=Path(os.path.abspath(output or DEFAULT_OUTPUT)),
        username=username or user,
        client_keys=tuple(given_keys),
        known_hosts_from=source,
        python=python,
        env=parse_env(env),
        worker_module=worker_module,
        reward_fn=reward_fn,
        concurrency=concurrency,
        force=force,
    )


def _absolute(path: str) -> Path:
    """``path`` with ``~`` expanded, absolute (the daemon may run from another directory)."""
    return Path(os.path.abspath(os.path.expanduser(path)))
