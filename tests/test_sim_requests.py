"""The simulated backend's request table (``sim/requests.py``): its fields, and how rows are
admitted, moved, parked for resubmission and resubmitted."""

import numpy as np

from dora_jax.orchestrator.backend import PartialRequest, RequestSpec
from dora_jax.sim.requests import FIELDS, RequestTable


def table_with_one_request() -> RequestTable:
    """Group 0 holds request 10, its fields 10, 11, 12, ... in the order of ``FIELDS``."""
    t = RequestTable(2, 1)
    t.count[0] = 1
    for i, f in enumerate(FIELDS):
        getattr(t, f)[0, 0] = 10 + i
    return t


def test_a_parked_row_holds_every_field_and_counts_its_cached_context_as_reprefill():
    t = table_with_one_request()
    assert t.ids(0) == [10] and t.context(1)[0, 0] == 12 + 14  # prompt and response
    t.park(0, t.rows(0, [10]))
    assert t.count.tolist() == [0, 0]
    row = dict(zip(FIELDS, t.parked[10].tolist(), strict=True))
    want = {f: 10 + i for i, f in enumerate(FIELDS)} | {"reprefill_left": 12 + 14 - 15}
    assert row == want
    t.restart(10)  # its response starts over; its prompt was computed once
    row = dict(zip(FIELDS, t.parked[10].tolist(), strict=True))
    assert row["generated"] == 0 and row["reprefill_left"] == 12


def test_a_resumed_request_takes_its_parked_row_and_prefills_its_context_again():
    t = table_with_one_request()
    t.park(0, np.array([0]))
    resume = PartialRequest(10, 11, 12, 5, (0,))
    specs = [RequestSpec(7, 3, 0, 20), RequestSpec(10, 11, 0, 12, resume=resume)]
    t.append(1, specs, np.array([100, 999]))  # (a resumed request keeps its own target)
    assert not t.parked and t.ids(1) == [7, 10] and t.count.tolist() == [0, 2]
    new, resumed = ({f: int(getattr(t, f)[1, i]) for f in FIELDS} for i in range(2))
    assert new == {f: 0 for f in FIELDS} | {
        "request_id": 7,
        "prompt_group": 3,
        "prompt_len": 20,
        "target": 100,
        "prefill_left": 20,
    }
    parked = {f: 10 + i for i, f in enumerate(FIELDS)}
    assert resumed == parked | {
        "generated": 5,  # what the control plane kept
        "prefill_left": 12 + 5,
        "reprefill_left": 12 + 14 - 15,
        "sampled": 0,
    }


def test_rows_move_to_another_group_in_the_order_given_and_the_table_grows():
    t = RequestTable(2, 2)
    t.append(0, [RequestSpec(r, 0, 0, 8) for r in (3, 1, 2)], np.array([5, 6, 7]))
    assert t.ids(0) == [3, 1, 2] and t.width() == 3 and t.held(3).tolist()[1] == [False] * 3
    t.move(0, t.rows(0, [2, 3]), 1)
    assert t.ids(0) == [1] and t.ids(1) == [2, 3] and t.target[1, :2].tolist() == [7, 5]
    t.remove(1, np.array([0]))
    assert t.ids(1) == [3] and t.held(3).tolist() == [[True, False, False]] * 2
