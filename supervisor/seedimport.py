"""``reward-supervisor import-seed``: a config file for a run started by reward_workers_ctl.py.

Reads the seed's ``ctl/launch_meta.json`` (and ``manifest.json`` beside it), the respawn
wrapper it wrote (``ctl/<host>.wrap.sh``: the interpreter and environment its workers really
run with) and its environment (``SAO_REWARD_WORKER_HOSTS``, ``SAO_WS``, ``REWARD_ROOT``), and
writes the TOML that makes ``reward-supervisor run`` manage the same workers the same way.
Where it has to guess, it says so (``Imported.warnings``, also written into the file).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from supervisor import config as config_mod
from supervisor import runfiles
from supervisor.errors import ConfigError
from supervisor.layout import META_WRITER

# The seed's defaults (reward_workers_ctl.py), kept so an imported run behaves the same.
SEED_WORKER_MODULE = "areal.reward.fs_worker"
#: Its ``--reward-fn`` default, what a launch_meta without one ran with.
SEED_REWARD_FN = "areal.reward.gsm8k.gsm8k_reward_fn"
SEED_PYTHON_VERSION = "3.12"
SEED_POINTER_NAME = "sao-reward-current.json"
#: The seed keeps its scratch files in ``$SAO_WS/tmp``: a workspace directory, not /tmp.
SEED_SCRATCH = "tmp"
#: The seed's wrapper sets these; import-seed copies them into ``worker.env`` verbatim.
WRAP_ENV_KEYS = ("PATH", "PYTHONPATH", "HOME", "TMPDIR")
#: A wrapper script is ~1.5 KiB; reading more would only feed a hostile file.
WRAP_READ_MAX = 64 * 1024
_WRAP_LINE = re.compile(r'^(?:export )?(PY|PATH|PYTHONPATH|HOME|TMPDIR)="([^"$`\\]*)"$')

# The sandbox of the shipped unit (systemd/reward-supervisor@.service), checked against the
# file by the tests: where the daemon may write, and what it cannot see or share.
UNIT_READ_WRITE_PATHS = ("/shared/reward",)
UNIT_HIDDEN_PATHS = ("/home", "/root", "/run/user")  # ProtectHome=yes
UNIT_PRIVATE_PATHS = ("/tmp", "/var/tmp")  # noqa: S108 - PrivateTmp=yes; names, not files we use


class ImportProblem(Exception):
    """The seed run cannot be turned into a config; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class Imported:
    """The config's TOML text, what import-seed had to guess or cannot do for you
    (``warnings``), and what it found out that the seed's own defaults would have got wrong
    (``notes``)."""

    text: str
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime:
    """How the seed's workers run: interpreter, environment, and its workspace (``$SAO_WS``)."""

    python: str | None
    env: dict[str, str]
    ws: str | None
    source: str
    #: What was found out on the way (the venv's Python version), to be said.
    notes: tuple[str, ...] = ()


def config_from_seed(
    *,
    root: str | None,
    launch_meta: str | None,
    environ: Mapping[str, str],
    known_hosts: str,
    client_keys: Sequence[str] | None,
    username: str | None,
    ws: str | None = None,
    venv: str | None = None,
    repo: str | None = None,
    pointer_file: str | None = None,
) -> Imported:
    """The TOML text of a config equivalent to the seed run, and the warnings to show.

    ``ws``, ``venv`` and ``repo`` are the seed's ``--ws``/``--venv``/``--repo``; without them
    the interpreter and environment come from the run's respawn wrapper, else from
    ``$SAO_WS``, else ``python3`` with no ``PYTHONPATH`` (and a warning).
    """
    meta_path = Path(launch_meta) if launch_meta else None
    if meta_path is None and root:
        meta_path = Path(root) / "ctl" / "launch_meta.json"
    if meta_path is None:
        raise ImportProblem("pass --root ROOT or --launch-meta PATH of the seed run")
    try:
        under = Path(root) if root and not launch_meta else None  # ctl/ is the run's, too
        meta = runfiles.read_json(meta_path, root=under, max_bytes=runfiles.META_MAX_BYTES)
    except (OSError, ValueError) as exc:
        raise ImportProblem(f"cannot read the seed run's launch meta: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("workers"), list):
        raise ImportProblem(f"{meta_path} has no 'workers' list")
    run_root = str(meta.get("root") or root or "")
    manifest = _read_manifest(Path(run_root) / "manifest.json")
    warnings: list[str] = []
    auto_restart = _auto_restart(meta, meta_path, warnings)
    runtime = seed_runtime(
        ws=ws,
        venv=venv,
        repo=repo,
        environ=environ,
        wrappers=_wrapper_paths(Path(run_root), meta["workers"]),
        warnings=warnings,
    )
    pointer = pointer_file or (_ws(runtime.ws, SEED_POINTER_NAME) if runtime.ws else None)
    if pointer is None:
        warnings.append(
            f"no pointer file: the seed wrote $SAO_WS/tmp/{SEED_POINTER_NAME} once every"
            " worker was ready; pass --ws or --pointer-file if anything reads it"
        )
    else:
        hint = unit_write_hint(pointer)
        if hint:
            warnings.append(hint)
    doc = _document(meta, manifest, environ, known_hosts, client_keys, username, auto_restart)
    if pointer is not None:
        doc["run"]["pointer_file"] = pointer
    if runtime.python is not None:
        doc["worker"]["python"] = runtime.python
    doc["worker"]["env"] = {**doc["worker"]["env"], **runtime.env}
    text = render_toml(doc)
    head = [f"# Interpreter and environment from {runtime.source}."]
    head += [f"# {note}" for note in runtime.notes]
    head += [f"# WARNING: {w}" for w in warnings]
    try:
        config_mod.parse(doc, Path("<import-seed>"))
    except ConfigError as exc:
        head = ["# This config does not validate yet; fix the lines marked FIXME.", *head]
        head += [f"# FIXME: {p.key}: {p.reason}" for p in exc.problems]
    return Imported(
        text="\n".join(head) + "\n" + text, warnings=warnings, notes=list(runtime.notes)
    )


def _auto_restart(meta: dict[str, Any], meta_path: Path, warnings: list[str]) -> bool | None:
    """``health.auto_restart`` for the run of ``meta``, or None for the default (true).

    The seed's ``"respawn": false`` was its ``--no-respawn``. A run this program wrote says
    ``auto_restart`` (and ``respawn`` alike) since that field exists; before, it wrote
    ``"respawn": false`` whatever its daemon did, so that value means nothing: the run's own
    config, which the meta names, is asked instead.
    """
    if meta.get("supervisor") != META_WRITER:
        return False if meta.get("respawn") is False else None
    config = meta.get("config")
    named = f" ({config})" if isinstance(config, str) and config else ""
    warnings.append(
        f"{meta_path} was written by reward-supervisor, not reward_workers_ctl.py: this run"
        f" has a config of its own{named}; `reward-supervisor run -c` that file rather than"
        " this import if you still have it"
    )
    said = meta.get("auto_restart")
    if isinstance(said, bool):
        return None if said else False
    if isinstance(config, str) and os.path.isabs(config):
        try:
            return None if config_mod.load(config).health.auto_restart else False
        except ConfigError:
            pass
    warnings.append(
        f"{meta_path} does not say whether its daemon restarted workers (this version's"
        ' "respawn": false meant nothing) and its config cannot be read:'
        " health.auto_restart is left at its default, true"
    )
    return None


def seed_runtime(
    *,
    ws: str | None,
    venv: str | None,
    repo: str | None,
    environ: Mapping[str, str],
    wrappers: Sequence[Path],
    warnings: list[str],
) -> Runtime:
    """Where the seed's workers get their interpreter and environment, most trusted first:
    the options, the wrapper the seed wrote (what the running workers really use),
    ``$SAO_WS``, else nothing (``python3``, no ``PYTHONPATH``, and a warning)."""
    if ws or venv or repo:
        ws = ws or environ.get("SAO_WS") or None
        notes: list[str] = []
        python, env = _seed_paths(ws, venv, repo, notes, warnings)
        if not (repo or ws):
            warnings.append(
                "no --repo and no --ws/$SAO_WS: PYTHONPATH lacks the AReaL checkout the seed"
                " put on it ($SAO_WS/repo/AReaL)"
            )
        return Runtime(
            python=python,
            env=env,
            ws=ws,
            source="the --ws/--venv/--repo options",
            notes=tuple(notes),
        )
    for path in wrappers:
        found = read_wrapper(path)
        if found is not None:
            python, env = found
            scratch = PurePosixPath(env.get("TMPDIR", "/"))
            seed_ws = str(scratch.parent) if scratch.name == SEED_SCRATCH else None
            return Runtime(
                python=python, env=env, ws=seed_ws, source=f"the seed's respawn wrapper {path}"
            )
    if environ.get("SAO_WS"):
        notes = []
        python, env = _seed_paths(environ["SAO_WS"], None, None, notes, warnings)
        return Runtime(
            python=python, env=env, ws=environ["SAO_WS"], source="$SAO_WS", notes=tuple(notes)
        )
    warnings.append(
        "SAO_WS is not set, no --ws/--venv/--repo was given and the run has no respawn wrapper"
        " (ctl/<host>.wrap.sh) to read: worker.python is python3 with no PYTHONPATH, which"
        " is not what the seed ran ($SAO_WS/tmp/runtime-venv/bin/python with PYTHONPATH ="
        f" <venv>/lib/python{SEED_PYTHON_VERSION}/site-packages:$SAO_WS/repo/AReaL; the"
        " seed's default $SAO_WS is the directory above its script's). Pass --ws, or"
        " --venv and --repo"
    )
    return Runtime(python=None, env={}, ws=None, source="nowhere (see the warnings)")


def _seed_paths(
    ws: str | None, venv: str | None, repo: str | None, notes: list[str], warnings: list[str]
) -> tuple[str | None, dict[str, str]]:
    """The seed's ``_paths`` and wrapper environment for these ``--ws/--venv/--repo``, with
    the venv's own ``site-packages`` where the seed assumed Python 3.12's."""
    venv = venv or (_ws(ws, "runtime-venv") if ws else None)
    repo = repo or (f"{ws}/repo/AReaL" if ws else None)
    env: dict[str, str] = {}
    python = None
    site = None
    if venv:
        python = f"{venv}/bin/python"
        env["PATH"] = f"/usr/bin:/bin:{venv}/bin:/usr/local/bin"
        site = f"{venv}/lib/python{_venv_version(venv, notes, warnings)}/site-packages"
    pythonpath = [p for p in (site, repo) if p]
    if pythonpath:
        env["PYTHONPATH"] = ":".join(pythonpath)
    if ws:
        env["HOME"] = _ws(ws, "home")
        env["TMPDIR"] = _ws(ws)
    return python, env


#: ``pyvenv.cfg`` is a few lines; reading more would only feed a file that is not one.
PYVENV_READ_MAX = 16 * 1024
_PYVENV_VERSION = re.compile(r"^\s*(?:version|version_info)\s*=\s*(3\.\d+)[.\s]", re.MULTILINE)
_SITE_VERSION = re.compile(r"^python(3\.\d+)$")


def _venv_version(venv: str, notes: list[str], warnings: list[str]) -> str:
    """The venv's Python version ("3.11"), as its ``pyvenv.cfg`` says (``version``, or uv's
    ``version_info``), else as its one ``lib/python3.N`` directory says; the seed's 3.12,
    with a warning, when this machine cannot tell."""
    cfg = os.path.join(venv, "pyvenv.cfg")
    try:
        text = runfiles.read_capped(cfg, PYVENV_READ_MAX)[:PYVENV_READ_MAX].decode(
            "utf-8", "replace"
        )
    except OSError:
        text = ""
    match = _PYVENV_VERSION.search(text + "\n")
    if match:
        version, source = match.group(1), cfg
    else:
        try:
            names = os.listdir(os.path.join(venv, "lib"))
        except OSError:
            names = []
        found = sorted({m.group(1) for m in map(_SITE_VERSION.match, names) if m})
        if len(found) != 1:
            warnings.append(
                f"cannot tell the Python version of {venv} from here (no readable pyvenv.cfg,"
                f" {'no' if not found else 'more than one'} lib/python3.N): PYTHONPATH names"
                f" lib/python{SEED_PYTHON_VERSION}/site-packages, as the seed did; check it"
                f" against `{venv}/bin/python -V`"
            )
            return SEED_PYTHON_VERSION
        version = found[0]
        source = os.path.join(venv, "lib", f"python{version}")
    notes.append(
        f"PYTHONPATH names {venv}/lib/python{version}/site-packages: Python {version}, from"
        f" {source}"
        + (
            ""
            if version == SEED_PYTHON_VERSION
            else f" (not python{SEED_PYTHON_VERSION}, which the seed assumed)"
        )
    )
    return version


def _ws(ws: str, *names: str) -> str:
    """A path in the seed's scratch directory ``$SAO_WS/tmp``."""
    return "/".join([ws, SEED_SCRATCH, *names])


def _wrapper_paths(root: Path, workers: list[Any]) -> list[Path]:
    """The respawn wrapper the seed wrote for each host of the run, in its order."""
    names = [str(w.get("host")) for w in workers if isinstance(w, dict)]
    return [root / "ctl" / f"{name}.wrap.sh" for name in names if "/" not in name]


def read_wrapper(path: Path) -> tuple[str | None, dict[str, str]] | None:
    """``(python, env)`` from a seed wrapper script, or None when there is none that reads
    as one. Read like any file under the run root: no symlink, a regular file, bounded;
    only plain quoted values are taken (nothing a shell would expand)."""
    try:
        data = runfiles.read_capped(path, WRAP_READ_MAX)[:WRAP_READ_MAX]
    except OSError:
        return None
    values: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        match = _WRAP_LINE.match(line.strip())
        if match and match.group(1) not in values:
            values[match.group(1)] = match.group(2)
    if "PY" not in values:
        return None
    env = {k: values[k] for k in WRAP_ENV_KEYS if k in values}
    return values["PY"], env


def unit_write_hint(path: str) -> str | None:
    """What the shipped systemd unit needs to write ``path``, or None when it may already."""
    target = PurePosixPath(os.path.normpath(path))
    directory = target.parent
    if any(_under(target, PurePosixPath(p)) for p in UNIT_READ_WRITE_PATHS):
        return None
    hidden = [p for p in UNIT_HIDDEN_PATHS if _under(target, PurePosixPath(p))]
    if hidden:
        return (
            f"the shipped unit cannot see {hidden[0]} (ProtectHome=yes), so it cannot write"
            f" the pointer file {target}: in a drop-in (systemctl edit reward-supervisor@NAME)"
            f" set ProtectHome=tmpfs and BindPaths={directory}"
        )
    private = [p for p in UNIT_PRIVATE_PATHS if _under(target, PurePosixPath(p))]
    if private:
        return (
            f"the shipped unit has its own {private[0]} (PrivateTmp=yes): a pointer file there"
            " is seen by nobody else; pass --pointer-file with a shared path"
        )
    return (
        f"the shipped unit may write only under {', '.join(UNIT_READ_WRITE_PATHS)}"
        f" (ProtectSystem=strict), not the pointer file {target}: add the line"
        f" ReadWritePaths={directory} to a drop-in (systemctl edit reward-supervisor@NAME)"
    )


def _under(path: PurePosixPath, top: PurePosixPath) -> bool:
    return path == top or top in path.parents


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = runfiles.read_json(path, root=None, max_bytes=runfiles.META_MAX_BYTES)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _document(
    meta: dict[str, Any],
    manifest: dict[str, Any],
    environ: Mapping[str, str],
    known_hosts: str,
    client_keys: Sequence[str] | None,
    username: str | None,
    auto_restart: bool | None,
) -> dict[str, Any]:
    run: dict[str, Any] = {
        "root": str(meta.get("root", "")),
        "experiment": str(manifest.get("experiment_name", "")),
        "trial": str(manifest.get("trial_name", "")),
        "run_id": str(meta.get("run_id", "")),
        "reward_fn": str(meta.get("reward_fn") or SEED_REWARD_FN),
        "shard_count": int(meta.get("shard_count") or 0),
        "forbid_hosts": ["head"],
    }
    if environ.get("REWARD_ROOT"):
        run["cleanup_prefix"] = environ["REWARD_ROOT"]
    if environ.get("SAO_REWARD_WORKER_HOSTS"):
        run["allow_hosts"] = environ["SAO_REWARD_WORKER_HOSTS"].split()
    worker: dict[str, Any] = {
        "argv": list(config_mod.DEFAULT_ARGV),
        "env": {"AREAL_MATH_VERIFY_SOFT_TIMEOUT": "1"},
    }
    # The seed's own thresholds (60 s stale, 30 s cooldown) are what failed its trainers: the
    # health defaults derive from what the trainer's client tolerates instead, which is
    # FSRewardClient's defaults unless the trainer passes others.
    trainer = {"heartbeat_stale_s": 15.0, "task_timeout_s": 30.0}
    health: dict[str, Any] = {}
    if auto_restart is not None:
        health["auto_restart"] = auto_restart
    ssh: dict[str, Any] = {"known_hosts": known_hosts}
    if client_keys:
        ssh["client_keys"] = list(client_keys)
    if username:
        ssh["username"] = username
    hosts = [
        {
            "name": str(w.get("host")),
            "shard": int(w.get("shard", 0)),
            "concurrency": int(w.get("concurrency", 48)),
        }
        for w in meta["workers"]
        if isinstance(w, dict)
    ]
    doc: dict[str, Any] = {"run": run, "worker": worker, "trainer": trainer}
    if health:
        doc["health"] = health
    return {**doc, "ssh": ssh, "hosts": hosts}


def render_toml(doc: Mapping[str, Any]) -> str:
    """TOML for our config's shapes: tables of scalars and string lists, one nested table
    level (``[worker.env]``) and arrays of tables (``[[hosts]]``, ``[[spares]]``). Strings
    are JSON-escaped, which is valid TOML."""
    lines = [
        "# Written by `reward-supervisor import-seed`.",
        "# [trainer] holds FSRewardClient's defaults: set it to what the trainer passes",
        "# (heartbeat_stale_seconds, timeout_seconds); the [health] thresholds derive from it.",
        "",
    ]
    arrays = [k for k, v in doc.items() if isinstance(v, list)]
    for section, body in doc.items():
        if section in arrays:
            continue
        lines.append(f"[{section}]")
        nested = []
        for key, value in body.items():
            if isinstance(value, dict):
                nested.append((key, value))
            else:
                lines.append(f"{key} = {_value(value)}")
        for key, table in nested:
            lines += ["", f"[{section}.{key}]"]
            lines += [f"{k} = {_value(v)}" for k, v in table.items()]
        lines.append("")
    for section in arrays:
        for entry in doc[section]:
            lines.append(f"[[{section}]]")
            lines += [f"{k} = {_value(v)}" for k, v in entry.items()]
            lines.append("")
    return "\n".join(lines)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
