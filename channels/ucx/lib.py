"""The ucxx library, imported once UCX's environment is set, and its errors.

Every room of the ucx channel takes ucxx's names from here, so that whichever is imported first, the environment
defaults are in place before UCX loads (``pdkv.channels.ucx_env``).
"""

from __future__ import annotations

from pdkv.channels.ucx_env import UCX_ENV_DEFAULTS, OpenChannels, apply_env_defaults

# UCX_RNDV_THRESH=inf: tag messages go eagerly, never by rendezvous. UCX 1.21 crashes the process when it aborts
# a rendezvous send whose peer died (ucp_proto_rndv_rts_abort -> ucp_memh_invalidate on a context without a
# registration cache: SIGSEGV, seen in CI); an eager send to a dead peer fails its request like any other.
UCX_CHANNEL_ENV_DEFAULTS: dict[str, str] = {
    **UCX_ENV_DEFAULTS,
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_RNDV_THRESH": "inf",
}
apply_env_defaults(UCX_CHANNEL_ENV_DEFAULTS)

# UCX reads the environment set above when it loads, hence these late imports.
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

OPEN = OpenChannels()  # after the library's import: see OpenChannels

UCX_ERRORS: tuple[type[Exception], ...] = (ucx_api.UCXError,)

__all__ = ["OPEN", "UCX_CHANNEL_ENV_DEFAULTS", "UCX_ERRORS", "Array", "ucx_api"]
