"""File descriptors: the process's limit, raised at start-up, and the connection limit derived from it.

Every connection costs a descriptor. When the process runs out, ``accept`` fails, no new client is served, and the
model, log and image files the daemon opens later fail too. So connections are limited below the descriptor limit
(:func:`connection_limit`): a client beyond it is closed at once, while the reserve stays for everything else.

mlx-lm sets the limit to 2048 (soft) and 4096 (hard) when ``mlx_lm.utils`` is imported. Without the privilege to
raise a hard limit (``CAP_SYS_RESOURCE``) that lowers a larger hard limit for good, and it fails the import, so the
daemon's start, where the hard limit is below 4096. :func:`raise_descriptor_limit` restores the limit the process
started with where it may, and raises the soft limit to the hard one in any case.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from mlxd.errors import ConfigError

# The hard limit mlx-lm sets when mlx_lm.utils is imported (with a soft limit of 2048).
MLX_LM_HARD_LIMIT = 4096
# Connections the derived limit never exceeds: each idle connection may hold up to [server] max_header_bytes of a
# request's headers, so the limit is also a bound on that memory (4096 x 64 KiB = 256 MiB).
MAX_DERIVED_CONNECTIONS = 4096
# Descriptors kept for everything but connections: at least this many, or an eighth of the limit if that is more.
MIN_RESERVE = 64
# uvicorn's default listen backlog, which asyncio also uses as the most connections it accepts in one go.
MAX_BACKLOG = 2048
MIN_BACKLOG = 16


@dataclass(frozen=True)
class DescriptorLimit:
    """The soft and hard ``RLIMIT_NOFILE`` before and after :func:`raise_descriptor_limit`."""

    soft: int
    hard: int
    was_soft: int
    was_hard: int


def _limit() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


STARTED_WITH = _limit()  # before mlx-lm is imported, when this module is imported first (mlxd.cli does)


def check_mlx_lm_can_load() -> None:
    """Raise ``ConfigError`` naming the fix where the hard descriptor limit is below the 4096 mlx-lm sets at import,
    and this process may not raise it: the import would fail with "ValueError: not allowed to raise maximum
    limit" and a traceback."""
    soft, hard = _limit()
    if hard == resource.RLIM_INFINITY or hard >= MLX_LM_HARD_LIMIT or "mlx_lm.utils" in sys.modules:
        return  # (once imported, mlx-lm sets nothing more)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, MLX_LM_HARD_LIMIT))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"the hard limit on open files is {hard}; mlx-lm sets it to {MLX_LM_HARD_LIMIT} when it is imported and "
            f"fails below that: raise it to {MLX_LM_HARD_LIMIT} or more (ulimit -Hn, systemd LimitNOFILE=, "
            f"launchd HardResourceLimits)") from e


def _finite(value: int) -> int:
    # An unlimited hard limit (macOS reports one) does not take a soft limit above OPEN_MAX (10240) there.
    return 10240 if value == resource.RLIM_INFINITY else value


def _larger(a: int, b: int) -> int:
    return resource.RLIM_INFINITY if resource.RLIM_INFINITY in (a, b) else max(a, b)


def raise_descriptor_limit(started_with: tuple[int, int] = STARTED_WITH) -> DescriptorLimit:
    """Raise the soft descriptor limit to the hard one; where the hard limit is now lower than ``started_with``'s
    (mlx-lm lowered it) and the process may raise it, restore that first. Never lowers anything."""
    was_soft, was_hard = _limit()
    unchanged = DescriptorLimit(soft=was_soft, hard=was_hard, was_soft=was_soft, was_hard=was_hard)
    if was_soft == resource.RLIM_INFINITY:
        return unchanged
    for hard in dict.fromkeys((_larger(started_with[1], was_hard), was_hard)):
        soft = _finite(hard)
        if soft <= was_soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (OSError, ValueError):
            continue
        return DescriptorLimit(soft=soft, hard=hard, was_soft=was_soft, was_hard=was_hard)
    return unchanged


def connection_limit(setting: int, soft: int) -> int:
    """The connections to serve at once: ``setting`` when it is not 0, else the soft descriptor limit less a
    reserve (``MIN_RESERVE``, or an eighth of the limit if more), at most ``MAX_DERIVED_CONNECTIONS``, at least 1."""
    if setting:
        return setting
    soft = _finite(soft)
    return max(1, min(MAX_DERIVED_CONNECTIONS, soft - max(MIN_RESERVE, soft // 8)))


def accept_backlog(soft: int, max_connections: int) -> int:
    """The listen backlog: half the descriptors left beside ``max_connections``, within 16-2048.

    asyncio accepts up to the backlog's number of waiting connections in one go, before any of them is served or
    closed, so a connection beyond the limit holds its descriptor a moment all the same; a backlog within the
    reserve keeps such a burst from using up the descriptors everything else needs.
    """
    return max(MIN_BACKLOG, min(MAX_BACKLOG, (_finite(soft) - max_connections) // 2))
