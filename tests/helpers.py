"""Small test helpers."""

import os

from diloco_eqx.profiling import count_compilations
from tests.conftest import QUICK_COMPILE

__all__ = ["count_compilations", "subprocess_env"]


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment for a Python subprocess a test starts: the tests' compile settings,
    and `devices` simulated CPU devices if given (else the process asks for its own)."""
    flags = QUICK_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
    return {**os.environ, "XLA_FLAGS": flags, **extra}
