"""The operator-commands adapter: what the control socket asks (``control.Commands``), and
SIGHUP's reload, turned into events for the cores; each answered when the core replies to
its token, refused with the core's code and message.

It decides nothing: whether a command is refused, and why, is the cores' answer (a
``Refusal`` code and a message: ``vocabulary.Reply``, ``leadership.refusal``); a reload reads and
validates the file (``config.py``) and hands the result to the fleet core, which reconciles.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import structlog

from supervisor import config as config_mod
from supervisor import layout, leadership, vocabulary
from supervisor.config import Config
from supervisor.control import EventSubscription
from supervisor.errors import ConfigError, ControlError
from supervisor.notify import NotifierProtocol
from supervisor.present import Facts, Presenter
from supervisor.refusals import Refusal
from supervisor.shell import Shell

log = structlog.get_logger("supervisor.daemon")


class Operator:
    """The control socket's commands (``control.Commands``) and the reload."""

    def __init__(
        self,
        shell: Shell,
        *,
        presenter: Presenter,
        notifier: NotifierProtocol,
        facts: Facts,
        leading: Callable[[], leadership.Leadership],
        refusal: Callable[[], vocabulary.Refusal | None],
        request_stop: Callable[[str], None],
        apply_config: Callable[[Config], None],
    ) -> None:
        self._shell = shell
        self._presenter = presenter
        self._notifier = notifier
        self._facts = facts
        self._leading = leading
        self._refusal = refusal
        self._request_stop = request_stop
        self._apply_config = apply_config
        self._tokens = itertools.count(1)
        self._replies: dict[int, asyncio.Future[vocabulary.Reply]] = {}
        self._lead_replies: dict[int, leadership.Reply] = {}
        self._reload_wanted = asyncio.Event()
        self._reload_lock = asyncio.Lock()

    # --- the cores' answers -------------------------------------------------------------------

    def replied(self, action: vocabulary.Reply) -> None:
        """The fleet core answered a command's token."""
        future = self._replies.get(action.token)
        if future is not None and not future.done():
            future.set_result(action)

    def lead_replied(self, action: leadership.Reply) -> None:
        """The leadership core answered a command's token (at once: it is fed directly)."""
        self._lead_replies[action.token] = action

    def abandon(self) -> None:
        """The daemon is stopping: every command still waiting is answered with an error."""
        for future in self._replies.values():
            if not future.done():
                future.set_exception(
                    ControlError("the daemon is stopping", code=Refusal.SHUTTING_DOWN)
                )

    async def _ask(self, make: Callable[[int], vocabulary.Event]) -> vocabulary.Reply:
        """Queue an operator command and wait for the core's answer to it."""
        _raise_if_refused(leadership.refusal(self._leading(), "command"))
        refused = self._refusal()
        if refused is not None:
            raise ControlError(
                "the daemon is not serving commands (starting or stopping)", code=refused
            )
        token = next(self._tokens)
        future: asyncio.Future[vocabulary.Reply] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        try:
            self._shell.emit(make(token))
            reply = await future
        finally:
            self._replies.pop(token, None)
        if reply.refusal is not None:
            raise ControlError(reply.message, code=reply.refusal)
        return reply

    # --- control.Commands ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Request ``{"cmd": "status"}``; response ``{"daemon": {...}, "hosts": {...}}``."""
        lead = self._leading()
        if lead.standing_by:
            self._shell.lead(leadership.StatusAsked())
            return self._presenter.standby_status(self._leading().view_at)
        return self._presenter.status()

    def host_status(self, name: str) -> dict[str, Any]:
        """Request ``{"cmd": "status", "host": H}``; response ``{"daemon": {...}, "host": H,
        ...}``, the host's row with its progress, restarts, last exit and evidence in full."""
        _raise_if_refused(leadership.refusal(self._leading(), "command"))
        return self._presenter.host_status(name)

    async def restart_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "restart-host", "host": H}``; response the host's new row."""
        await self._ask(lambda token: vocabulary.RestartHostRequested(host=host, token=token))
        return self._presenter.row(host)

    async def stop_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "stop-host", "host": H}``: writes ``ctl/H.stop``, so it stays so."""
        await self._ask(lambda token: vocabulary.StopHostRequested(host=host, token=token))
        return self._presenter.row(host)

    async def start_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "start-host", "host": H}``: removes the sentinel, clears ``failed``."""
        await self._ask(lambda token: vocabulary.StartHostRequested(host=host, token=token))
        return self._presenter.row(host)

    async def drain(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "drain", "host": H}``: H's shard moves to a free spare and H
        stays out; response ``{"label", "shard", "to"}``."""
        reply = await self._ask(lambda token: vocabulary.DrainRequested(host=host, token=token))
        return dict(reply.result or {})

    async def undrain(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "undrain", "host": H}``: a drained H is a spare again."""
        reply = await self._ask(lambda token: vocabulary.UndrainRequested(host=host, token=token))
        return dict(reply.result or {})

    async def stop(self) -> dict[str, Any]:
        """Request ``{"cmd": "stop"}``: stop every worker (or detach), then the daemon."""
        self._request_stop("control socket")
        return {"stopping": True, "on_exit": self._shell.config.run.on_exit}

    async def unfreeze(self) -> dict[str, Any]:
        """Request ``{"cmd": "unfreeze"}``; response ``{"frozen": false, "was_frozen": bool}``."""
        reply = await self._ask(lambda token: vocabulary.UnfreezeRequested(token=token))
        return dict(reply.result or {})

    async def handover(self) -> dict[str, Any]:
        """Request ``{"cmd": "handover"}``: leave every worker running, release the run lock
        and stay off it for ``[ha] handover_hold_s`` so that a standby takes it."""
        token = next(self._tokens)
        self._shell.lead(leadership.HandoverAsked(token=token))
        reply = self._lead_replies.pop(token)
        if reply.refusal is not None:
            raise ControlError(reply.message, code=reply.refusal)
        return dict(reply.result or {})

    def subscribe(self) -> EventSubscription:
        """A live stream of ``host.state`` events for ``reward-supervisor events``."""
        return self._presenter.subscribe()

    # --- reload -------------------------------------------------------------------------------

    def request_reload(self) -> None:
        """Re-read the config soon (SIGHUP); repeated requests converge to the last file."""
        self._reload_wanted.set()

    async def reload_loop(self) -> None:
        """Serve SIGHUP's reloads, one at a time, for as long as the daemon leads."""
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            try:
                await self.reload()
            except ControlError as exc:
                log.warning("config.reload_skipped", reason=str(exc))
            except Exception:  # task root: a failed reload must not end the daemon
                source = str(self._shell.config.source)
                log.exception("config.reload_failed_internally", kept=source)

    async def reload(self) -> dict[str, Any]:
        """Re-read and validate the config; apply it, or keep the old one and say why.

        A standby only checks the file: it applies the config as it is when it takes over.

        Request ``{"cmd": "reload"}``; response ``{"reloaded": bool, "errors": [...],
        "added": [...], "removed": [...], "restarted": [...], "updated": [...]}``.
        """
        _raise_if_refused(leadership.refusal(self._leading(), "reload"))
        async with self._reload_lock:
            self._notifier.reloading()
            try:
                return await self._reload()
            finally:
                # RELOADING=1 leaves systemd showing "reloading" until READY=1, however the
                # reload ended.
                self._notifier.ready()

    async def _reload(self) -> dict[str, Any]:
        """``reload`` under its lock, between RELOADING=1 and READY=1."""
        source = self._shell.config.source
        try:
            new = await asyncio.to_thread(config_mod.load, source)
        except ConfigError as exc:
            errors = [str(p) for p in exc.problems]
            self._facts.last_reload_errors = errors
            log.error("config.reload_failed", errors=errors, kept=str(source))
            self._presenter.reload_counted("error")
            return {"reloaded": False, "errors": errors}
        self._apply_config(new)
        try:
            await asyncio.to_thread(layout.write_run_files, new)
        except OSError as exc:
            log.error("run.files_not_written", reason=str(exc))
        members = config_mod.members(new)
        reply = await self._ask(
            lambda token: vocabulary.Reconfigured(
                members=members, health=new.health, policy=new.fleet, token=token
            )
        )
        result = dict(reply.result or {})
        self._facts.reloads += 1
        self._presenter.reload_counted("ok")
        self._facts.last_reload_errors = []
        log.info("config.reloaded", **result)
        return {"reloaded": True, "errors": [], **result}


def _raise_if_refused(refused: tuple[Refusal, str] | None) -> None:
    """Raise the leadership core's refusal, with its code, if there is one."""
    if refused is not None:
        code, message = refused
        raise ControlError(message, code=code)
