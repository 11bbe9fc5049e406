"""What a train stage did, run by run: one typed result for one run, a vectorized group, a worker's job
and a whole study, so that callers read fields instead of string keys."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainOutcome:
    """Run ids by how their training ended in this call.

    trained: trained (or resumed) to their endpoint now; skipped: already finished (or finished by another
    job meanwhile); locked: held by another job; failed: marked failed (the error is in their run.json).
    """

    trained: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, other: "TrainOutcome") -> None:
        """Append `other`'s runs to this outcome's."""
        for name in ("trained", "skipped", "locked", "failed"):
            getattr(self, name).extend(getattr(other, name))


@dataclass
class WorkerReport:
    """A training worker's answer for one job: its outcome and output lines, and how it stopped if a
    signal or Ctrl-C stopped it (reported, not raised, so that the parent decides), or the one-line error
    that ended it."""

    outcome: TrainOutcome
    lines: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    signum: int | None = None
    interrupted: list[str] = field(default_factory=list)
    error: str | None = None
