"""The remote side of ``reward-supervisor preflight``: one worker host looks at itself.

Never imported by the supervisor: ``preflight.py`` sends this file's text as the ``-c``
argument of the host's ``worker.python``, through the same login shell the agent starts
in, so it is stdlib-only and runs on Python >= 3.7 (like ``agent.py``). It reads one JSON
request on stdin and writes one JSON line on stdout:

- request: ``{"root", "nonce_name", "nonce", "probe_name", "module_argv", "module",
  "reward_fn", "reward_argv", "env", "import_module", "module_timeout_s"}`` (with
  ``"modules_only": true``, from ``check-config`` on the supervisor's machine, only the two
  module checks are made, and the reply has only ``python``, ``executable``, ``module`` and
  ``reward_fn``);
- reply: ``{"preflight": 1, "python", "executable", "root_exists", "dirs": {DIR:
  "match"|"missing"|"differs"|ERROR}, "writable": {DIR: "ok"|ERROR}, "disk": {"free_bytes",
  "free_inodes"}|{"error"}, "module": {"found", "origin"|"error", ...}, "reward_fn": {...
  likewise}, "time", "elapsed_s"}``.

It writes nothing but its probe files (``ctl/`` and ``status/``, created exclusively and
removed at once), follows no symlink at the last path component, and reports at most a
few hundred characters of anything it reads.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from typing import Any

#: What of a message (an import error, a stderr tail) goes back to the supervisor.
MAX_TEXT = 400
#: A nonce is 32 hex digits; anything much longer is not ours.
MAX_NONCE_READ = 256
#: The directories whose nonce files the supervisor wrote: the run root, ctl/ and status/.
NONCE_DIRS = ("", "ctl", "status")
#: The directories a worker host must write to: its pidfile and log, and its heartbeat.
WRITABLE_DIRS = ("ctl", "status")

#: Run by the worker's own interpreter with the worker's environment: finds (or imports)
#: the worker's module the way ``python -m`` would, and the module of ``run.reward_fn``
#: (importing it, the function must be there and callable), and prints one line starting
#: with MARK. Arguments: ``find|import``, the module (or ""), the reward fn (or "").
MARK = "rs-preflight-module:"
MODULE_SCRIPT = r"""
import importlib, importlib.util, json, sys
how, name, reward_fn = sys.argv[1], sys.argv[2], sys.argv[3]

def failed(exc, wanted):
    # Missing: the module or a package above it; anything else was raised by their code.
    missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and (
        wanted == exc.name or wanted.startswith(exc.name + ".")
    )
    return {"found": False, "error": "%s: %s" % (type(exc).__name__, exc), "raised": not missing}

def module(name):
    try:
        if how == "import":
            imported = importlib.import_module(name)
            return {"found": True, "origin": getattr(imported, "__file__", None), "imported": True}
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            # python -m runs a package's __main__.
            spec = importlib.util.find_spec(name + ".__main__")
        if spec is None:
            return {"found": False, "error": "No module named %r" % name}
        return {"found": True, "origin": spec.origin, "imported": False}
    except BaseException as exc:
        return failed(exc, name)

def reward(path):
    # As the worker resolves it: the module before the last dot, then the attribute.
    where, _, attr = path.rpartition(".")
    if not where or not attr:
        return {"found": False, "error": "%r is not a dotted path (module.function)" % path}
    try:
        if how != "import":
            spec = importlib.util.find_spec(where)
            if spec is None:
                return {"found": False, "error": "No module named %r" % where}
            return {"found": True, "origin": spec.origin, "imported": False}
        imported = importlib.import_module(where)
    except BaseException as exc:
        return failed(exc, where)
    origin = getattr(imported, "__file__", None)
    if not hasattr(imported, attr):
        error = "module %r (%s) has no attribute %r" % (where, origin, attr)
        return {"found": False, "error": error, "no_function": True}
    if not callable(getattr(imported, attr)):
        error = "%r in %s is not callable" % (attr, origin)
        return {"found": False, "error": error, "no_function": True}
    return {"found": True, "origin": origin, "imported": True}

out = {"module": module(name) if name else None}
out["reward_fn"] = reward(reward_fn) if reward_fn else None
out["python"] = ".".join(str(n) for n in sys.version_info[:3])
out["executable"] = sys.executable
sys.stdout.write("\nrs-preflight-module:" + json.dumps(out) + "\n")
"""


def _short(text: str) -> str:
    """``text`` on one line, at most MAX_TEXT characters (its end, where errors are)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_TEXT else "..." + flat[-MAX_TEXT:]


def _error(exc: OSError) -> str:
    """An OSError as ``ENAME: message``."""
    name = os.strerror(exc.errno) if exc.errno else str(exc)
    code = _errno_name(exc.errno)
    return _short(f"{code}: {name}" if code else name)


def _errno_name(number: int | None) -> str:
    """``EACCES`` for 13, and so on; empty when unknown."""
    return errno.errorcode.get(number or 0, "")


def read_nonce(path: str) -> str:
    """The nonce at ``path``, or an empty string; raises OSError (no symlink, no FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MAX_NONCE_READ).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def check_nonces(root: str, name: str, nonce: str) -> dict[str, str]:
    """Per directory: the supervisor's nonce file is here with its content, or why not."""
    out = {}
    for sub in NONCE_DIRS:
        path = os.path.join(root, sub, name) if sub else os.path.join(root, name)
        try:
            found = read_nonce(path)
        except FileNotFoundError:
            out[sub or "."] = "missing"
            continue
        except OSError as exc:
            out[sub or "."] = _error(exc)
            continue
        out[sub or "."] = "match" if found == nonce else "differs"
    return out


def check_writable(root: str, name: str) -> dict[str, str]:
    """Per directory: a new file can be created, written, synced and removed there."""
    out = {}
    for sub in WRITABLE_DIRS:
        path = os.path.join(root, sub, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            out[sub] = _error(exc)
            continue
        try:
            os.write(fd, b"reward-supervisor preflight probe\n")
            os.fsync(fd)
            out[sub] = "ok"
        except OSError as exc:
            out[sub] = _error(exc)
        finally:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError as exc:
                out[sub] = "created, but cannot remove it: " + _error(exc)
    return out


def check_disk(root: str) -> dict[str, Any]:
    """Free space and inodes for an unprivileged writer on the run root's filesystem."""
    try:
        st = os.statvfs(root)
    except OSError as exc:
        return {"error": _error(exc)}
    return {"free_bytes": st.f_bavail * st.f_frsize, "free_inodes": st.f_favail}


def check_module(request: dict[str, Any], root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's module found (or imported) by its interpreter and environment, or, for a
    worker argv without ``-m``, its executable found on that environment's PATH; and
    ``run.reward_fn``'s module found (or imported, and the function in it)."""
    argv = [str(a) for a in request["module_argv"]]
    env = dict(os.environ)
    env.update(request["env"])
    module = request.get("module")
    reward_fn = str(request.get("reward_fn") or "")
    executable: dict[str, Any] | None = None
    if not module:
        # Imported only here: shutil pulls in the compression modules, tens of ms per host.
        import shutil

        found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
        if found is None:
            executable = {"found": False, "error": f"{argv[0]} not found on PATH"}
        else:
            executable = {"found": True, "origin": found, "executable_only": True}
        # The reward fn is imported by the worker's python, here the configured one.
        argv = [str(a) for a in request.get("reward_argv") or argv]
    if module or reward_fn:
        answer = run_module_script(argv, module or "", reward_fn, request, env, root)
    else:
        answer = {}
    return (
        executable or _answer_part(answer, "module", argv),
        _answer_part(answer, "reward_fn", argv) if reward_fn else {"found": True, "skipped": True},
    )


def _answer_part(answer: dict[str, Any], key: str, argv: list[str]) -> dict[str, Any]:
    """One check's part of the script's answer, or the script's own failure for it."""
    if "failed" in answer:
        return dict(answer["failed"])
    part = answer.get(key)
    if not isinstance(part, dict):
        return {"found": False, "error": f"{argv[0]} gave no answer for the {key} check"}
    for field in ("error", "origin"):
        if isinstance(part.get(field), str):
            part[field] = _short(part[field])
    return part


def run_module_script(
    argv: list[str],
    module: str,
    reward_fn: str,
    request: dict[str, Any],
    env: dict[str, str],
    root: str,
) -> dict[str, Any]:
    """MODULE_SCRIPT's answer, run by ``argv`` (the worker's interpreter and its options);
    ``{"failed": {...}}`` when it could not run or answer."""
    how = "import" if request.get("import_module") else "find"
    timeout = float(request["module_timeout_s"])
    try:
        done = subprocess.run(
            [*argv, "-c", MODULE_SCRIPT, how, module, reward_fn],
            env=env,
            # Where the worker starts: ``python -m`` puts the working directory on sys.path.
            cwd=root if os.path.isdir(root) else None,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"failed": {"found": False, "error": f"no answer within {timeout:g}s", "hung": True}}
    except OSError as exc:
        return {"failed": {"found": False, "error": f"cannot run {argv[0]}: {_error(exc)}"}}
    for line in reversed(done.stdout.decode("utf-8", "replace").splitlines()):
        if line.startswith(MARK):
            try:
                result = json.loads(line[len(MARK) :])
            except ValueError:
                break
            if isinstance(result, dict):
                return result
    stderr = done.stderr.decode("utf-8", "replace")
    error = f"{argv[0]} exited {done.returncode}: {_short(stderr) or '-'}"
    return {"failed": {"found": False, "error": error}}


def main() -> int:
    """Read the request, look, answer."""
    started = time.monotonic()
    request = json.loads(sys.stdin.read(1 << 20))
    root = str(request["root"])
    if request.get("modules_only"):
        # check-config, on the supervisor's own machine: the interpreter's answer alone,
        # nothing written or read under the run root.
        here: dict[str, Any] = {"preflight": 1, "python": ".".join(map(str, sys.version_info[:3]))}
        here["executable"] = sys.executable
        here["module"], here["reward_fn"] = check_module(request, root)
        sys.stdout.write(json.dumps(here) + "\n")
        return 0
    reply: dict[str, Any] = {
        "preflight": 1,
        "python": ".".join(str(n) for n in sys.version_info[:3]),
        "executable": sys.executable,
        "root_exists": os.path.isdir(root),
        "dirs": check_nonces(root, request["nonce_name"], request["nonce"]),
        "writable": check_writable(root, request["probe_name"]),
        "disk": check_disk(root),
    }
    reply["module"], reply["reward_fn"] = check_module(request, root)
    # Read last, with how long we took: the supervisor then knows the reading falls between
    # its send plus our work and its receipt, which leaves out the login shell's start.
    reply["time"] = time.time()
    reply["elapsed_s"] = time.monotonic() - started
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
