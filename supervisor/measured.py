"""The test suite's coverage of the programs sent to hosts as source (the agent, hostcheck).

A host runs ``agent.py`` as ``python -c SOURCE``: code compiled from a string, which
coverage.py cannot map to a file, in a process that sshd starts with a clean environment,
so coverage.py's own subprocess patch never reaches it. When the test suite measures
coverage, ``./dev test`` sets ``REWARD_SUPERVISOR_MEASURE_REMOTE=1`` and coverage.py's
``patch = ["subprocess"]`` (pyproject.toml) puts its configuration in
``COVERAGE_PROCESS_CONFIG`` of every process the tests start, the daemon included. With
both present, the program sent is a wrapper that starts coverage.py on the host with that
configuration and runs the same source compiled under the real path of its file. The test
hosts are this machine, so the host's python (the test venv's) finds the same coverage.py
and writes its data beside the test run's. A host python without coverage.py runs the
source unmeasured.

Without both variables, which is always so outside the test suite, the source is sent
unchanged: nothing here touches production behaviour, and coverage.py is no dependency.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import json
import os
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

#: Set by ``./dev test`` only: measure the programs sent to hosts.
ENABLE_ENV: Final = "REWARD_SUPERVISOR_MEASURE_REMOTE"
#: coverage.py's configuration for child processes (``coverage.process_startup``), set by
#: its ``patch = ["subprocess"]``: base64 of a JSON object.
CONFIG_ENV: Final = "COVERAGE_PROCESS_CONFIG"
#: On the host, on top of the run's patches: the launcher forks shepherds and the shepherds
#: end with ``os._exit``; each child measures itself and saves its data.
_HOST_PATCHES: Final = ("fork", "_exit")

# Parses as the oldest host python the docs promise, like agent.py. The source travels
# compressed: repr() of it would grow the one argv string the kernel caps at 128 KiB. A
# python of the test run's version started with -S (hostcheck) has no site-packages: it is
# given the directory coverage.py is in, last on its path. A process that could not write
# its data file (a host user other than the test run's) is not measured, nor are its
# children (the workers): each would only fail at exit, on its stderr.
# Modules sent with the source (``modules``) are run first, each compiled under its own real
# path too, as a module registered under its name in ``sys.modules`` (as
# ``remote.packed_program`` registers them).
_WRAPPER: Final = """\
import base64 as _b64, os as _os, sys as _sys, types as _types, zlib as _zlib
try:
    if _os.access({data_dir!r}, _os.W_OK):
        _os.environ[{config_env!r}] = {config!r}
        if _sys.version_info[:2] == {version!r} and {home!r} not in _sys.path:
            _sys.path.append({home!r})
        import coverage as _coverage
        _coverage.process_startup()
except Exception:
    pass
def _unpack(path, packed):
    return compile(_zlib.decompress(_b64.b64decode(packed)), path, "exec")
def _load(name, path, packed):
    module = _sys.modules[name] = _types.ModuleType(name)
    module.__file__ = path
    exec(_unpack(path, packed), module.__dict__)
{loads}__file__ = {path!r}
_code = _unpack(__file__, {source!r})
del _b64, _os, _sys, _types, _zlib, _unpack, _load
exec(_code)
"""


def remote_program(source: str, path: Path, modules: Sequence[tuple[str, Path]] = ()) -> str:
    """What a host's ``python -c`` runs for ``source`` (the text of ``path``), once it has
    loaded ``modules`` (``(name, file)``, each registered under its name): the source
    itself, which the caller sends as it will, or under the test suite's coverage run the
    wrapper that measures the source and the modules."""
    if os.environ.get(ENABLE_ENV) != "1":
        return source
    settings = _settings(os.environ.get(CONFIG_ENV, ""))
    if settings is None:
        return source
    settings["patch"] = sorted({*settings["patch"], *_HOST_PATCHES})
    loads = "".join(
        f"_load({name!r}, {str(file.resolve())!r}, {_pack(file.read_text(encoding='utf-8'))!r})\n"
        for name, file in modules
    )
    return _WRAPPER.format(
        config_env=CONFIG_ENV,
        config=base64.b64encode(json.dumps(settings).encode("utf-8")).decode("ascii"),
        version=sys.version_info[:2],
        home=_coverage_home(),
        data_dir=os.path.dirname(settings["data_file"]),
        loads=loads,
        path=str(path.resolve()),
        source=_pack(source),
    )


def _pack(text: str) -> str:
    """``text`` compressed, as base64: repr() of the text itself would be larger still."""
    return base64.b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


def _settings(config: str) -> dict[str, Any] | None:
    """The run's coverage configuration as coverage.py serialized it (base64 of a JSON
    object, with an absolute data file); None if it is not that."""
    try:
        settings = json.loads(base64.b64decode(config, validate=True))
    except (binascii.Error, ValueError):
        return None
    if (
        not isinstance(settings, dict)
        or not isinstance(settings.get("patch"), list)
        or not isinstance(settings.get("data_file"), str)
        or not os.path.isabs(settings["data_file"])
    ):
        return None
    return settings


def _coverage_home() -> str:
    """The directory coverage.py is imported from here (found, not imported); "" if none."""
    spec = importlib.util.find_spec("coverage")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return str(Path(next(iter(spec.submodule_search_locations))).parent)
