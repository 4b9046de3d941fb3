"""The simulated backend's requests (:class:`RequestTable`): the requests each group holds, in
admission order, one int64 array per field (``[groups, rows]``, views of one packed array, so
that moving requests between rows or groups is one fancy-index per call), and the rows of
interrupted requests until they are resubmitted (``parked``). Rows grow past a group's slots only
when requests waiting on their environment hold none; the field arrays are replaced then, so
read them from the table, do not keep them."""

from __future__ import annotations

import numpy as np

from dora_jax.orchestrator.backend import RequestSpec

FIELDS = tuple(
    "request_id prompt_group prompt_len target generated prefill_left reprefill_left sampled turn "
    "wake_us pending_observation observation_tokens env_us".split()
)
_RID, _, _PROMPT, _TARGET, _GENERATED, _PREFILL, _REPREFILL, _SAMPLED = range(8)  # FIELDS[:8]


class RequestTable:
    """Each group's requests, field by field (``FIELDS``: one ``[groups, rows]`` array each)."""

    def __init__(self, groups: int, rows: int):
        self._data = np.zeros((len(FIELDS), groups, rows), np.int64)
        self.count = np.zeros(groups, np.int64)  # requests each group holds
        self.parked: dict[int, np.ndarray] = {}  # interrupted request id -> its row
        self._bind()

    def _bind(self) -> None:
        """Name the fields of the packed array (after it was allocated or grown)."""
        (
            self.request_id,
            self.prompt_group,
            self.prompt_len,
            self.target,  # response tokens at the end of the current model turn
            self.generated,  # response tokens so far (observations included)
            self.prefill_left,  # context tokens still to prefill
            self.reprefill_left,  # of which computed before an interrupt (re-prefill)
            self.sampled,  # 1: sampled a token under the group's version
            self.turn,  # conversations: index of the current model turn
            self.wake_us,  # microseconds of modeled time its observation arrives (0: not waiting)
            self.pending_observation,  # observation tokens it is waiting for
            self.observation_tokens,  # observation tokens among generated
            self.env_us,  # environment microseconds so far
        ) = self._data
        self._row = np.arange(self._data.shape[2])

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` requests in every group."""
        have = self._data.shape[2]
        if rows <= have:
            return
        data = np.zeros((len(FIELDS), len(self.count), max(rows, 2 * have)), np.int64)
        data[:, :, :have] = self._data
        self._data = data
        self._bind()

    def width(self) -> int:
        """Rows the fullest group uses: no field needs more columns than that."""
        return int(self.count.max())

    def held(self, w: int) -> np.ndarray:
        """``[groups, w]``: the rows that hold a request."""
        return self._row[None, :w] < self.count[:, None]

    def context(self, w: int) -> np.ndarray:
        """``[groups, w]``: each row's context tokens (its prompt and response so far)."""
        return self.prompt_len[:, :w] + self.generated[:, :w]

    def ids(self, g: int) -> list[int]:
        """The request ids group ``g`` holds, in admission order."""
        return self.request_id[g, : int(self.count[g])].tolist()

    def rows(self, g: int, ids: list[int]) -> np.ndarray:
        """Row indices of ``ids`` in group ``g`` (all must be there)."""
        k = int(self.count[g])
        order = np.argsort(self.request_id[g, :k], kind="stable")
        pos = np.searchsorted(self.request_id[g, :k], ids, sorter=order)
        return order[pos]

    def append(self, g: int, specs: list[RequestSpec], targets: np.ndarray) -> None:
        """Admit ``specs`` to group ``g`` (after the requests it holds) to prefill their context,
        their model turn ending at ``targets``; a resumed one takes its parked row (its turn state
        too) and the response tokens the control plane kept, and prefills its whole context."""
        rows = np.zeros((len(FIELDS), len(specs)), np.int64)
        rid, pg, plen, target = rows[:4]
        rid[:] = [s.request_id for s in specs]
        pg[:] = [s.prompt_group for s in specs]
        plen[:] = [s.prompt_len for s in specs]
        target[:] = targets
        for i, spec in enumerate(specs):
            if spec.resume is not None:
                rows[_TARGET:, i] = self.parked.pop(spec.request_id)[_TARGET:]
                rows[_GENERATED, i] = spec.resume.generated
                rows[_SAMPLED, i] = 0
        rows[_PREFILL] = plen + rows[_GENERATED]
        a, b = int(self.count[g]), int(self.count[g]) + len(specs)
        self._grow(b)
        self._data[:, g, a:b] = rows
        self.count[g] = b

    def remove(self, g: int, rows: np.ndarray) -> None:
        """Take ``rows`` out of group ``g``; the others keep their order."""
        keep = np.ones(int(self.count[g]), bool)
        keep[rows] = False
        idx = np.nonzero(keep)[0]
        self._data[:, g, : len(idx)] = self._data[:, g, idx]
        self.count[g] = len(idx)

    def move(self, src: int, rows: np.ndarray, dst: int) -> None:
        """Move ``rows`` of group ``src``, every field, to the end of group ``dst``."""
        a, b = int(self.count[dst]), int(self.count[dst]) + len(rows)
        self._grow(b)
        self._data[:, dst, a:b] = self._data[:, src, rows]
        self.count[dst] = b
        self.remove(src, rows)

    def park(self, g: int, rows: np.ndarray) -> None:
        """Take ``rows`` out of group ``g`` and keep each in ``parked`` until it is resubmitted;
        the context it had computed counts as re-prefill then."""
        for i in rows.tolist():
            row = self._data[:, g, i].copy()
            row[_REPREFILL] = row[_PROMPT] + row[_GENERATED] - row[_PREFILL]
            self.parked[int(row[_RID])] = row
        self.remove(g, rows)

    def restart(self, request_id: int) -> None:
        """The parked request starts its response over: nothing generated, and its prompt (which
        was computed once) is re-prefill when it is resubmitted."""
        row = self.parked[request_id]
        row[_GENERATED] = 0
        row[_REPREFILL] = row[_PROMPT]
