"""``import-seed``: where the seed's workers get their interpreter and environment, the
pointer file the shipped unit can write, and a warning wherever it has to guess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import load, trainer_warnings
from supervisor.layout import write_run_files
from supervisor.seedimport import render_toml

# What reward_workers_ctl.py writes into ctl/<host>.wrap.sh (its _start_one_host), trimmed
# to the lines import-seed reads plus the loop it runs.
WRAPPER = """#!/usr/bin/env bash
set +e
STOP="{root}/ctl/worker-0.stop"
PY="/srv/ws/tmp/runtime-venv/bin/python"
MOD="areal.reward.fs_worker"
export PATH="/usr/bin:/bin:/srv/ws/tmp/runtime-venv/bin:/usr/local/bin"
export PYTHONPATH="/srv/ws/tmp/runtime-venv/lib/python3.12/site-packages:/srv/ws/repo/AReaL"
export HOME="/srv/ws/tmp/home"
export TMPDIR="/srv/ws/tmp"
export AREAL_MATH_VERIFY_SOFT_TIMEOUT=1
while [ ! -f "$STOP" ]; do
  "$PY" -m "$MOD" --root "$ROOT" --shard "$SHARD" --host "$HOST" --concurrency "$CONC"
done
"""


def seed_run(tmp_path: Path) -> Path:
    """A seed run directory: launch_meta.json and manifest.json as the seed writes them."""
    root = tmp_path / "reward" / "run-7"
    (root / "ctl").mkdir(parents=True)
    meta = {
        "root": str(root),
        "run_id": "run-7",
        "workers": [{"host": "worker-0", "shard": 0, "concurrency": 48}],
        "shard_count": 1,
        "reward_fn": "areal.reward.gsm8k.gsm8k_reward_fn",
        "respawn": True,
    }
    (root / "ctl" / "launch_meta.json").write_text(json.dumps(meta))
    (root / "manifest.json").write_text(json.dumps({"experiment_name": "e", "trial_name": "t"}))
    return root


def import_seed(root: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``reward-supervisor import-seed --root ROOT -o OUT ARGS`` with only ``env`` set of
    the seed's variables."""
    environ = {k: v for k, v in os.environ.items() if k not in ("SAO_WS", "REWARD_ROOT")}
    environ.update(env)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "supervisor.cli", "import-seed", "--root", str(root)),
            *("-o", str(out), "--known-hosts", str(out.parent / "known_hosts"), *args),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environ,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_without_sao_ws_it_warns_and_says_what_to_pass(tmp_path: Path) -> None:
    """No $SAO_WS, no options, no wrapper: python3 and no PYTHONPATH as before, but now
    with a warning on stderr and in the file, and no pointer file (also said)."""
    root = seed_run(tmp_path)
    out = tmp_path / "run.toml"
    result = import_seed(root, out)
    assert "warning: SAO_WS is not set" in result.stderr
    assert "--ws" in result.stderr and "--venv" in result.stderr
    assert "warning: no pointer file" in result.stderr
    text = out.read_text()
    assert "# WARNING: SAO_WS is not set" in text
    cfg = load(out)
    assert cfg.worker.python == "python3"
    assert "PYTHONPATH" not in cfg.worker.env
    assert cfg.run.pointer_file is None


def test_the_imported_config_names_the_trainer_client_and_beats_it(tmp_path: Path) -> None:
    """The file has a [trainer] table with FSRewardClient's defaults, and the health settings
    derived from it, not the seed's 60 s stale limit, which the trainer could never wait out."""
    root = seed_run(tmp_path)
    out = tmp_path / "run.toml"
    import_seed(root, out, "--ws", "/data/ws")
    assert "[trainer]" in out.read_text()
    cfg = load(out)
    assert (cfg.trainer.heartbeat_stale_s, cfg.trainer.task_timeout_s) == (15.0, 30.0)
    assert cfg.health.heartbeat_stale_s == 5.0
    assert trainer_warnings(cfg) == []


def test_ws_venv_and_repo_options_set_the_interpreter_environment_and_pointer(
    tmp_path: Path,
) -> None:
    """--ws/--venv/--repo mean what they meant to the seed, but with the venv's own Python
    version (a 3.11 venv's site-packages, not the seed's python3.12), said on stderr and in
    the file; a pointer outside the unit's writable paths comes with the ReadWritePaths=
    line to add."""
    root = seed_run(tmp_path)
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.9\n")
    out = tmp_path / "run.toml"
    result = import_seed(root, out, "--ws", "/data/ws", "--venv", str(venv), "--repo", "/src/AReaL")
    cfg = load(out)
    assert cfg.worker.python == f"{venv}/bin/python"
    assert cfg.worker.env["PYTHONPATH"] == f"{venv}/lib/python3.11/site-packages:/src/AReaL"
    said = f"Python 3.11, from {venv}/pyvenv.cfg (not python3.12, which the seed assumed)"
    assert said in result.stderr
    assert said in out.read_text()
    assert cfg.worker.env["HOME"] == "/data/ws/tmp/home"
    assert cfg.run.pointer_file == Path("/data/ws/tmp/sao-reward-current.json")
    assert "ReadWritePaths=/data/ws/tmp" in result.stderr
    assert "SAO_WS is not set" not in result.stderr


def test_the_seeds_wrapper_is_what_its_workers_run_and_wins_over_sao_ws(tmp_path: Path) -> None:
    """With a respawn wrapper in ctl/, its interpreter and environment are taken verbatim
    (a changed $SAO_WS does not matter); a pointer under the unit's writable path needs no
    drop-in."""
    root = seed_run(tmp_path)
    (root / "ctl" / "worker-0.wrap.sh").write_text(WRAPPER.format(root=root))
    out = tmp_path / "run.toml"
    result = import_seed(
        root,
        out,
        "--pointer-file",
        "/shared/reward/pointers/run-7.json",
        SAO_WS="/somewhere/else",
    )
    cfg = load(out)
    assert cfg.worker.python == "/srv/ws/tmp/runtime-venv/bin/python"
    assert cfg.worker.env["PYTHONPATH"].endswith(":/srv/ws/repo/AReaL")
    assert cfg.worker.env["TMPDIR"] == "/srv/ws/tmp"
    assert cfg.worker.env["AREAL_MATH_VERIFY_SOFT_TIMEOUT"] == "1"
    assert cfg.run.pointer_file == Path("/shared/reward/pointers/run-7.json")
    assert result.stderr == ""
    assert f"respawn wrapper {root}/ctl/worker-0.wrap.sh" in out.read_text()


def test_a_wrapper_that_is_a_symlink_is_not_read(tmp_path: Path) -> None:
    """Files under the run root are hostile: a symlinked wrapper is ignored, and $SAO_WS
    decides; without the seed's pointer default under /shared/reward, the hint says so."""
    root = seed_run(tmp_path)
    elsewhere = tmp_path / "elsewhere.sh"
    elsewhere.write_text(WRAPPER.format(root=root))
    (root / "ctl" / "worker-0.wrap.sh").symlink_to(elsewhere)
    out = tmp_path / "run.toml"
    result = import_seed(root, out, SAO_WS="/ws")
    cfg = load(out)
    assert cfg.worker.python == "/ws/tmp/runtime-venv/bin/python"
    assert "ReadWritePaths=/ws/tmp" in result.stderr


def write_our_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, health: dict[str, object]
) -> tuple[Path, Path]:
    """A run directory as ``reward-supervisor run`` writes it (``write_run_files``), from a
    config file loaded by a relative path; the run root and the config's absolute path."""
    root = tmp_path / "reward" / "run-9"
    config = tmp_path / "rs.toml"
    raw = {
        "run": {"root": str(root), "run_id": "run-9"},
        "health": health,
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "hosts": [{"name": "worker-0", "shard": 0}],
    }
    config.write_text(render_toml(raw))
    with monkeypatch.context() as patched:
        patched.chdir(tmp_path)
        write_run_files(load("rs.toml"))
    return root, config


@pytest.mark.parametrize("auto_restart", [True, False])
def test_a_run_this_program_wrote_is_read_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auto_restart: bool
) -> None:
    """Our own launch_meta says what our daemon does (``respawn`` and ``auto_restart``: it
    restarts workers unless told not to) and names its config by an absolute path;
    import-seed of that run keeps auto_restart as it was and says the run has a config."""
    root, config = write_our_run(tmp_path, monkeypatch, {"auto_restart": auto_restart})
    meta = json.loads((root / "ctl" / "launch_meta.json").read_text())
    assert (meta["respawn"], meta["auto_restart"]) == (auto_restart, auto_restart)
    assert meta["config"] == str(config)
    out = tmp_path / "imported.toml"
    result = import_seed(root, out, SAO_WS="/ws")
    assert load(out).health.auto_restart is auto_restart
    assert "written by reward-supervisor, not reward_workers_ctl.py" in result.stderr
    assert "`reward-supervisor run -c` that file" in result.stderr
    assert str(config) in result.stderr


def test_an_earlier_versions_respawn_false_is_not_believed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier versions wrote ``"respawn": false`` whatever their daemon did: without
    ``auto_restart`` in the meta, the run's config decides, and where it cannot be read the
    default (restart) stays, with a warning that says why."""
    root, config = write_our_run(tmp_path, monkeypatch, {})
    meta_path = root / "ctl" / "launch_meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["auto_restart"]
    meta["respawn"] = False
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "imported.toml"
    result = import_seed(root, out, SAO_WS="/ws")
    assert load(out).health.auto_restart is True
    assert "does not say whether" not in result.stderr
    config.unlink()
    result = import_seed(root, out, SAO_WS="/ws")
    assert load(out).health.auto_restart is True
    assert "health.auto_restart is left at its default, true" in result.stderr


def test_the_seeds_no_respawn_still_means_no_automatic_restart(tmp_path: Path) -> None:
    """A run the seed started with ``--no-respawn`` (``"respawn": false``, no ``supervisor``
    field) is imported with ``health.auto_restart = false``, and no word of a config."""
    root = seed_run(tmp_path)
    meta_path = root / "ctl" / "launch_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["respawn"] = False
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "imported.toml"
    result = import_seed(root, out, SAO_WS="/ws")
    assert load(out).health.auto_restart is False
    assert "reward-supervisor, not" not in result.stderr
