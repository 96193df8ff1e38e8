"""The fleet page in a real browser: headless Chromium renders the page of a live daemon on the
real sshd (5 hosts, a worker killed with SIGKILL) and of a simulated fleet of 1000 hosts;
screenshots are kept under the test's directory and their paths printed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.procs import SimProcess, stop_daemon
from supervisor import page
from supervisor.seedimport import render_toml
from tests import ports
from tests.browser import dump_dom, png_size, read_png, screenshot
from tests.pageparse import Page, parse_page
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    DaemonProcess,
    Daemons,
    all_ready,
    fast_config,
    write_config,
)

pytestmark = [pytest.mark.system]

#: The page's colours (supervisor/page.py's CSS) a screenshot is read for.
READY, COOLING_DOWN, STALE = "#1a7f37", "#d4a72c", "#bf8700"
#: A tile is ~100 x 32 px at a 1280-pixel-wide window: a colour on at least this many pixels
#: is on a tile's worth of the screen, not on a stray anti-aliased edge.
TILE_PIXELS = 1500
#: A second crash in a row waits this long for its restart: the page has that long to show
#: the host not ready (the first restart after a healthy spell is immediate).
COOLDOWN_S = 8.0


async def page_when(
    chromium: str, url: str, predicate: Callable[[Page], bool], timeout_s: float, what: str
) -> Page:
    """The page as Chromium renders it, loaded again until ``predicate`` holds."""
    seen: list[Page] = []

    async def load() -> bool:
        """One load of the page."""
        seen[:] = [parse_page(await dump_dom(chromium, url))]
        return predicate(seen[0])

    try:
        async with asyncio.timeout(timeout_s):
            while not await load():
                pass
    except TimeoutError:
        last = seen[0].text[:2000] if seen else "nothing loaded"
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {last}") from None
    return seen[0]


def artefact(path: Path) -> Path:
    """Say where a screenshot is kept (pytest shows it with -s or on failure)."""
    print(f"screenshot: {path}")
    return path


@pytest.mark.openssh
async def test_a_killed_worker_shows_not_ready_then_ready_again_in_chromium(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons, chromium: str
) -> None:
    """Five hosts on the real sshd: Chromium shows five ready tiles; after worker-2 is killed
    with SIGKILL (twice, so its restart waits out a backoff) its tile comes first, not ready,
    with the reason on hover, its page shows the exit and its log; then all five are ready
    again. Screenshots of each are read back for the tiles' colours."""
    port = ports.reserve("127.0.0.1")
    raw = fast_config(
        openssh,
        tmp_path / "run",
        5,
        tmp_path,
        metrics={"listen": f"127.0.0.1:{port}"},
        health={"restart_cooldown_s": COOLDOWN_S, "backoff_max_s": COOLDOWN_S},
    )
    proc = await daemons.start(write_config(tmp_path / "rs.toml", raw))
    status = await proc.wait_status(lambda s: all_ready(s, 5), 60, "5 ready")
    url = f"http://127.0.0.1:{port}/"
    names = sorted(status["hosts"])

    def ready(p: Page) -> bool:
        """Every host's tile is there, and ready."""
        return p.states == dict.fromkeys(names, "ready")

    read = await page_when(chromium, url, ready, 60, "5 ready tiles")
    assert read.counts["ready"] == 5
    assert read.banners == []
    shot = read_png(
        await screenshot(chromium, url, artefact(tmp_path / "fleet-5-ready.png"), 1280, 600)
    )
    assert (shot.width, shot.height) == (1280, 600)
    assert shot.count(READY) > 5 * TILE_PIXELS
    assert shot.count(COOLING_DOWN) + shot.count(STALE) == 0

    victim = "worker-2"
    first = status["hosts"][victim]["pid"]
    os.kill(first, signal.SIGKILL)
    status = await proc.wait_status(
        lambda s: s["hosts"][victim]["pid"] not in (None, first) and all_ready(s, 5),
        60,
        "worker-2 replaced",
    )
    os.kill(status["hosts"][victim]["pid"], signal.SIGKILL)
    status = await proc.wait_status(
        lambda s: s["hosts"][victim]["state"] == "cooling_down", 30, "worker-2 cooling down"
    )
    reason = status["hosts"][victim]["last_reason"]

    read = await page_when(
        chromium, url, lambda p: p.states.get(victim) != "ready", 30, "worker-2 not ready"
    )
    assert read.tiles[0].name == victim
    assert read.tiles[0].state in ("stale", "cooling_down")
    assert reason in read.tiles[0].title.splitlines()
    assert {t.name: t.state for t in read.tiles[1:]} == dict.fromkeys(
        set(names) - {victim}, "ready"
    )
    assert read.counts["ready"] == 4
    shot = read_png(
        await screenshot(chromium, url, artefact(tmp_path / "fleet-5-killed.png"), 1280, 600)
    )
    assert shot.count(COOLING_DOWN) + shot.count(STALE) > TILE_PIXELS
    assert shot.count(READY) > 4 * TILE_PIXELS

    host_url = url + page.host_href(victim)
    host = parse_page(await dump_dom(chromium, host_url))
    assert host.title.startswith(f"{victim}: ")
    assert "last exit" in host.text
    assert "killed by signal" in host.text or "SIGKILL" in host.text
    assert host.pres and host.pres[-1].strip(), "the worker's log lines"
    await screenshot(chromium, host_url, artefact(tmp_path / "host-worker-2.png"), 1280, 900)

    read = await page_when(chromium, url, ready, 60, "5 ready tiles again")
    assert read.counts["ready"] == 5


@pytest.mark.openssh
async def test_the_page_reads_without_javascript_and_refreshes_in_place_with_it(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons, chromium: str
) -> None:
    """With scripts off, Chromium shows every tile and the page reloads itself (a noscript
    refresh); with scripts on, our script runs under the page's policy and swaps the live
    part in place (no reload), every tile still there after."""
    port = ports.reserve("127.0.0.1")
    raw = fast_config(
        openssh, tmp_path / "run", 2, tmp_path, metrics={"listen": f"127.0.0.1:{port}"}
    )
    proc = await daemons.start(write_config(tmp_path / "rs.toml", raw))
    await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    url = f"http://127.0.0.1:{port}/"

    plain = await dump_dom(chromium, url, scripts=False)
    read = parse_page(plain)
    assert read.states == {"worker-0": "ready", "worker-1": "ready"}
    assert f"reloads every {page.NOSCRIPT_REFRESH_S} s" in read.text
    assert 'data-refreshes="' not in plain
    assert [e.attrs for e in read.elements if e.attrs.get("http-equiv") == "refresh"] == [
        {"http-equiv": "refresh", "content": str(page.NOSCRIPT_REFRESH_S)}
    ]
    path = artefact(tmp_path / "fleet-2-no-javascript.png")
    shot = read_png(await screenshot(chromium, url, path, 1280, 300, scripts=False))
    assert shot.count(READY) > 2 * TILE_PIXELS

    live = await dump_dom(chromium, url, virtual_time_ms=(3 * page.REFRESH_S + 1) * 1000)
    read = parse_page(live)
    [body] = [e for e in read.elements if e.tag == "body"]
    assert int(body.attrs["data-refreshes"] or 0) >= 1
    assert "live, updated" in read.text
    assert set(read.states) == {"worker-0", "worker-1"}


# --- 1000 simulated hosts ---------------------------------------------------------------

#: The simulator's heartbeat staleness: generous, as a loaded machine's writer runs late.
SIM_STALE_S = 15.0
#: At 1000 hosts a killed worker's second restart waits this long: the page is loaded and
#: screenshotted well within it, on a loaded machine too.
SIM_COOLDOWN_S = 120.0
#: Killed twice with SIGKILL (the first restart is immediate, the second waits out the
#: backoff). SIGKILL is never a crash signature: each is a host's own crash.
KILLED = ("sim-0123", "sim-0456", "sim-0789")


def sim_config(config: Path, port: int) -> None:
    """Add ``metrics.listen`` and a long restart backoff to the simulator's daemon config."""
    raw: dict[str, Any] = tomllib.loads(config.read_text(encoding="utf-8"))
    raw["metrics"] = {"listen": f"127.0.0.1:{port}"}
    raw["health"].update(restart_cooldown_s=SIM_COOLDOWN_S, backoff_max_s=SIM_COOLDOWN_S)
    config.write_text(render_toml(raw), encoding="utf-8")


def states(status: Mapping[str, Any]) -> dict[str, str]:
    """Host -> state."""
    return {name: str(row["state"]) for name, row in status["hosts"].items()}


@pytest.mark.scale
@pytest.mark.timeout(420)  # 30 s alone; over two minutes on a machine busy with other tests
async def test_a_thousand_simulated_hosts_in_chromium_after_kills(
    tmp_path: Path, chromium: str
) -> None:
    """1000 simulated hosts (bench/fleetsim.py: real SSH and agent protocol, sleep workers,
    heartbeats with the workers' figures):
    after three workers are killed with SIGKILL twice in a row, Chromium shows 1000 tiles
    whose states are the daemon's: the three first, cooling down with the exit as the
    reason, the others as the daemon has them; the screenshot shows them in their colours."""
    sim = SimProcess(
        tmp_path / "sim", 1000, agents="inproc", watch="inotify", stale_s=SIM_STALE_S, work=True
    )
    daemon: DaemonProcess | None = None
    try:
        ready = await sim.start()
        config = Path(ready["config"])
        port = ports.reserve("127.0.0.1")
        sim_config(config, port)
        daemon = DaemonProcess(config, config.parent)
        await daemon.start()
        status = await daemon.wait_status(lambda s: all_ready(s, 1000), 300, "1000 ready")
        url = f"http://127.0.0.1:{port}/"

        first = {name: status["hosts"][name]["pid"] for name in KILLED}
        for name in KILLED:
            await sim.send(cmd="exit", host=name)
        await daemon.wait_status(
            lambda s: all(
                s["hosts"][h]["state"] == "ready" and s["hosts"][h]["pid"] != first[h]
                for h in KILLED
            ),
            240,
            "the killed workers replaced",
        )
        for name in KILLED:
            await sim.send(cmd="exit", host=name)
        status = await daemon.wait_status(
            lambda s: all(s["hosts"][h]["state"] == "cooling_down" for h in KILLED),
            60,
            "the killed workers cooling down",
        )
        reasons = {h: status["hosts"][h]["last_reason"] for h in KILLED}

        def shows_the_kills(p: Page) -> bool:
            """The page's snapshot has the three hosts cooling down."""
            return all(p.states.get(h) == "cooling_down" for h in KILLED)

        before = states(status)
        read = await page_when(chromium, url, shows_the_kills, 60, "three hosts cooling down")
        after = states(await daemon.status())
        assert len(read.tiles) == 1000
        assert set(read.states) == set(before)
        assert [t.name for t in read.tiles[:3]] == sorted(KILLED)
        for tile in read.tiles[:3]:
            assert reasons[tile.name] in tile.title.splitlines()
        wrong = {h: s for h, s in read.states.items() if s not in (before[h], after[h])}
        assert wrong == {}
        assert read.counts["cooling_down"] == 3
        # The workers' own figures: every shard's queue on the page and on its tile.
        assert "backlog" in read.text
        assert "tasks in 1000 shards" in read.text
        assert all(
            re.search(r"\bq\d+\b", t.second)
            for t in read.tiles
            if t.state == "ready" and not t.outlined
        )

        path = artefact(tmp_path / "fleet-1000-top.png")
        top = read_png(await screenshot(chromium, url, path, 1280, 400))
        assert top.count(COOLING_DOWN) > 3 * TILE_PIXELS
        assert top.count(READY) > 10 * TILE_PIXELS
        path = artefact(tmp_path / "fleet-1000.png")
        # Kept whole for a person to look at; its pixels are not read (decoding 5.6 million
        # of them in Python takes longer than the rest of the test).
        assert png_size(await screenshot(chromium, url, path, 1280, 4400)) == (1280, 4400)
    finally:
        if daemon is not None:
            await stop_daemon(daemon)
        await sim.aclose()
