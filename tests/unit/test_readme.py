"""The docs promise what the code does: the README's first commands and first fleet, the
config table (docs/CONFIG.md) and the command table (docs/CLI.md), and every link between
them."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor import config

REPO = Path(__file__).parent.parent.parent
README = REPO / "README.md"
CONFIG_DOC = REPO / "docs" / "CONFIG.md"
CLI_DOC = REPO / "docs" / "CLI.md"


def _documented_keys() -> set[str]:
    """The ``section.key`` names in docs/CONFIG.md's configuration table."""
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", CONFIG_DOC.read_text(), flags=re.MULTILINE)
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
    """Each subcommand of the parser has a row in docs/CLI.md's command table, and no row
    names a command the parser does not have."""
    from supervisor import cli

    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    rows = re.findall(r"^\| `reward-supervisor ([a-z-]+)", CLI_DOC.read_text(), flags=re.MULTILINE)
    assert set(rows) == set(sub.choices or ())


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _prose(path: Path) -> str:
    """``path``'s text without its fenced code blocks (a ``#`` there is a comment)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_every_link_between_the_docs_leads_somewhere() -> None:
    """Every relative link in the README and docs/ names a file that exists and, with an
    anchor, a heading of that file: moving a section cannot leave a link behind."""
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    anchors = {
        page: {_slug(h) for h in re.findall(r"^#+ (.*)$", _prose(page), flags=re.MULTILINE)}
        for page in pages
    }
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors.get(linked, set()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_the_first_fleet_s_commands_are_ones_the_cli_takes() -> None:
    """Each ``reward-supervisor`` command of the README's "A first real fleet" parses, so the
    page a new user follows cannot drift from the command line."""
    import shlex

    from supervisor import cli

    section = README.read_text().split("## A first real fleet", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [
        shlex.split(line.split("#")[0])[1:]
        for line in block.splitlines()
        if line.strip().startswith("reward-supervisor ")
    ]
    assert [c[0] for c in commands] == ["init", "preflight", "run", "status"]
    parser = cli.build_parser()
    for argv in commands:
        parser.parse_args(argv)


def test_the_code_table_lists_every_code_with_its_exit_status() -> None:
    """Each failure code (the daemon's and the client's ``Refusal``, the command line's
    ``Failure``) has a row in docs/CLI.md's code table, with the exit status the CLI gives
    it, and no row names a code the CLI does not have."""
    from supervisor import cli
    from supervisor.refusals import Refusal

    rows = re.findall(r"^\| `([a-z_]+)` \| (\d) \|", CLI_DOC.read_text(), flags=re.MULTILINE)
    documented = {code: int(status) for code, status in rows}
    codes = {str(c) for c in Refusal} | {str(c) for c in cli.Failure}
    assert set(documented) == codes
    assert documented == {code: cli.exit_status(code) for code in codes}
