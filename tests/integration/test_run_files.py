"""The run directory's metadata files: the seed's manifest, launch_meta and pointer file."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor import config as config_mod
from supervisor.layout import launch_meta, write_pointer, write_run_files

# The fields reward_workers_ctl.py writes (its _write_manifest and meta dicts): tools that
# read these files today must keep working.
SEED_MANIFEST_KEYS = {"experiment_name", "trial_name", "run_id", "reward_fn", "shard_count"}
SEED_META_KEYS = {"root", "run_id", "workers", "shard_count", "reward_fn", "respawn"}


def test_run_files_carry_the_seed_fields_and_the_pointer_mirrors_launch_meta(
    tmp_path: Path,
) -> None:
    """manifest.json and ctl/launch_meta.json have every field the seed wrote, with this
    config's values; run dirs exist per shard; the pointer file waits for write_pointer (the
    daemon calls it once the fleet is all ready) and is then a copy of launch_meta."""
    root = tmp_path / "runs" / "run-7"
    pointer = tmp_path / "ws" / "tmp" / "sao-reward-current.json"
    raw = {
        "run": {
            "root": str(root),
            "experiment": "exp",
            "trial": "t1",
            "run_id": "run-7",
            "reward_fn": "pkg.mod:score",
            "shard_count": 2,
            "pointer_file": str(pointer),
        },
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "hosts": [
            {"name": "worker-0", "shard": 0, "concurrency": 3},
            {"name": "worker-1", "shard": 1},
        ],
    }
    cfg = config_mod.parse(raw, tmp_path / "rs.toml")
    write_run_files(cfg)

    manifest = json.loads((root / "manifest.json").read_text())
    assert SEED_MANIFEST_KEYS | {"workers"} <= set(manifest)
    assert (manifest["experiment_name"], manifest["trial_name"]) == ("exp", "t1")
    assert (manifest["run_id"], manifest["reward_fn"]) == ("run-7", "pkg.mod:score")
    assert manifest["shard_count"] == 2
    workers = [
        {"host": "worker-0", "shard": 0, "concurrency": 3},
        {"host": "worker-1", "shard": 1, "concurrency": cfg.hosts[1].concurrency},
    ]
    assert manifest["workers"] == workers

    meta = json.loads((root / "ctl" / "launch_meta.json").read_text())
    assert set(meta) >= SEED_META_KEYS
    # respawn as the seed meant it: a worker that ends is started again (auto_restart).
    assert (meta["root"], meta["workers"], meta["respawn"]) == (str(root), workers, True)
    assert meta["config"] == str(tmp_path / "rs.toml")
    assert not pointer.exists()
    write_pointer(pointer, launch_meta(cfg))
    assert json.loads(pointer.read_text()) == meta
    assert (root / "inbox" / "0").is_dir() and (root / "inbox" / "1").is_dir()
    assert (root / "status").is_dir() and (root / "outbox").is_dir()
