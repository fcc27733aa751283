"""Table agreement: every rank of a communicator plans with the same tuning table, or none starts.

Semantics: ``agree_on_planner`` loads this machine's tuning table (ddl_triton/planning/tuning_table.py:
``Options.tuning_file``, else the table for this world size, topology and transport under
``Options.tuning_dir``), then compares the tables' digests across the ranks (a collective
call over the bootstrap). Ranks whose tables differ could choose different schedules for one
call and deadlock, so every rank raises the same ValueError naming each rank's table; a rank
that cannot read its table makes every rank raise TuningTableError (a rank leaving alone
would hang the others). A table measured with another shm slot layout brings its own
(chunk_bytes, pipeline_depth) unless the options set non-default ones; its tuned Triton
launch configurations are applied to the kernels. Without a fitted model, a communicator that
spans hosts measures the link between them first (link_probe.py) and plans with it.

It lives in runtime/, not planning/, because it talks to the other ranks: planning/ only
decides, from what it is given.
"""
from __future__ import annotations

from ...options import Options
from ...planning.planner import Planner
from ...planning import tuning_table
from . import link_probe
from .bootstrap_values import shaped
from .placement import Placement


def agree_on_planner(bootstrap, placement: Placement, options: Options) -> tuple[Planner, Options]:
    """The planner every rank uses, and the options in force (the table's slot layout adopted)."""
    rank, size = placement.rank, placement.size
    table, source = None, ""
    if size > 1:
        key = tuning_table.machine_key(world_size=size, topology=placement.topology.signature,
                                 transport=options.transport)
        failure = ""
        try:
            resolved = tuning_table.resolve(options.tuning_file, key, options.tuning_dir)
            table, source = resolved.table, resolved.source
            if rank == 0:
                tuning_table.warn_once(resolved.note)
        except tuning_table.TuningTableError as e:
            failure = str(e)  # raised below on every rank: a rank leaving alone would hang the others
        digests = [shaped(d, (str, str, str), f"rank {r}'s tuning table digest", rank) for r, d in
                   enumerate(bootstrap.allgather([table.digest() if table else "none", source or "no table", failure]))]
        failed = [(r, f) for r, (_, _, f) in enumerate(digests) if f]
        if failed:
            raise tuning_table.TuningTableError(f"rank {rank}: cannot use the tuning table (DDL_TUNING_FILE): "
                                          + "; ".join(f"rank {r}: {f}" for r, f in failed))
        if len(set(d for d, _, _ in digests)) > 1:
            listing = "; ".join(f"rank {r}: {src} ({d})" for r, (d, src, _) in enumerate(digests))
            raise ValueError(f"rank {rank}: the ranks loaded different tuning tables, so they could "
                             f"choose different schedules for one call: {listing}. Give every rank the same "
                             "DDL_TUNING_FILE (or DDL_TUNING_FILE=off)")
        defaults = Options()
        if table is not None and (options.chunk_bytes, options.pipeline_depth) == \
                (defaults.chunk_bytes, defaults.pipeline_depth):
            options = options.replace(chunk_bytes=table.options["chunk_bytes"],
                                      pipeline_depth=table.options["pipeline_depth"])
    if table is not None and table.kernels:
        from ...kernels import launch_configs
        launch_configs.apply(table.kernels)  # tuned Triton launch configurations (GPU path)
    link = None
    if size > 1 and link_probe.before_wiring(placement) and not link_probe.wanted(placement, options, table):
        link = link_probe.measure(bootstrap, placement, options)  # collective: every rank or none
    # A store bootstrap measures it once the transports are open (the communicator: Planner.use_link).
    planner = Planner(rank=rank, size=size, topology=placement.topology, link_of=placement.link,
                      forced=options.schedule, slot_bytes=options.chunk_bytes, table=table, table_source=source,
                      wire_chunk_bytes=options.wire_chunk_bytes, link=link)
    return planner, options
