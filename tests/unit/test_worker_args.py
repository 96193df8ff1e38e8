"""Command-line parsing of the reference worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.demo import worker


def test_required_flags_parse_into_worker_args() -> None:
    """The four flags of areal.reward.fs_worker are enough, with documented defaults."""
    args = worker.parse_args(
        ["--root", "/r", "--shard", "3", "--host", "w-3", "--concurrency", "8"]
    )
    assert args == worker.WorkerArgs(
        root=Path("/r"),
        shard=3,
        host="w-3",
        concurrency=8,
        heartbeat_interval_s=1.0,
        drain_timeout_s=30.0,
    )


def test_optional_flags_override_interval_and_drain_timeout() -> None:
    """--heartbeat-interval and --drain-timeout (0 allowed: no drain) are carried through."""
    args = worker.parse_args(
        [
            "--root=/r",
            "--shard=0",
            "--host=h",
            "--concurrency=1",
            "--heartbeat-interval=0.25",
            "--drain-timeout=0",
        ]
    )
    assert (args.heartbeat_interval_s, args.drain_timeout_s) == (0.25, 0.0)


def test_the_reward_fn_is_no_longer_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Each task names its reward fn: --reward-fn is refused like any unknown flag."""
    with pytest.raises(SystemExit):
        worker.parse_args(
            ["--root", "/r", "--shard", "0", "--host", "h", "--concurrency", "1", "--reward-fn=m.f"]
        )
    assert "unrecognized arguments: --reward-fn" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [
        ["--shard", "0", "--host", "h", "--concurrency", "1"],  # no --root
        ["--root", "/r", "--shard", "-1", "--host", "h", "--concurrency", "1"],
        ["--root", "/r", "--shard", "x", "--host", "h", "--concurrency", "1"],
        ["--root", "/r", "--shard", "0", "--host", "a/b", "--concurrency", "1"],
        ["--root", "/r", "--shard", "0", "--host", "..", "--concurrency", "1"],
        ["--root", "/r", "--shard", "0", "--host", "", "--concurrency", "1"],
        ["--root", "/r", "--shard", "0", "--host", "h", "--concurrency", "0"],
        [
            "--root",
            "/r",
            "--shard",
            "0",
            "--host",
            "h",
            "--concurrency",
            "1",
            "--heartbeat-interval",
            "0",
        ],
        [
            "--root",
            "/r",
            "--shard",
            "0",
            "--host",
            "h",
            "--concurrency",
            "1",
            "--heartbeat-interval",
            "nan",
        ],
        [
            "--root",
            "/r",
            "--shard",
            "0",
            "--host",
            "h",
            "--concurrency",
            "1",
            "--drain-timeout",
            "-1",
        ],
    ],
)
def test_bad_arguments_exit_with_usage_status_2(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing or out-of-range arguments raise SystemExit(2) and name the problem on stderr."""
    with pytest.raises(SystemExit) as info:
        worker.parse_args(bad)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_main_returns_2_instead_of_exiting_on_bad_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """main() is callable as a function: bad arguments become return code 2, not SystemExit."""
    assert worker.main(["--root", "/r"]) == 2
    assert "required" in capsys.readouterr().err


def test_main_returns_0_for_help(capsys: pytest.CaptureFixture[str]) -> None:
    """--help prints usage and main() returns 0."""
    assert worker.main(["--help"]) == 0
    assert "--concurrency" in capsys.readouterr().out
