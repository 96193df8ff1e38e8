"""The README promises what the code does: its config table and first commands."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor import config

README = Path(__file__).parent.parent.parent / "README.md"


def _documented_keys() -> set[str]:
    """The ``section.key`` names in the README's configuration table."""
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", README.read_text(), flags=re.MULTILINE)
    return set(rows)


def test_config_reference_lists_exactly_the_keys_the_code_accepts() -> None:
    """Every accepted key is documented and every documented key is accepted."""
    accepted = {f"{section}.{key}" for section, keys in config.KEYS.items() for key in keys}
    documented = _documented_keys()
    assert documented - accepted == set(), "documented but unknown to the code"
    assert accepted - documented == set(), "accepted by the code but not documented"


def test_readme_starts_with_the_demo_and_the_test_command() -> None:
    """The first code block holds the two commands a newcomer runs."""
    text = README.read_text()
    block = text.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert commands == ["./dev demo", "./dev test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "./dev test" in ci


def test_command_table_lists_every_subcommand() -> None:
    """Each subcommand of the parser has a row in the README's command table, and no row
    names a command the parser does not have."""
    from supervisor import cli

    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    rows = re.findall(r"^\| `reward-supervisor ([a-z-]+)", README.read_text(), flags=re.MULTILINE)
    assert set(rows) == set(sub.choices or ())
