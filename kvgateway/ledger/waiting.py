"""Which backends Redis lists this replica as waiting for (its wait sets), and what to
tell Redis when the queue changes.

While a replica has requests queued for a backend it is in that backend's wait set: the
other replicas' *new* requests there are refused (they queue too), so freed room goes to
whoever waited longest across replicas. Entering is announced (a refusal in Redis is, and
a request that queues on its own view is told here), so that replicas keeping credit there
give it back; leaving is told as soon as the queue there empties.
"""

from __future__ import annotations


class WaitMarks:
    def __init__(self) -> None:
        self.noted: set[str] = set()  # what Redis lists, as far as this replica knows

    def confirmed(self, name: str, *, refused: bool, still_waiting: bool) -> None:
        """A reserve answered: a refusal lists this replica there, a grant sets the
        listing to whether more of its requests still wait."""
        if refused or still_waiting:
            self.noted.add(name)
        else:
            self.noted.discard(name)

    def heartbeat(self, waiting: set[str]) -> None:
        """A heartbeat wrote the listing for every backend."""
        self.noted = set(waiting)

    def changes(self, waiting: set[str]) -> tuple[set[str], set[str]]:
        """(to enter, to leave): backends waited for now that Redis does not list this
        replica at, and those it lists where nothing waits any more."""
        return waiting - self.noted, self.noted - waiting

    def sent(self, enter: set[str], leave: set[str]) -> None:
        self.noted |= enter
        self.noted -= leave
