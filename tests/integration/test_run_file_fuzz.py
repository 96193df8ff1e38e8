"""Bounded fuzz of the files a host or anyone with the run root can write and the daemon reads
back: ``ctl/supervisor-state.json`` and exit records, as real files, through the real readers.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import runfiles
from supervisor.health import Policy
from supervisor.statusfiles import ExitRecord, read_exit
from tests.examples import examples

POLICY = Policy()

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=25,
)
#: Bytes a writer could leave: anything, JSON of any shape, and the shapes that break parsers.
hostile_bytes = st.one_of(
    st.binary(max_size=4096),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda n, host: json.dumps({"hosts": {host: {"failures": n, "restart_times": [n]}}}),
        st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "1" * 5000, "[]", '"x"', "true"]),
        st.text(max_size=8),
    ).map(lambda text: text.replace('"1e999"', "1e999").encode()),
    st.integers(min_value=1, max_value=200_000).map(lambda n: b"[" * n),
    st.integers(min_value=1, max_value=50_000).map(lambda n: b'{"hosts":' * n),
    st.just(b'{"hosts": {"h": {"next_restart_at": NaN}}}'),
    st.just(b'{"hosts": {"h": {"restart_times": [Infinity]}}}'),
    st.just(b"\x00" * 100 + b"\xff\xfe"),
)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    """One run root for every example (hypothesis runs many per test)."""
    with tempfile.TemporaryDirectory(prefix="run-file-fuzz-") as tmp:
        path = Path(tmp)
        (path / "ctl").mkdir()
        yield path


@settings(max_examples=examples(300))
@given(data=hostile_bytes)
def test_state_loader_never_raises_on_any_file_content(root: Path, data: bytes) -> None:
    """Whatever bytes ``supervisor-state.json`` holds, loading it returns a history (maybe
    empty) whose instants are all finite; it never raises."""
    state = root / "ctl" / "supervisor-state.json"
    state.write_bytes(data)
    history = runfiles.load_history(state, root=root, policy=POLICY)
    for h in history.values():
        assert all(math.isfinite(t) for t in h.restart_times_at)
        assert h.next_restart_at is None or math.isfinite(h.next_restart_at)


@settings(max_examples=examples(300))
@given(data=hostile_bytes)
def test_exit_record_reader_never_raises_on_any_file_content(root: Path, data: bytes) -> None:
    """Whatever bytes an exit record holds, reading it gives a record with a positive pid or
    None; it never raises."""
    record_path = root / "ctl" / "h.exit.json"
    record_path.write_bytes(data)
    record = read_exit(record_path)
    assert record is None or (isinstance(record, ExitRecord) and record.pid > 0)
