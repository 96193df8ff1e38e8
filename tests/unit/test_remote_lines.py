"""The agent's streams split into lines: any text, however it arrives, gives its lines back
whole or cut to their bound, and a flood never waits for the loop's next turn."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from supervisor.remote import READ_CHUNK_CHARS, _Lines


class Stream:
    """A stand-in for the read side of a channel: ``pieces`` as they arrived, then EOF."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = [piece for piece in pieces if piece]

    async def read(self, n: int) -> str:
        """At most ``n`` characters of what has arrived; "" at EOF."""
        if not self._pieces:
            return ""
        piece = self._pieces.pop(0)
        if len(piece) > n:
            self._pieces.insert(0, piece[n:])
            piece = piece[:n]
        return piece


async def all_lines(pieces: list[str], limit: int) -> list[str]:
    """Every line ``_Lines`` makes of ``pieces``, each batch checked against ``limit``."""
    lines = _Lines(Stream(pieces), limit)  # type: ignore[arg-type]
    found: list[str] = []
    while (batch := await lines.batch()) is not None:
        assert all(len(line) <= limit + 1 for line in batch)
        found.extend(batch)
    return found


def expected(text: str, limit: int) -> list[str]:
    """``text``'s lines as readline would give them, cut to ``limit + 1``."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the text ends with a newline (or is empty): no last partial line
    return [line[: limit + 1] for line in lines]


@given(
    pieces=st.lists(st.text(alphabet="ab\n{}\ud800", max_size=40), max_size=12),
    limit=st.integers(min_value=1, max_value=12),
)
def test_any_text_in_any_pieces_gives_its_lines_cut_to_the_bound(
    pieces: list[str], limit: int
) -> None:
    """Whatever the text and however it is cut into reads, the lines come out whole and in
    order, each cut to its bound, the last one even without its newline."""
    assert asyncio.run(all_lines(pieces, limit)) == expected("".join(pieces), limit)


def test_a_line_longer_than_a_read_is_kept_to_its_bound_and_the_next_line_is_whole() -> None:
    """A line of five reads is kept to its bound, and the line after it comes out whole."""
    text = "x" * (5 * READ_CHUNK_CHARS) + "\n" + '{"id": 1}' + "\n" + "tail"
    assert asyncio.run(all_lines([text], 100)) == ["x" * 101, '{"id": 1}', "tail"]


def test_lines_given_back_come_first_and_then_the_stream_goes_on() -> None:
    """Lines given back with ``unread`` are the next batch, before anything read after."""

    async def run() -> list[Any]:
        """Read a batch, give two lines back, read on to EOF."""
        lines = _Lines(Stream(["a\nb\nc\n", "d\n"]), 10)  # type: ignore[arg-type]
        first = await lines.batch()
        assert first == ["a", "b", "c"]
        lines.unread(first[1:])
        return [await lines.batch(), await lines.batch(), await lines.batch()]

    assert asyncio.run(run()) == [["b", "c"], ["d"], None]


def test_a_flood_of_lines_lets_other_tasks_run_between_reads() -> None:
    """Ten reads' worth of empty lines: another task gets a turn before each read."""

    async def run() -> tuple[int, int]:
        """Read the flood with a counting task beside; the turns it got and the batches read."""
        turns = 0

        async def other() -> None:
            """Count each turn of the loop."""
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)  # wait-ok: counts the loop's turns, waits for nothing

        lines = _Lines(Stream(["\n" * (10 * READ_CHUNK_CHARS)]), 10)  # type: ignore[arg-type]
        task = asyncio.create_task(other())
        await asyncio.sleep(0)  # wait-ok: lets ``other`` start
        count = batches = 0
        start = turns
        while (batch := await lines.batch()) is not None:
            count += len(batch)
            batches += 1
        task.cancel()
        assert count == 10 * READ_CHUNK_CHARS
        return turns - start, batches

    turns, batches = asyncio.run(run())
    assert turns >= batches - 1
