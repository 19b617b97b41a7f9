"""One model over a tensor-parallel group (``mlx.core.distributed``): rank 0 plans, every rank runs the plan.

Every rank holds a shard of each layer (mlx-lm's ``model.shard(group)``) and must run the same forward passes in
the same order: each pass sums partial results across the group. Rank 0's engine serves HTTP and runs the
scheduler; its :class:`~mlxd.engine.distributed.leader.Leader` records every command the engine applies
(:mod:`mlxd.engine.commands`: requests accepted, cancelled, kept, dropped; the prefix cache evicted or cleared;
end all, stop) and, before each step, sends them with the step's prompt plan (:class:`~.channel.Message`).

The other ranks (:class:`~mlxd.engine.distributed.follower.Follower`) apply what they receive through the same
:meth:`~mlxd.engine.core.EngineCore.apply`, so their rows, caches and prefix caches stay identical to rank 0's,
shard for shard; a digest of that state travels with each message and a follower that differs stops. Tokens are
sampled on rank 0 and shared inside the step's graph (:meth:`~.channel.Channel.share_tokens`), so nothing sampled
elsewhere is ever fed. Messages go over the group's own collectives (:mod:`.channel`): no transport of our own.

Failure: a step that fails on one rank cannot be known to have failed on the others, so any error inside a step
ends the job (the process exits non-zero; launchd or systemd restarts it), except requests refused by checks
every rank makes alike. A peer that dies can leave rank 0 blocked inside a collective: the leader's watchdog ends
every request with an error after ``step_timeout_s`` and calls the engine's ``on_failure``. A follower that hears
nothing for longer than that (rank 0 pings while idle) exits non-zero too.
"""
