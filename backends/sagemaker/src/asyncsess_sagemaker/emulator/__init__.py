"""A local emulator of the SageMaker training-session wire protocols, executing on any asyncsess backend."""

from .app import create_app
from .config import AccountKey, EmulatorConfig, FaultConfig
from .server import RunningEmulator, running_emulator, serve

__all__ = ["AccountKey", "create_app", "EmulatorConfig", "FaultConfig", "RunningEmulator", "running_emulator", "serve"]
