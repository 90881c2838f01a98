"""The NIXL library, imported once UCX's environment is set, and what its errors say.

Every room of the nixl channel takes NIXL's names from here, so that whichever is imported first, the environment
defaults are in place before UCX loads (``pdkv.channels.ucx_env``).
"""

from __future__ import annotations

from pdkv.channels.ucx_env import UCX_ENV_DEFAULTS, OpenChannels, apply_env_defaults

NIXL_ENV_DEFAULTS: dict[str, str] = {**UCX_ENV_DEFAULTS, "NIXL_LOG_LEVEL": "WARN"}
apply_env_defaults(NIXL_ENV_DEFAULTS)

# UCX reads the environment set above when it loads, hence these late imports.
import nixl._bindings as nixl_bindings  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle, nixl_xfer_handle  # noqa: E402

OPEN = OpenChannels()  # after the library's import: see OpenChannels

# The bindings' exceptions share no base class but Exception; catch exactly them.
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    v for k, v in vars(nixl_bindings).items() if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
)

__all__ = [
    "NIXL_ENV_DEFAULTS",
    "NIXL_ERRORS",
    "OPEN",
    "describe_nixl_error",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_bindings",
    "nixl_prepped_dlist_handle",
    "nixl_xfer_handle",
]


def describe_nixl_error(exc: BaseException) -> str:
    """A message a user can act on for a NIXL exception."""
    if isinstance(exc, nixl_bindings.nixlRemoteDisconnectError):
        return "the peer disconnected (its process exited or closed its channel)"
    return f"NIXL {type(exc).__name__}: {exc}"
