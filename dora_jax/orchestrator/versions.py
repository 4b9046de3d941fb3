"""The version window: which policy versions may still have trajectories, and how many.

Definitions (used everywhere in the control plane):

- Version ``v`` is the policy after ``v`` optimizer steps. A train step *at* version ``v`` consumes
  one batch and produces ``v + 1``; ``v + 1`` is *published* when the step ends.
- A prompt group (and each of its trajectories) is tagged at dispatch with the version it is
  generated under (in ``partial`` mode, the first of the versions it spans).
- **Staleness** of a trajectory of version ``u`` consumed by the step at version ``v`` is
  ``v - u``; the window keeps it ``<= K`` for every consumed trajectory.
- The **consume version** ``c`` is the version of the next step to take a batch: ``latest`` when
  the trainer is idle, ``latest + 1`` while a step runs. Versions ``c - K .. latest`` form the
  window, at most ``K + 1`` of them.

Every train step takes ``per_step`` prompt groups (TBS). Steps ``c, c + 1, ..., w + K`` are the
last that may consume a prompt group of version ``w``, so the control plane keeps, for every
version ``w``, the **dispatch bound**

    open(<= w) <= (w + K - c + 1) * per_step

where ``open(<= w)`` counts prompt groups of versions ``<= w`` dispatched and not yet consumed
(in flight or ready). :meth:`VersionWindow.room` is how many prompt groups one more dispatch at a
version may add without breaking it; :meth:`VersionWindow.can_step` lets the trainer take a batch
only if the bound still holds after the step (in particular no prompt group of version ``c - K``
is left: the next step would see it with staleness ``K + 1``). The window thus advances only
when every trajectory of its oldest version has been consumed, and the trainer waits when
advancing would break the bound. Taking the oldest ``per_step`` open prompt groups always keeps
the bound, so the wait ends once they have finished: no deadlock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class WindowError(RuntimeError):
    """The staleness bound would be broken (a control-plane bug)."""


class VersionWindow:
    """Staleness window of size ``K`` over prompt groups consumed ``per_step`` at a time."""

    def __init__(self, k: int, per_step: int, initial_version: int = 0):
        if k < 0 or per_step <= 0:
            raise ValueError(f"need k >= 0 and per_step > 0, got k={k} per_step={per_step}")
        self.k = k
        self.target_k = k  # adaptive K: where the bound is heading (dispatch uses it at once)
        self.per_step = per_step
        self.first = initial_version  # no version before this one exists
        self.latest = initial_version  # newest published version: the trainer's params
        self.training = False  # a step at `latest` is running
        self._open: dict[int, int] = {}  # version -> prompt groups dispatched, not yet consumed

    # -- queries ---------------------------------------------------------------------------------

    @property
    def consume_version(self) -> int:
        """The version of the train step that will take the next batch."""
        return self.latest + 1 if self.training else self.latest

    @property
    def oldest(self) -> int:
        """The oldest version a trajectory may have and still be consumed within the bound."""
        return self.consume_version - self.k

    def open_count(self, version: int | None = None) -> int:
        if version is None:
            return sum(self._open.values())
        return self._open.get(version, 0)

    def num_live(self) -> int:
        """How many versions have prompt groups not yet consumed."""
        return len(self._open)

    def live_versions(self) -> list[int]:
        """Versions with prompt groups not yet consumed, oldest first."""
        return sorted(v for v, n in self._open.items() if n > 0)

    def room(self, version: int) -> int:
        """How many more prompt groups may be dispatched at ``version`` now."""
        c, k = self.consume_version, min(self.k, self.target_k)
        if version > self.latest or version < max(c - k, self.first):
            return 0
        cum = sum(n for v, n in self._open.items() if v < version)
        caps = []  # room under the bound of every version w >= version
        for w in range(version, self.latest + 1):
            cum += self._open.get(w, 0)
            caps.append((w + k - c + 1) * self.per_step - cum)
        return max(0, min(caps))

    def staleness(self, version: int) -> int:
        """Staleness of a trajectory of ``version`` if the next step consumed it."""
        return self.consume_version - version

    def can_step(self, batch_versions: Iterable[int]) -> bool:
        """Whether the idle trainer may take a batch with these prompt-group versions now.

        Exactly when the dispatch bound still holds once the batch is gone and the trainer is at
        ``latest + 1``: then no prompt group of version ``latest - K`` is left (its staleness
        would exceed K at the next step), and the later steps, taking ``per_step`` prompt groups
        oldest first, can still consume every open prompt group within the bound. Taking a
        younger ready batch while older prompt groups are still generating can break the second
        part; the trainer then waits for them.
        """
        if self.training:
            return False
        taken = Counter(batch_versions)
        v = self.latest
        if any(u > v or v - u > self.k or taken[u] > self._open.get(u, 0) for u in taken):
            return False
        cum = 0
        for w in sorted(self._open):
            cum += self._open[w] - taken[w]
            if cum > (w + self.k - v) * self.per_step:
                return False
        return True

    def set_k(self, k: int) -> int:
        """Aim the bound at ``k`` from now on; return the bound in force. Raising it is always
        safe. Lowering it takes effect at once for dispatch (:meth:`room`), and for consumption
        only as far as the prompt groups already open allow (:meth:`min_k`), so the trainer can
        still consume them all within it (the no-deadlock argument above holds as if that had
        been the bound all along); call again after steps to let the bound follow."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.target_k = k
        self.k = max(k, self.min_k()) if k < self.k else k
        return self.k

    def min_k(self) -> int:
        """The smallest bound the prompt groups already open satisfy (at most the current one):
        ``open(<= w) <= (w + k - c + 1) * per_step`` for every ``w``."""
        return min(self.smallest_k(), self.k)

    def smallest_k(self) -> int:
        """The smallest K under which the open prompt groups keep the dispatch bound (not
        capped by this window's K: a window restored under a smaller K may need more)."""
        c, cum, need = self.consume_version, 0, 0
        for w in sorted(self._open):
            cum += self._open[w]
            need = max(need, -(-cum // self.per_step) - w + c - 1)
        return need

    def bound_violation(self, k: int | None = None) -> int | None:
        """The oldest version ``w`` whose open prompt groups break the dispatch bound (with
        ``k``, default this window's K), or None. Always None for a window that was run under
        its own K; a window restored under a smaller K or TBS may break it, and then could not
        consume everything in flight."""
        k = self.k if k is None else k
        c, cum = self.consume_version, 0
        for w in sorted(self._open):
            cum += self._open[w]
            if cum > (w + k - c + 1) * self.per_step:
                return w
        return None

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "first": self.first,
            "latest": self.latest,
            "training": self.training,
            "open": dict(self._open),
            "k": self.k,
            "target_k": self.target_k,
        }

    def load_state_dict(self, state: dict) -> None:
        self.first, self.latest = state["first"], state["latest"]
        self.training, self._open = state["training"], dict(state["open"])
        self.k = state.get("k", self.k)
        self.target_k = state.get("target_k", self.k)

    # -- updates ---------------------------------------------------------------------------------

    def add(self, version: int, n: int = 1) -> None:
        """``n`` prompt groups were dispatched at ``version``."""
        room = self.room(version)
        if n > room:
            raise WindowError(f"dispatching {n} at v{version} exceeds the room ({room})")
        self._open[version] = self._open.get(version, 0) + n

    def close(self, version: int, n: int = 1) -> None:
        """``n`` prompt groups of ``version`` left without training (discarded)."""
        left = self._open.get(version, 0) - n
        if left < 0:
            raise WindowError(f"closing {n} prompt groups of v{version}: only {left + n} open")
        if left:
            self._open[version] = left
        else:
            self._open.pop(version, None)

    def retag(self, old: int, new: int, n: int = 1) -> None:
        """Move ``n`` open prompt groups from ``old`` to the newer ``new`` (not started yet). This
        only lowers ``open(<= w)`` for ``old <= w < new``, so the bound keeps holding."""
        if not old <= new <= self.latest or new < self.first:
            raise WindowError(f"cannot re-tag v{old} -> v{new} (latest v{self.latest})")
        self.close(old, n)
        self._open[new] = self._open.get(new, 0) + n

    def begin_step(self, batch_versions: list[int]) -> None:
        """The trainer takes a batch (one version per prompt group) for the step at ``latest``."""
        if not self.can_step(batch_versions):
            raise WindowError(
                f"step at v{self.latest} with versions {sorted(batch_versions)} breaks K={self.k} "
                f"(open: {dict(sorted(self._open.items()))})"
            )
        for u, n in Counter(batch_versions).items():
            self.close(u, n)
        self.training = True

    def publish(self, version: int) -> None:
        """The running step ended and produced ``version``."""
        if not self.training or version != self.latest + 1:
            raise WindowError(f"publish(v{version}) without a step at v{version - 1} running")
        self.latest = version
        self.training = False
