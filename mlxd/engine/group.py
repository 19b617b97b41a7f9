"""Where ``mlxd.cli`` finds :func:`init_group` today; the group's transport lives in
:mod:`mlxd.engine.distributed.channel` (import it from there)."""

from mlxd.engine.distributed.channel import init_group

__all__ = ["init_group"]
