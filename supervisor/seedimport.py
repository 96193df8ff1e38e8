"""``reward-supervisor import-seed``: a config file for a run started by reward_workers_ctl.py.

Reads the seed's ``ctl/launch_meta.json`` (and ``manifest.json`` beside it) and the seed's
environment (``SAO_REWARD_WORKER_HOSTS``, ``SAO_WS``, ``REWARD_ROOT``), and writes the TOML
that makes ``reward-supervisor run`` manage the same workers the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor import config as config_mod
from supervisor import runfiles
from supervisor.errors import ConfigError

# The seed's defaults (reward_workers_ctl.py), kept so an imported run behaves the same.
SEED_WORKER_MODULE = "areal.reward.fs_worker"
SEED_PYTHON_VERSION = "3.12"


class ImportProblem(Exception):
    """The seed run cannot be turned into a config; the message says what is missing."""


def config_from_seed(
    *,
    root: str | None,
    launch_meta: str | None,
    environ: Mapping[str, str],
    known_hosts: str,
    client_keys: Sequence[str] | None,
    username: str | None,
) -> str:
    """The TOML text of a config equivalent to the seed run."""
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
    doc = _document(meta, manifest, environ, known_hosts, client_keys, username)
    text = render_toml(doc)
    try:
        config_mod.parse(doc, Path("<import-seed>"))
    except ConfigError as exc:
        notes = "".join(f"# FIXME: {p.key}: {p.reason}\n" for p in exc.problems)
        text = "# This config does not validate yet; fix the lines marked FIXME.\n" + notes + text
    return text


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
) -> dict[str, Any]:
    ws = environ.get("SAO_WS")
    run: dict[str, Any] = {
        "root": str(meta.get("root", "")),
        "experiment": str(manifest.get("experiment_name", "")),
        "trial": str(manifest.get("trial_name", "")),
        "run_id": str(meta.get("run_id", "")),
        "reward_fn": str(meta.get("reward_fn") or config_mod.DEFAULT_REWARD_FN),
        "shard_count": int(meta.get("shard_count") or 0),
        "forbid_hosts": ["head"],
    }
    if environ.get("REWARD_ROOT"):
        run["cleanup_prefix"] = environ["REWARD_ROOT"]
    if environ.get("SAO_REWARD_WORKER_HOSTS"):
        run["allow_hosts"] = environ["SAO_REWARD_WORKER_HOSTS"].split()
    # The seed keeps everything under $SAO_WS/tmp (a workspace directory, not /tmp).
    scratch = f"{ws}/{'tmp'}" if ws else None
    if scratch:
        run["pointer_file"] = f"{scratch}/sao-reward-current.json"
    worker: dict[str, Any] = {"argv": list(config_mod.DEFAULT_ARGV)}
    env: dict[str, str] = {"AREAL_MATH_VERIFY_SOFT_TIMEOUT": "1"}
    if ws and scratch:
        venv = f"{scratch}/runtime-venv"
        site = f"{venv}/lib/python{SEED_PYTHON_VERSION}/site-packages"
        worker["python"] = f"{venv}/bin/python"
        env.update(
            {
                "PATH": f"/usr/bin:/bin:{venv}/bin:/usr/local/bin",
                "PYTHONPATH": f"{site}:{ws}/repo/AReaL",
                "HOME": f"{scratch}/home",
                "TMPDIR": scratch,
            }
        )
    worker["env"] = env
    health: dict[str, Any] = {"heartbeat_stale_s": 60.0, "restart_cooldown_s": 30.0}
    if meta.get("respawn") is False:
        health["auto_restart"] = False
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
    return {"run": run, "worker": worker, "health": health, "ssh": ssh, "hosts": hosts}


def render_toml(doc: Mapping[str, Any]) -> str:
    """TOML for our config's shapes: tables of scalars and string lists, one nested table
    level (``[worker.env]``) and ``[[hosts]]``. Strings are JSON-escaped, which is valid TOML."""
    lines = ["# Written by `reward-supervisor import-seed`.", ""]
    for section, body in doc.items():
        if section == "hosts":
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
    for host in doc.get("hosts", []):
        lines.append("[[hosts]]")
        lines += [f"{k} = {_value(v)}" for k, v in host.items()]
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
