"""Wall-clock records: how many versions hold requests at once, from the groups' spans."""

from dora_jax.orchestrator.backend import GroupTick
from dora_jax.orchestrator.records import _max_live


def span(group, version, activity, active, t0, t1):
    return GroupTick(group, version, activity, active, 0, 0, 0, t1 - t0, t0, t1)


def test_a_group_whose_last_request_finished_holds_no_version():
    # sync: group 0 finishes its last v0 request in [1, 2) and idles until its v1 load at [6, 7);
    # group 1 already decodes v1 at [4, 5) (its load came first). One version at a time.
    spans = [
        span(0, 0, "decode", 2, 0.0, 1.0),
        span(0, 0, "decode", 1, 1.0, 2.0),
        span(1, 0, "decode", 1, 0.5, 1.5),
        span(1, 1, "transfer", 0, 3.0, 3.5),
        span(1, 1, "decode", 1, 4.0, 5.0),
        span(0, 1, "transfer", 0, 6.0, 7.0),
    ]
    assert _max_live(spans, 2) == 1


def test_versions_held_across_gaps_between_steps_count():
    # group 0 keeps v0 requests across a gap between two decode steps ([1, 1.2) has no span);
    # group 1 decodes v1 inside that gap: two versions at once
    spans = [
        span(0, 0, "decode", 3, 0.0, 1.0),
        span(0, 0, "decode", 3, 1.2, 2.0),
        span(1, 1, "decode", 2, 1.05, 1.1),
        span(2, 2, "decode", 1, 5.0, 6.0),
    ]
    assert _max_live(spans, 3) == 2
    # a third version overlapping both
    assert _max_live([*spans, span(2, 2, "prefill", 1, 1.06, 1.07)], 3) == 3
