"""``reward-supervisor``: the command line (DESIGN §7). Parses arguments; the work is elsewhere.

Exit statuses: 0 success; 1 the operation failed; 2 bad usage, an invalid config or an
unknown host; 3 no daemon is running for this config (commands that need one). A failure
has a code beside its message (``refusals.Refusal``, the daemon's and the client's, and
``Failure``, the command line's own); the exit status follows from it (``exit_status``).
With ``--json`` a command prints one JSON object on stdout, ``{"ok": true, ...}`` or
``{"ok": false, "code": CODE, "error": MESSAGE, ...}`` (``events``, ``status --watch`` and
``wait-ready`` print one a line).

A command imports what it needs when it runs: one that only reads a config and asks the
daemon imports no core, no SSH, no logging and no event loop
(``tests/unit/test_cli_imports.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, NoReturn

from supervisor import config as config_mod
from supervisor.errors import ConfigError, ConfigProblem, ControlError
from supervisor.refusals import Refusal
from supervisor.terminal import terminal_text

CONFIG_ENV: Final = "REWARD_SUPERVISOR_CONFIG"
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NO_DAEMON: Final = 3


class Failure(StrEnum):
    """Why a command failed, as a code, where the daemon refused nothing (``Refusal`` is
    what the daemon and the client say)."""

    #: Bad arguments: an unknown option, a bad value, no config given, two given.
    USAGE = "usage"
    #: The config file does not validate.
    INVALID_CONFIG = "invalid_config"
    #: reload: the daemon found the edited file invalid and keeps its previous config.
    RELOAD_REFUSED = "reload_refused"
    #: wait-ready: the fleet was not all ready within ``--timeout``.
    NOT_READY = "not_ready"
    #: handover: no standby took the run lock within ``--timeout``.
    NOT_TAKEN_OVER = "not_taken_over"
    #: stop: the daemon did not exit within ``--timeout``.
    TIMEOUT = "timeout"
    #: preflight: a check failed on some host (``failures`` names each).
    CHECKS_FAILED = "checks_failed"
    #: cleanup: a safety check refused to delete the run directory.
    CLEANUP_REFUSED = "cleanup_refused"


#: The exit status of a failure, by its code; every other code exits ``EXIT_FAILED``.
EXIT_STATUS: Final[Mapping[str, int]] = {
    Failure.USAGE: EXIT_USAGE,
    Failure.INVALID_CONFIG: EXIT_USAGE,
    # The CLI finds an unknown host in the config; the daemon, in its own (a file edited and
    # not reloaded): the same mistake, one status.
    Refusal.UNKNOWN_HOST: EXIT_USAGE,
    Refusal.NO_DAEMON: EXIT_NO_DAEMON,
}


def exit_status(code: str) -> int:
    """The exit status of a failure with ``code``."""
    return EXIT_STATUS.get(code, EXIT_FAILED)


class CliError(Exception):
    """A failure to report (no traceback): its message on stderr, with ``--json`` one JSON
    object on stdout, and an exit status that follows from its code."""

    def __init__(self, message: str, code: str = Refusal.FAILED, *, printed: bool = False) -> None:
        self.code = code
        #: Its JSON line was printed already (``wait-ready``'s phases).
        self.printed = printed
        super().__init__(message)

    @property
    def exit_status(self) -> int:
        """The process's exit status for this failure."""
        return exit_status(self.code)


def failure_json(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """A failure as ``--json`` prints it: ``{"ok": false, "code", "error", ...}``."""
    return {**extra, "ok": False, "code": str(code), "error": message}


class _BadUsage(SystemExit):
    """argparse's usage error, with its message kept for ``--json``."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error says what it was to ``main``."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and exit 2, as argparse does; ``main`` prints the message."""
        self.print_usage(sys.stderr)
        raise _BadUsage(f"{self.prog}: error: {message}")


#: Commands that set up their own logs (run, demo, worker), and commands that log nothing:
#: whatever they import, a path that can log (a file read from the run root, an SSH
#: connection) sets up the logs first (``_logs_to_stderr``). Every other command's library
#: log lines go to stderr from the start.
_OWN_LOGS: Final = frozenset({"run", "demo", "worker"})
_NO_LOGS: Final = frozenset(
    {
        "status",
        "restart-host",
        "stop-host",
        "start-host",
        "drain",
        "undrain",
        "reload",
        "stop",
        "handover",
        "unfreeze",
        "events",
        "wait-ready",
        "alert-rules",
        "dashboard",
    }
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reward-supervisor`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _BadUsage as exc:
        print(exc.message, file=sys.stderr)
        if "--json" in argv:
            print(json.dumps(failure_json(Failure.USAGE, exc.message)))
        raise
    handler: Callable[[argparse.Namespace], int] = args.handler
    if args.command not in _OWN_LOGS | _NO_LOGS:
        _logs_to_stderr()
    try:
        return handler(args)
    except CliError as exc:
        # A daemon's message may quote a host's text.
        print(f"reward-supervisor: {terminal_text(exc)}", file=sys.stderr)
        if getattr(args, "json", False) and not exc.printed:
            print(json.dumps(failure_json(exc.code, str(exc))), flush=True)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130


def _logs_to_stderr() -> None:
    """Library log lines (cleanup's SSH probe connecting, a bad file's warning) go to
    stderr, and only when they matter: stdout is the command's answer, often JSON."""
    from supervisor import logs

    logs.configure("auto", "warning", sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _Parser(
        prog="reward-supervisor",
        description="Keeps a fleet of file-sharded reward workers alive over persistent SSH.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int], help_: str) -> Any:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(handler=handler)
        return p

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-c",
            "--config",
            default=os.environ.get(CONFIG_ENV),
            help=f"config file (default: ${CONFIG_ENV})",
        )

    def with_json(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON instead of text")

    def with_socket(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--control-socket",
            metavar="PATH",
            default=None,
            help="the daemon's control socket instead of the config's [control] socket"
            " (a standby on the leader's machine has one of its own)",
        )

    p = command(
        "init",
        cmd_init,
        "write a starter config for a first fleet, and its known_hosts (keys from a known_hosts"
        " file, or read from the hosts and confirmed); then preflight, run, status",
    )
    p.add_argument(
        "--hosts",
        required=True,
        metavar="HOSTS",
        help="the worker hosts, comma-separated: [NAME=]ADDRESS[:PORT] each (shards in this"
        " order; a host without NAME is named by its address)",
    )
    p.add_argument(
        "--root", required=True, help="run directory: an absolute path every host mounts"
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="the config to write (default ./fleet.toml); its"
        " known_hosts goes beside it, .known_hosts for .toml",
    )
    p.add_argument("--user", default=None, help="login on the hosts (default: you)")
    p.add_argument(
        "--key",
        action="append",
        default=None,
        metavar="PATH",
        help="private key to log in with (default: ~/.ssh/id_ed25519, id_ecdsa or id_rsa)",
    )
    trust = p.add_mutually_exclusive_group()
    trust.add_argument(
        "--known-hosts",
        default=None,
        metavar="FILE",
        help="take the hosts' keys from this known_hosts file, found as OpenSSH finds them"
        " (default ~/.ssh/known_hosts)",
    )
    trust.add_argument(
        "--scan",
        action="store_true",
        help="read the keys from the hosts and show their fingerprints, to confirm",
    )
    p.add_argument(
        "--yes",
        action="store_true",
        help="with --scan: trust the keys read without asking (for scripts; check them first)",
    )
    p.add_argument(
        "--python", default="python3", help="worker.python on the hosts (default python3)"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="worker.env entry, e.g. PYTHONPATH=/opt/areal (repeatable)",
    )
    p.add_argument(
        "--worker-module",
        default="areal.reward.fs_worker",
        metavar="MODULE",
        help="the worker, run as python -m MODULE (default areal.reward.fs_worker)",
    )
    p.add_argument(
        "--reward-fn",
        default=config_mod.DEFAULT_REWARD_FN,
        metavar="FN",
        help="run.reward_fn, the reward fn the trainer's tasks name"
        f" (default {config_mod.DEFAULT_REWARD_FN})",
    )
    p.add_argument(
        "--concurrency",
        type=_int_between(1, 4096),
        default=None,
        metavar="N",
        help="each worker's --concurrency (default 48)",
    )
    p.add_argument("--force", action="store_true", help="replace files that exist")

    p = command("run", cmd_run, "run the daemon in the foreground (systemd runs this)")
    with_config(p)
    _log_args(p)
    p.add_argument(
        "--standby",
        action="store_true",
        help="wait for the run lock when another daemon holds it, and take over when it"
        " comes free (same as [ha] standby = true)",
    )
    with_socket(p)

    p = command("status", cmd_status, "show every host's state, or one host in full")
    with_config(p)
    with_json(p)
    with_socket(p)
    p.add_argument(
        "host",
        nargs="?",
        metavar="HOST",
        help="one host in full: progress, restarts, last exit, evidence, its log's last lines",
    )
    p.add_argument(
        "--lines",
        type=_log_line_count,
        default=20,
        metavar="N",
        help="with HOST: the last N lines of ctl/HOST.log (default 20, 0 for none)",
    )
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=1.0,
        metavar="S",
        help="refresh interval for --watch, seconds (default 1)",
    )

    for name, help_ in (
        ("restart-host", "replace a host's worker now"),
        ("stop-host", "stop a host's worker and keep it stopped (writes ctl/HOST.stop)"),
        ("start-host", "start a stopped or failed host (removes ctl/HOST.stop)"),
    ):
        p = command(name, cmd_host_command, help_)
        with_config(p)
        with_json(p)
        p.add_argument("host", metavar="HOST", help="a host name from the config's [[hosts]]")

    for name, help_ in (
        ("drain", "move a host's shard to a free spare; the host stays out until undrain"),
        ("undrain", "give a drained host back to the pool, as a spare"),
    ):
        p = command(name, cmd_drain, help_)
        with_config(p)
        with_json(p)
        p.add_argument("host", metavar="HOST", help="a host name from [[hosts]] or [[spares]]")

    p = command("reload", cmd_reload, "re-read the config (same as SIGHUP)")
    with_config(p)
    with_json(p)

    p = command("stop", cmd_stop, "stop every worker, then the daemon")
    with_config(p)
    with_json(p)
    with_socket(p)
    p.add_argument("--no-wait", action="store_true", help="return once the stop has begun")
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="seconds to wait for the exit (default: the daemon's stop_grace_s"
        f" + {config_mod.exit_wait_s(0):g})",
    )

    p = command(
        "handover",
        cmd_handover,
        "the leader leaves every worker running and gives the run lock to a standby;"
        " waits until one holds it",
    )
    with_config(p)
    with_json(p)
    with_socket(p)
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="seconds to wait for a standby to take over (default: [ha] confirm_timeout_s)",
    )

    p = command(
        "unfreeze",
        cmd_unfreeze,
        "lift a fleet-wide restart freeze, release crash and probe signatures, and take the"
        " fleet's reward rates now as normal (ends a reward signature)",
    )
    with_config(p)
    with_json(p)

    p = command("events", cmd_events, "follow host state changes as they happen")
    with_config(p)
    with_json(p)

    p = command("wait-ready", cmd_wait_ready, "wait until every host is ready (like seed start)")
    with_config(p)
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        help="give up after this many seconds (default 60); exit 1 (3 if no daemon answered)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the seed\'s JSON lines: {"ok": true, "phase": "manifest", ...} once the'
        ' daemon answers, then {"ok": true, "phase": "ready", "root": ROOT}',
    )
    p.add_argument(
        "--stop-on-timeout",
        action="store_true",
        help="like the seed's start: if the fleet is not ready in time, stop every worker"
        " and the daemon, so a failed start leaves nothing running",
    )

    p = command(
        "check-config",
        cmd_check_config,
        "validate a config file: every problem, exit 2; missing SSH files, settings that cannot"
        " beat the trainer and a run.reward_fn the worker's python here cannot find are warnings",
    )
    # No environment default here: the file given on the command line, either way, must be
    # told apart from the environment's to refuse two different ones.
    p.add_argument("-c", "--config", help=f"config file (default: ${CONFIG_ENV})")
    p.add_argument(
        "config_file",
        metavar="CONFIG",
        nargs="?",
        help="config file, the older form (same as -c CONFIG)",
    )
    with_json(p)

    p = command(
        "preflight",
        cmd_preflight,
        "check every host before the first run: SSH login, python, the worker module,"
        " run.reward_fn, the shared run root, status/ and ctl/ writable, clock, free disk",
    )
    with_config(p)
    with_json(p)
    p.add_argument(
        "--host-timeout",
        type=_positive_seconds,
        default=20.0,
        metavar="S",
        help="seconds per host, connecting included; a host still silent is reported hung"
        " (default 20)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds for the whole run (default 60)",
    )
    p.add_argument(
        "--min-free-mb",
        type=_non_negative_int,
        default=1024,
        metavar="MB",
        help="fail a host that sees less free space on the run root (default 1024)",
    )
    p.add_argument(
        "--import-module",
        action="store_true",
        help="import the worker's module and run.reward_fn's on each host instead of only"
        " locating them, and find the reward function in its module (runs their import-time"
        " code)",
    )

    p = command("cleanup", cmd_cleanup, "delete the run directory (inside cleanup_prefix only)")
    with_config(p)
    p.add_argument("--yes", action="store_true", help="really delete")
    with_json(p)

    p = command("import-seed", cmd_import_seed, "write a config from a reward_workers_ctl.py run")
    p.add_argument("--root", help="seed run root (reads ROOT/ctl/launch_meta.json)")
    p.add_argument("--launch-meta", help="path to a seed launch_meta.json")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument(
        "--known-hosts",
        default="/etc/reward-supervisor/known_hosts",
        help="ssh.known_hosts (default /etc/reward-supervisor/known_hosts)",
    )
    p.add_argument("--client-key", action="append", default=None, help="ssh.client_keys entry")
    p.add_argument("--username", default=None, help="ssh.username (default: the current user)")
    p.add_argument("--ws", default=None, help="the seed's --ws ($SAO_WS): its workspace")
    p.add_argument("--venv", default=None, help="the seed's --venv (default WS/tmp/runtime-venv)")
    p.add_argument("--repo", default=None, help="the seed's --repo (default WS/repo/AReaL)")
    p.add_argument(
        "--pointer-file",
        default=None,
        help="run.pointer_file (default WS/tmp/sao-reward-current.json, as the seed)",
    )

    p = command(
        "disarm-seed",
        cmd_disarm_seed,
        "take over from reward_workers_ctl.py: stop its watch and respawn wrappers (workers"
        " keep running) and remove the stop files its stop wrote",
    )
    with_config(p)
    with_json(p)
    p.add_argument(
        "--dry-run", action="store_true", help="report what would be done; change nothing"
    )
    p.add_argument(
        "--watch-timeout",
        type=_positive_seconds,
        default=120.0,
        help="seconds to wait for the old watch loop to exit (default 120)",
    )

    command(
        "alert-rules",
        cmd_alert_rules,
        "print the Prometheus alert rules shipped with the package (docs/OPERATIONS.md)",
    )
    command(
        "dashboard",
        cmd_dashboard,
        "print the Grafana dashboard shipped with the package (docs/OPERATIONS.md)",
    )

    p = command("demo", cmd_demo, "embedded demo: hosts, faults and recovery, no setup needed")
    p.add_argument(
        "--hosts",
        type=_int_between(2, 64),
        default=4,
        help="number of simulated hosts, 2-64 (default 4)",
    )
    p.add_argument(
        "--duration",
        type=_positive_seconds,
        default=20.0,
        metavar="S",
        help="seconds of task stream (default 20)",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    _log_args(p, default_format="off")

    p = command("worker", cmd_worker, "the reference worker (for demo, tests, benchmarks)")
    p.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the worker's own options: --root R --shard S --host H --concurrency C"
        " [--heartbeat-interval S] [--reward-fn F]",
    )
    return parser


def _non_negative_int(text: str) -> int:
    """An argparse type: a whole number, 0 or more (else a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in ``low..high`` (else a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, not {value}")
        return value

    return parse


#: ``logs.configure``'s levels (a unit test keeps the two lists equal); here so that the
#: parser can refuse a bad one without importing the logging stack for every command.
LOG_LEVELS: Final = ("debug", "info", "warning", "warn", "error", "critical")


def _log_args(p: argparse.ArgumentParser, default_format: str = "auto") -> None:
    choices = ["auto", "json", "console"] + (["off"] if default_format == "off" else [])
    p.add_argument(
        "--log-format",
        choices=choices,
        default=default_format,
        help="log lines as JSON, for a console, or auto: console on a terminal, JSON"
        " otherwise"
        + (
            "; off: the daemon's log goes to a file in the demo's directory"
            if "off" in choices
            else ""
        )
        + f" (default {default_format})",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="least severe level logged (default info)",
    )


# --------------------------------------------------------------------------------------
# Commands


def cmd_init(args: argparse.Namespace) -> int:
    """``init --hosts H --root R``: a starter config and its known_hosts."""
    import getpass

    from supervisor import starter

    def confirm(question: str) -> bool:
        if args.yes:
            print("trusted without asking (--yes)")
            return True
        if not sys.stdin.isatty():
            return False
        return input(question).strip().lower() in ("y", "yes")

    try:
        request = starter.request_from(
            hosts=args.hosts,
            root=args.root,
            output=args.output,
            username=args.user,
            keys=args.key,
            known_hosts=args.known_hosts,
            scan=args.scan,
            python=args.python,
            env=args.env,
            worker_module=args.worker_module,
            reward_fn=args.reward_fn,
            concurrency=args.concurrency,
            force=args.force,
            home=Path.home(),
            user=getpass.getuser(),
        )
        return starter.run(request, say=lambda line: print(terminal_text(line)), confirm=confirm)
    except starter.StarterProblem as exc:
        # The starter says how it failed by an exit status: 2 bad usage, else 1.
        raise CliError(
            str(exc), Failure.USAGE if exc.code == EXIT_USAGE else Refusal.FAILED
        ) from None


def cmd_run(args: argparse.Namespace) -> int:
    """``run -c CONFIG``: the daemon."""
    from supervisor import logs
    from supervisor.daemon import Daemon, run_process
    from supervisor.notify import Notifier

    logs.configure(args.log_format, args.log_level, cache=True, background=True)
    cfg = _load_config(args.config, daemon=True)
    if args.standby:
        cfg = dataclasses.replace(cfg, ha=dataclasses.replace(cfg.ha, standby=True))
    if args.control_socket:
        socket = Path(os.path.abspath(args.control_socket))
        cfg = dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, socket=socket))
    notifier = Notifier()
    # Like sd_notify(unset_environment=1): the variables were meant for us, not for anything
    # we might start (ssh helpers, a local test server's workers).
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(name, None)

    daemons: list[Daemon] = []  # made in the loop; read once it has ended

    async def serve() -> int:
        daemons.append(Daemon(cfg, notifier=notifier))
        return await daemons[0].run()

    run_process(serve, stopped=lambda: {"role": daemons[0].shown_role} if daemons else {})


def cmd_status(args: argparse.Namespace) -> int:
    """``status -c CONFIG [HOST [--lines N]] [--json] [--watch]``: from the daemon, or from
    the files alone."""
    cfg = _load_config(args.config)
    if args.control_socket:
        socket = Path(os.path.abspath(args.control_socket))
        cfg = dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, socket=socket))
    if args.host is not None:
        return _host_status(cfg, args)
    if args.watch:
        return _watch_status(cfg, args)
    status = _status_or_offline(cfg)
    _print_status(status, as_json=args.json)
    return _status_exit(status)


def _status_exit(status: Mapping[str, Any]) -> int:
    """0 when a daemon answered; without one, ``view.offline_exit_status``: 3 not running (it
    stopped cleanly, or none led the run yet), 1 dead (the last one did not stop cleanly),
    0 when a daemon elsewhere holds the run lock."""
    daemon = status.get("daemon") or {}
    if daemon.get("running", True):
        return EXIT_OK
    from supervisor import view

    return view.offline_exit_status(daemon)


def _host_status(cfg: config_mod.Config, args: argparse.Namespace) -> int:
    from supervisor import client, render

    if cfg.host(args.host) is None:
        known = ", ".join(h.name for h in cfg.hosts)
        raise CliError(f"unknown host {args.host!r} (known: {known})", Refusal.UNKNOWN_HOST)
    if args.watch:
        raise CliError("--watch shows every host; leave out HOST", Failure.USAGE)
    # The log's lines, and without a daemon the host's files, are read from the run root,
    # whose readers may log.
    _logs_to_stderr()
    from supervisor import view

    try:
        detail = client.request_sync(cfg.control.socket, "status", host=args.host)
    except ControlError as exc:
        detail = view.offline_host_detail(cfg, args.host)
        detail["daemon"] |= {"why": str(exc), "why_code": exc.code}
    detail["log"] = view.log_lines(cfg, args.host, args.lines)
    if args.json:
        # No "ok" added: read from the files alone, a host's row has its own (the seed's
        # verdict), and its meaning is contract.
        print(json.dumps(detail, indent=2, sort_keys=True))
    else:
        print(render.render_host(detail))
    return _status_exit(detail)


#: Lines of the log a ``status HOST`` may ask for.
MAX_LOG_LINES: Final = 1000


def _log_line_count(text: str) -> int:
    """An argparse type: a number of log lines, 0 to MAX_LOG_LINES."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of lines: {text!r}") from None
    if not 0 <= value <= MAX_LOG_LINES:
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_LOG_LINES}: {text!r}")
    return value


def _status_or_offline(cfg: config_mod.Config) -> dict[str, Any]:
    from supervisor import client

    try:
        return client.request_sync(cfg.control.socket, "status")
    except ControlError as exc:
        _logs_to_stderr()  # the run root's files are read
        from supervisor import view

        status = view.offline_status(cfg)
        status["daemon"] |= {"why": str(exc), "why_code": exc.code}
        return status


def _print_status(status: dict[str, Any], *, as_json: bool) -> None:
    from supervisor import render

    if as_json:
        print(json.dumps({"ok": True, **status}, indent=2, sort_keys=True))
    else:
        print(render.render_table(status))


def _watch_status(cfg: config_mod.Config, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty() and not args.json
    last: dict[str, Any] = {}
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            status = _status_or_offline(cfg)
            if tty:
                print("\x1b[H\x1b[2J", end="")
                _print_status(status, as_json=False)
                print(f"\n(refreshing every {args.interval:g}s; Ctrl-C to quit)", flush=True)
            else:
                for name, row in status.get("hosts", {}).items():
                    brief = {k: row.get(k) for k in ("state", "pid", "ssh", "last_reason")}
                    if last.get(name) != brief:
                        last[name] = brief
                        line = {"host": name, **brief} if args.json else None
                        print(
                            json.dumps(line)
                            if line
                            else terminal_text(
                                f"{name}: {brief['state']} pid={brief['pid']} "
                                f"ssh={brief['ssh']} ({brief['last_reason']})"
                            ),
                            flush=True,
                        )
            time.sleep(args.interval)
    return EXIT_OK


def cmd_host_command(args: argparse.Namespace) -> int:
    """``restart-host|stop-host|start-host -c CONFIG HOST``."""
    cfg = _load_config(args.config)
    if cfg.host(args.host) is None:
        known = ", ".join(h.name for h in cfg.hosts)
        raise CliError(f"unknown host {args.host!r} (known: {known})", Refusal.UNKNOWN_HOST)
    reply = _request(cfg.control.socket, args.command, host=args.host)
    if args.json:
        print(json.dumps({"ok": True, **reply}, indent=2, sort_keys=True))
    elif reply.get("planned"):  # an operator's replacement passes through stale: no fault
        print(terminal_text(f"{args.host}: replacing its worker ({reply.get('last_reason')})"))
    else:
        print(terminal_text(f"{args.host}: {reply.get('state')} ({reply.get('last_reason')})"))
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    """``drain|undrain -c CONFIG HOST``."""
    cfg = _load_config(args.config)
    machines = [h.name for h in cfg.hosts] + [s.name for s in cfg.spares]
    if args.host not in machines:
        known = ", ".join(machines)
        raise CliError(f"unknown host {args.host!r} (known: {known})", Refusal.UNKNOWN_HOST)
    reply = _request(cfg.control.socket, args.command, host=args.host, timeout_s=30.0)
    if args.json:
        print(json.dumps({"ok": True, **reply}, indent=2, sort_keys=True))
    elif args.command == "drain":
        text = f"{reply.get('label')} (shard {reply.get('shard')}) moves to {reply.get('to')}"
        print(terminal_text(f"{text}; {args.host} stays out until undrain"))
    else:
        print(terminal_text(f"{args.host} is a spare again"))
    return EXIT_OK


def cmd_reload(args: argparse.Namespace) -> int:
    """``reload -c CONFIG``: like SIGHUP, but reports the outcome."""
    reply = _request(_socket_of(args.config), "reload", timeout_s=60.0)
    if args.json:
        if reply.get("reloaded"):
            print(json.dumps({"ok": True, **reply}, indent=2, sort_keys=True))
        else:
            why = "reload refused; the daemon keeps running on its previous config"
            refused = failure_json(Failure.RELOAD_REFUSED, why, **reply)
            print(json.dumps(refused, indent=2, sort_keys=True))
    elif reply.get("reloaded"):
        changes = ", ".join(
            f"{k}: {', '.join(reply[k])}" for k in ("added", "removed", "restarted") if reply.get(k)
        )
        print(f"reloaded ({changes or 'no host changes'})")
    else:
        print("reload refused; the daemon keeps running on its previous config:")
        for error in reply.get("errors", []):
            print(f"  {terminal_text(error)}")
    return EXIT_OK if reply.get("reloaded") else exit_status(Failure.RELOAD_REFUSED)


def cmd_stop(args: argparse.Namespace) -> int:
    """``stop -c CONFIG``: stop every worker, then the daemon; waits for it to exit."""
    socket = (
        Path(os.path.abspath(args.control_socket))
        if args.control_socket
        else _socket_of(args.config)
    )
    status = _request(socket, "status")
    reply = _request(socket, "stop")
    if not args.no_wait:
        grace = float(status.get("daemon", {}).get("stop_grace_s") or 60.0)
        _wait_for_exit(socket, args.timeout or config_mod.exit_wait_s(grace))
    if args.json:
        print(json.dumps({"ok": True, **reply, "stopped": not args.no_wait}, sort_keys=True))
    else:
        print("daemon stopped" if not args.no_wait else "daemon stopping")
    return EXIT_OK


def cmd_handover(args: argparse.Namespace) -> int:
    """``handover -c CONFIG``: the leader detaches and releases the run lock; waits until
    another daemon (a standby) holds it, and names it."""
    _logs_to_stderr()  # the run root's lock and epoch are read
    from supervisor import layout, leadership, runfiles

    cfg = _load_config(args.config)
    socket = (
        Path(os.path.abspath(args.control_socket)) if args.control_socket else cfg.control.socket
    )
    reply = _request(socket, "handover")
    old = str(reply.get("leader") or "")
    timeout = args.timeout or cfg.ha.confirm_timeout_s
    run = layout.layout_of(cfg)
    # The old leader's hold-off rule (leadership.py), driven here with a sleep.
    state, actions = leadership.watch_handover(old, time.monotonic(), timeout)
    new = ""
    while True:
        for action in actions:
            if isinstance(action, leadership.HandedOver):
                new = action.leader
        if state.finished or state.deadline_at is None:
            break
        event: leadership.Event = leadership.DeadlinePassed()
        if any(isinstance(a, leadership.LookAtLock) for a in actions):
            event = leadership.LockLooked(
                holder=runfiles.current_holder(run.lock_file, root=run.root)
            )
        else:
            time.sleep(max(0.0, state.deadline_at - time.monotonic()))
        state, actions = leadership.step(state, event, time.monotonic(), cfg.ha)
    epoch = runfiles.read_epoch(run.epoch_file, root=run.root)
    result = {"handed_over": bool(new), "from": old, "to": new or None, "epoch": epoch}
    unclaimed = f"{old} let go of the run, but no standby took it within {timeout:g}s"
    if args.json:
        if new:
            print(json.dumps({"ok": True, **result}, sort_keys=True))
        else:
            print(json.dumps(failure_json(Failure.NOT_TAKEN_OVER, unclaimed, **result)))
    elif new:
        print(terminal_text(f"handed over: {old} -> {new} (epoch {epoch})"))
    else:
        print(terminal_text(unclaimed))
    return EXIT_OK if new else exit_status(Failure.NOT_TAKEN_OVER)


def _wait_for_exit(socket: Path, timeout: float) -> None:
    from supervisor import client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.request_sync(socket, "ping", timeout_s=2.0)
        except ControlError:
            return
        time.sleep(0.1)
    raise CliError(f"the daemon did not exit within {timeout:g}s", Failure.TIMEOUT)


def cmd_unfreeze(args: argparse.Namespace) -> int:
    """``unfreeze -c CONFIG``."""
    reply = _request(_socket_of(args.config), "unfreeze")
    print(json.dumps({"ok": True, **reply}, sort_keys=True) if args.json else "restarts unfrozen")
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    """``events -c CONFIG``: state changes as they happen."""
    import asyncio

    from supervisor import client

    socket = _socket_of(args.config)

    def subscribed() -> None:
        print(f"following events from {socket} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    async def follow() -> None:
        stream = client.follow_events(socket, on_subscribed=subscribed)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                if args.json:
                    print(json.dumps(event, sort_keys=True), flush=True)
                else:
                    print(_event_line(event), flush=True)

    try:
        asyncio.run(follow())
    except ControlError as exc:
        raise CliError(str(exc), exc.code) from None
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK


def _event_line(event: dict[str, Any]) -> str:
    """One event as a terminal line: a host's text in it is escaped, never obeyed."""
    if event.get("event") == "host.state":
        evidence = event.get("evidence")
        taken = ""
        if isinstance(evidence, dict):
            how = f"stacks by {evidence['via']}" if evidence.get("via") else "no stacks"
            taken = (
                f" [evidence of pid {evidence.get('pid')}: {how}; see status {event.get('host')}]"
            )
        return terminal_text(
            f"{event.get('timestamp', '')} {event.get('host')}: {event.get('from')} -> "
            f"{event.get('to')} ({event.get('reason')}){taken}"
        )
    return terminal_text(json.dumps(event, sort_keys=True))


def cmd_wait_ready(args: argparse.Namespace) -> int:
    """``wait-ready -c CONFIG``: exit 0 once the fleet is all ready (every host ready but the
    ones an operator stopped); 1 at the timeout (after
    stopping everything with ``--stop-on-timeout``); 3 if no daemon answered at all."""
    from supervisor import client

    cfg_path = args.config
    socket = _socket_of(cfg_path)
    deadline = time.monotonic() + args.timeout
    status: dict[str, Any] = {}
    answered = False
    while time.monotonic() < deadline:
        try:
            status = client.request_sync(socket, "status")
        except ControlError:
            status = {}
        if status and not answered:
            answered = True
            if args.json:
                _print_phase(_manifest_phase(cfg_path, status))
        hosts = status.get("hosts", {})
        # The fleet core's one meaning of "all ready" (``Fleet.all_ready``): a host an
        # operator stopped is not waited for. A standby's status has none: it leads nothing.
        if status.get("daemon", {}).get("all_ready") is True:
            root = status.get("daemon", {}).get("root")
            if args.json:
                _print_phase({"ok": True, "phase": "ready", "root": root})
            else:
                print(f"all {len(hosts)} hosts ready")
            return EXIT_OK
        time.sleep(0.25)
    if not answered:
        silent = f"no daemon answered on {socket} within {args.timeout:g}s"
        if args.json:
            _print_phase(
                failure_json(Refusal.NO_DAEMON, silent, phase="no_daemon", socket=str(socket))
            )
        raise CliError(silent, Refusal.NO_DAEMON, printed=True)
    waiting = {n: r for n, r in status.get("hosts", {}).items() if r.get("state") != "ready"}
    detail = ", ".join(
        f"{n} ({r.get('state')}: {r.get('last_reason')})" for n, r in waiting.items()
    )
    late = f"not ready within {args.timeout:g}s: {detail}"
    root = status.get("daemon", {}).get("root")
    if args.json:
        not_ready = {
            n: {"state": r.get("state"), "reason": r.get("last_reason")} for n, r in waiting.items()
        }
        _print_phase(
            failure_json(Failure.NOT_READY, late, phase="timeout", root=root, not_ready=not_ready)
        )
    if args.stop_on_timeout:
        _stop_after_failed_start(socket, status, as_json=args.json)
        if status.get("daemon", {}).get("on_exit") == "detach":
            raise CliError(
                f'{late}; stopped the daemon, but run.on_exit = "detach" left its workers running',
                Failure.NOT_READY,
                printed=True,
            )
        raise CliError(f"{late}; stopped everything", Failure.NOT_READY, printed=True)
    raise CliError(late, Failure.NOT_READY, printed=True)


def _print_phase(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def _manifest_phase(cfg_path: str, status: dict[str, Any]) -> dict[str, Any]:
    """The seed's first line, ``{"ok": true, "phase": "manifest", **launch_meta}``: the launch
    meta the daemon writes, computed from the config rather than read back from the run
    root (a file there could be anything, even a FIFO that never answers)."""
    _logs_to_stderr()  # layout's run-file readers may log
    from supervisor import layout

    meta: dict[str, Any] = {"root": status.get("daemon", {}).get("root")}
    with contextlib.suppress(ConfigError):
        meta = layout.launch_meta(config_mod.load(cfg_path))
    return {"ok": True, "phase": "manifest", **meta}


def _stop_after_failed_start(socket: Path, status: dict[str, Any], *, as_json: bool) -> None:
    """``--stop-on-timeout``: stop every worker and the daemon, as the seed's start did."""
    _request(socket, "stop")
    grace = float(status.get("daemon", {}).get("stop_grace_s") or 60.0)
    _wait_for_exit(socket, config_mod.exit_wait_s(grace))
    if as_json:
        root = status.get("daemon", {}).get("root")
        stopped = "not ready in time: stopped every worker and the daemon"
        _print_phase(failure_json(Failure.NOT_READY, stopped, phase="stopped", root=root))


def cmd_check_config(args: argparse.Namespace) -> int:
    """``check-config -c FILE``: every problem and exit 2, or a one-line summary and exit 0;
    warnings (SSH files missing or empty) go to stderr either way."""
    path = _check_config_path(args)
    checked = config_mod.check(path)
    here = None
    warnings = list(checked.warnings)
    if checked.config is not None:
        from supervisor import preflight

        here = preflight.reward_fn_here(checked.config)
        if here.problem is not None:
            warnings.append(ConfigProblem(path, "run.reward_fn", here.problem))
    if args.json:
        report: dict[str, Any] = {
            "ok": checked.config is not None,
            "warnings": [_problem_json(w) for w in warnings],
        }
        if checked.config is None:
            report["problems"] = [_problem_json(p) for p in checked.problems]
            count = len(checked.problems)
            report["code"] = str(Failure.INVALID_CONFIG)
            report["error"] = f"{path}: {count} problem{'s' * (count != 1)}"
        else:
            cfg = checked.config
            report |= {"summary": cfg.summary(), "hosts": len(cfg.hosts)}
            report |= {"shards": cfg.run.shard_count, "root": str(cfg.run.root)}
        if here is not None:
            report["reward_fn"] = here.as_json()
        print(json.dumps(report, sort_keys=True))
        return EXIT_OK if checked.config is not None else exit_status(Failure.INVALID_CONFIG)
    for problem in checked.problems:
        print(problem, file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if checked.config is None:
        count, warned = len(checked.problems), len(warnings)
        also = f", {warned} warning{'s' * (warned != 1)}" if warned else ""
        print(f"{path}: {count} problem{'s' * (count != 1)}{also}", file=sys.stderr)
        return exit_status(Failure.INVALID_CONFIG)
    print(checked.config.summary())
    if here is not None and here.problem is None:
        # A note (not checked here) goes with the warnings; a check that passed, with the summary.
        print(terminal_text(here.line), file=sys.stderr if here.check is None else sys.stdout)
    return EXIT_OK


def _check_config_path(args: argparse.Namespace) -> str:
    """The file to check: the positional (DESIGN §7's form), else ``-c``, else the env."""
    if args.config_file and args.config and args.config_file != args.config:
        raise CliError(
            f"two configs given: {args.config_file} and -c {args.config}; pass one",
            Failure.USAGE,
        )
    path = args.config_file or args.config or os.environ.get(CONFIG_ENV)
    if not path:
        raise CliError(f"no config: pass -c CONFIG or set ${CONFIG_ENV}", Failure.USAGE)
    return str(path)


def _problem_json(problem: ConfigProblem) -> dict[str, str]:
    return {"file": problem.file, "key": problem.key, "reason": problem.reason}


def cmd_preflight(args: argparse.Namespace) -> int:
    """``preflight -c CONFIG``: every host checked at once; exit 1 naming each failing check."""
    from supervisor import logs, preflight

    # Every connection failure is in the report; the library's log lines would repeat it.
    logs.configure("auto", "error", sys.stderr)
    cfg = _load_config(args.config)
    options = preflight.Options(
        host_timeout_s=args.host_timeout,
        timeout_s=args.timeout,
        min_free_bytes=args.min_free_mb * 1024 * 1024,
        import_module=args.import_module,
    )
    try:
        report = preflight.run(cfg, options)
    except preflight.LocalProblem as exc:
        raise CliError(str(exc)) from None
    if args.json:
        found = preflight.as_json(report, options)
        if not report.ok:
            failing = f"preflight failed: {', '.join(preflight.failures(report))}"
            found |= {"code": str(Failure.CHECKS_FAILED), "error": failing}
            print(f"reward-supervisor: {failing}", file=sys.stderr)
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        print(preflight.render(report, options))
    return EXIT_OK if report.ok else exit_status(Failure.CHECKS_FAILED)


def cmd_cleanup(args: argparse.Namespace) -> int:
    """``cleanup -c CONFIG --yes``: delete the run root after every safety check."""
    from supervisor import cleanup

    cfg = _load_config(args.config)
    said: list[str] = []
    # Messages name files under the run root, whose names anyone with write access chose.
    out: Callable[[str], None] = said.append if args.json else _print_escaped
    try:
        code = cleanup.run(cfg, yes=args.yes, out=out)
    except cleanup.Refused as exc:
        if not args.json:
            raise CliError(str(exc), Failure.CLEANUP_REFUSED) from None
        refused = failure_json(Failure.CLEANUP_REFUSED, str(exc), refused=str(exc), messages=said)
        print(json.dumps(refused))
        return exit_status(Failure.CLEANUP_REFUSED)
    if args.json:
        if code == EXIT_OK:
            print(json.dumps({"ok": True, "messages": said}))
        else:
            failed = said[-1] if said else "cleanup failed"
            print(json.dumps(failure_json(Refusal.FAILED, failed, messages=said)))
    return code


def _print_escaped(text: str) -> None:
    print(terminal_text(text))


def cmd_import_seed(args: argparse.Namespace) -> int:
    """``import-seed``: a config for a run started by reward_workers_ctl.py."""
    from supervisor import seedimport

    try:
        imported = seedimport.config_from_seed(
            root=args.root,
            launch_meta=args.launch_meta,
            environ=os.environ,
            known_hosts=args.known_hosts,
            client_keys=args.client_key,
            username=args.username,
            ws=args.ws,
            venv=args.venv,
            repo=args.repo,
            pointer_file=args.pointer_file,
        )
    except seedimport.ImportProblem as exc:
        raise CliError(str(exc), Failure.USAGE) from None
    for note in imported.notes:
        print(f"reward-supervisor: {note}", file=sys.stderr)
    for warning in imported.warnings:
        print(f"reward-supervisor: warning: {warning}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(imported.text, encoding="utf-8")
        print(f"wrote {args.output}; check it with: reward-supervisor check-config {args.output}")
    else:
        print(imported.text, end="")
    return EXIT_OK


def cmd_disarm_seed(args: argparse.Namespace) -> int:
    """``disarm-seed -c CONFIG``: hand the old script's fleet over without stopping a worker."""
    from supervisor import seedmigrate

    cfg = _load_config(args.config)
    report = seedmigrate.run(cfg, dry_run=args.dry_run, watch_timeout_s=args.watch_timeout)
    if args.json:
        found = report.as_json()
        if not report.ok:
            found |= {"code": str(Refusal.FAILED), "error": "disarm-seed did not finish"}
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED


#: The alert rules' file inside the package (package data).
ALERT_RULES: Final = "alerts.yml"


def alert_rules_text() -> str:
    """The Prometheus alert rules shipped with the package, as installed."""
    return _package_text(ALERT_RULES)


def cmd_alert_rules(args: argparse.Namespace) -> int:
    """``alert-rules``: the shipped Prometheus rules on stdout, for a rules directory."""
    sys.stdout.write(alert_rules_text())
    return EXIT_OK


#: The Grafana dashboard's file inside the package (package data).
DASHBOARD: Final = "dashboard.json"


def dashboard_text() -> str:
    """The Grafana dashboard shipped with the package, as installed."""
    return _package_text(DASHBOARD)


def cmd_dashboard(args: argparse.Namespace) -> int:
    """``dashboard``: the shipped Grafana dashboard (JSON) on stdout, to import."""
    sys.stdout.write(dashboard_text())
    return EXIT_OK


def _package_text(name: str) -> str:
    from importlib import resources

    return resources.files("supervisor").joinpath(name).read_text(encoding="utf-8")


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: the embedded demo."""
    from supervisor.demo import run as demo

    return demo.main(
        hosts=args.hosts,
        duration_s=args.duration,
        keep=args.keep,
        log_format=args.log_format,
        log_level=args.log_level,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    """``worker --root R --shard S --host H --concurrency C``: the reference worker."""
    from supervisor.demo import worker

    return worker.main(args.worker_args)


# --------------------------------------------------------------------------------------


def _load_config(path: str | None, *, daemon: bool = False) -> config_mod.Config:
    """The config at ``path``; for a client of the daemon (not ``daemon``), with the control
    socket its daemon is on (``_daemon_socket``)."""
    if not path:
        raise CliError(f"no config: pass -c CONFIG or set ${CONFIG_ENV}", Failure.USAGE)
    try:
        cfg = config_mod.load(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        raise CliError(f"{path} is not a valid config", Failure.INVALID_CONFIG) from None
    if daemon:
        return cfg
    socket = _daemon_socket(config_mod.socket_candidates(cfg), cfg.control.socket)
    return dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, socket=socket))


def _daemon_socket(candidates: Sequence[Path], default: Path) -> Path:
    """Where the daemon is: the default socket's place can change while it runs (a user's
    /run/user/UID comes and goes with their sessions), so each place it may have bound is
    looked in; ``default`` (where it would bind now) when none holds a socket."""
    from supervisor import client

    return client.find_socket(candidates, default)


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 seconds: {text!r}")
    return value


def _socket_of(path: str | None) -> Path:
    """The control socket named by a config, even one that does not validate.

    ``reload`` is how an operator learns why an edited file is refused, so commands that
    only talk to the daemon must not require the file on disk to be valid.
    """
    if not path:
        raise CliError(f"no config: pass -c CONFIG or set ${CONFIG_ENV}", Failure.USAGE)
    with contextlib.suppress(ConfigError):
        cfg = config_mod.load(path)
        return _daemon_socket(config_mod.socket_candidates(cfg), cfg.control.socket)
    candidates = config_mod.sockets_from_raw_file(Path(path))
    default = candidates[0] if len(candidates) == 1 else config_mod.default_socket_path(Path(path))
    return _daemon_socket(candidates, default)


def _request(socket: Path, cmd: str, *, timeout_s: float = 10.0, **args: Any) -> Any:
    from supervisor import client

    try:
        return client.request_sync(socket, cmd, timeout_s=timeout_s, **args)
    except ControlError as exc:
        raise CliError(str(exc), exc.code) from None


if __name__ == "__main__":
    sys.exit(main())
