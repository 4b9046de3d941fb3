"""The control plane's invariants (DESIGN section 5), checked on a finished run of any backend."""

from collections import Counter


def assert_run_invariants(
    *,
    mode: str,
    k: int,
    group_size: int,
    num_groups: int,
    plan_period_ticks: int,
    runtime,
    records,
    ledger: dict,
    trainer_batches,
    live_requests: int,
    discards: bool = False,
) -> None:
    """``trainer_batches``: ``[(version, request ids), ...]`` as the trainer received them;
    ``discards``: the mode may discard requests (``oversample`` always may)."""
    rec = records
    # 1. every dispatched request ends exactly once
    assert len(ledger) == runtime.manager.dispatched_prompt_groups * group_size > 0
    states = Counter(ledger.values())
    allowed = {"consumed", "discarded"} if mode == "oversample" or discards else {"consumed"}
    assert set(states) <= allowed, states
    fed = [rid for _, ids in trainer_batches for rid in ids]
    assert len(fed) == len(set(fed)) == states["consumed"]
    assert set(fed) == {rid for rid, s in ledger.items() if s == "consumed"}
    assert sum(n for _, n in rec.discards) == states["discarded"]
    assert live_requests == 0

    # 2. staleness <= K; at most K + 1 versions coexist
    assert len(rec.consumed) == len(fed)
    assert all(0 <= c.staleness <= k for c in rec.consumed)
    assert all(c.trainer_version - c.staleness == c.version for c in rec.consumed)
    assert all(c.window_versions <= k + 1 for c in rec.cluster)
    for row in rec.groups:
        assert len({g.version for g in row if g.active}) <= k + 1
    assert rec.summary().max_live_versions <= k + 1  # the wall clock's spans too

    # 3. version span; 4. no re-prefill outside partial
    spans = [c.version_span for c in rec.consumed]
    reprefill = sum(g.reprefill_tokens for row in rec.groups for g in row)
    reprefill += sum(g.reprefill_tokens for g in rec.spans)
    if mode == "partial":
        assert all(1 <= s <= k + 1 for s in spans)
    else:
        assert all(s == 1 for s in spans)
        assert reprefill == 0

    # 5. dora: an idle group never waits more than a planning period while requests wait (ticks:
    # the logical clock only; on the wall clock a group's idle time is reported, not bounded)
    if mode == "dora" and rec.clock == "logical":
        streak = [0] * num_groups
        for row, c in zip(rec.groups, rec.cluster, strict=True):
            for g in row:
                starving = g.activity == "idle" and g.active == 0 and c.pending > 0
                streak[g.group] = streak[g.group] + 1 if starving else 0
                assert streak[g.group] <= plan_period_ticks, (g, c)
