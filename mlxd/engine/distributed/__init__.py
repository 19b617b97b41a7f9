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
elsewhere is ever fed: that all_sum is the one collective a decode step adds to the model's own. Messages go over a
control connection (:mod:`.control`: TCP from rank 0 to each rank, set up once through the group), which the host
reads as soon as it arrives, so rank 0 plans and sends step n+1 while step n runs on the device, and the others
wait for it on the host; their counters for ``/v1/status`` come back on the same connections, now and then.

Greedy output equals one process's wherever the top two logits differ by more than what the order of the sums
across ranks changes (each rank adds its shard's partial results, then the all-reduce adds the ranks'): in float32
a few ulps; in bfloat16 a near-tie can flip, and the outputs part from there.

Failure: a step that fails on one rank cannot be known to have failed on the others, so any error inside a step
ends the job (the process exits non-zero; launchd or systemd restarts it), except requests refused by checks
every rank makes alike. A peer that dies can leave rank 0 blocked inside a collective: the leader's watchdog ends
every request with an error after ``step_timeout_s`` (a second once that rank's control connection has ended) and
calls the engine's ``on_failure``. A follower whose connection to rank 0 ends, or that hears nothing for longer
than ``step_timeout_s`` (rank 0 pings while idle), exits non-zero too.
"""
