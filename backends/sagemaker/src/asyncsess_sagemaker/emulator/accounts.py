"""One emulated service per AWS account: its own sessions, model package groups and packages, on a shared engine."""

from __future__ import annotations

from anyio.abc import TaskGroup

from asyncsess.backends import Backend

from .config import EmulatorConfig
from .service import EmulatedService

__all__ = ["Accounts"]


class Accounts:
    """The accounts' services (created at a first call: in the emulator's :attr:`EmulatorConfig.accounts`, or its one
    ``account_id``). They share the inner backend, the public hub and the task group; nothing else."""

    def __init__(self, inner: Backend, config: EmulatorConfig) -> None:
        self.config = config
        self._default = EmulatedService(inner, config)
        self._services = {config.account_id: self._default}
        self._tg: TaskGroup | None = None

    async def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        await self._default.start(tg)

    def __contains__(self, account_id: object) -> bool:
        return account_id in self._services

    def service(self, account_id: str) -> EmulatedService:
        svc = self._services.get(account_id)
        if svc is None:
            assert self._tg is not None, "Accounts.start() was not called"
            svc = EmulatedService(self._default.inner, self.config.model_copy(update={"account_id": account_id}))
            svc.attach(self._tg, self._default.hub)
            self._services[account_id] = svc
        return svc

    async def shutdown(self) -> None:
        for svc in self._services.values():
            await svc.shutdown()
