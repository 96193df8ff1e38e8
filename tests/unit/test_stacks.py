"""Folding a worker's stacks: a pool's identical idle threads shown once, the odd one out
kept whole, and the result within its bound."""

from __future__ import annotations

from supervisor.agent import STACKS_MAX, compact_stacks

IDLE = ["    Condition.wait (threading.py:331)", "    Queue.get (queue.py:180)"]


def test_py_spy_threads_with_one_stack_are_shown_once_and_counted() -> None:
    """Three idle task threads become one with a count; the hung one and the process lines
    stay as they were, in their order."""
    text = "\n".join(
        [
            "Process 7: python -m worker",
            "",
            'Thread 7 (idle): "MainThread"',
            "    run (worker.py:856)",
            'Thread 8 (idle): "task-0"',
            *IDLE,
            'Thread 9 (idle): "task-1"',
            "    hung_reward_call (worker.py:421)",
            'Thread 10 (idle): "task-2"',
            *IDLE,
            'Thread 11 (idle): "task-3"',
            *IDLE,
        ]
    )
    assert compact_stacks(text).splitlines() == [
        "Process 7: python -m worker",
        "",
        'Thread 7 (idle): "MainThread"',
        "    run (worker.py:856)",
        'Thread 8 (idle): "task-0"',
        "  (and 2 more threads with this same stack)",
        *IDLE,
        'Thread 9 (idle): "task-1"',
        "    hung_reward_call (worker.py:421)",
    ]


def test_faulthandler_blocks_fold_too_and_log_lines_written_meanwhile_go_last() -> None:
    """faulthandler's headers (``Current thread``, blank lines between blocks) fold the same
    way; a JSON log line another thread wrote into the dump is kept, after the stacks."""
    block = ['  File "queue.py", line 180 in get', '  File "w.py", line 642 in _task_loop']
    text = "\n".join(
        [
            "Thread 0x01 (most recent call first):",
            *block,
            "",
            '{"event": "heartbeat.write_failed"}',
            "Thread 0x02 (most recent call first):",
            *block,
            "",
            "Current thread 0x03 (most recent call first):",
            '  File "w.py", line 421 in hung_reward_call',
        ]
    )
    assert compact_stacks(text).splitlines() == [
        "Thread 0x01 (most recent call first):",
        "  (and 1 more threads with this same stack)",
        *block,
        "Current thread 0x03 (most recent call first):",
        '  File "w.py", line 421 in hung_reward_call',
        '{"event": "heartbeat.write_failed"}',
    ]


def test_stacks_past_the_bound_are_cut_and_say_so() -> None:
    """Thousands of distinct stacks are cut to STACKS_MAX, with a line that says so."""
    text = "\n".join(f'Thread {i} (idle): "t"\n    f{i} (w.py:{i})' for i in range(5000))
    compact = compact_stacks(text)
    assert len(compact) <= STACKS_MAX
    assert compact.rstrip().splitlines()[-1].startswith("[cut: ")
