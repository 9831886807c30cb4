"""The tenant's spending allowance as the device knows it: told by the cloud at every sync.

Local answers are billed like cloud ones (the usage records the agent syncs are rated and added to the tenant's
spend), so once the cloud reports the allowance used up the agent stops answering locally: it refuses with
OpenAI's 429 ``insufficient_quota`` (``on_exhausted = "refuse"``, the default) or sends the request to the
cloud (``"escalate"``), which holds the authoritative budget and reserves against it before generating. The
allowance is as fresh as the last sync, so a device can overspend by what it serves in one sync interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.edge_protocol import Allowance
from shared.errors import ApplicationError

OnExhausted = Literal["refuse", "escalate"]
QUOTA_REASON = "quota-exhausted"


class QuotaExhaustedError(ApplicationError):
    """OpenAI's shape for an exhausted quota (the cloud answers the same)."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(slots=True)
class AllowanceGuard:
    """Decides, before a request is served locally, whether the allowance still covers it."""

    on_exhausted: OnExhausted = "refuse"
    allowance: Allowance | None = None  # None: not told yet (or an older cloud): unlimited

    def update(self, allowance: Allowance | None) -> None:
        """The allowance from a sync answer (a sync without one leaves the last known in force)."""
        if allowance is not None:
            self.allowance = allowance

    @property
    def is_exhausted(self) -> bool:
        return self.allowance is not None and self.allowance.is_exhausted

    def must_escalate(self, *, can_escalate: bool) -> bool:
        """False when the request may be served as usual; True when it must go to the cloud instead. Raises
        ``QuotaExhaustedError`` when it must be refused."""
        if not self.is_exhausted:
            return False
        if self.on_exhausted == "escalate" and can_escalate:
            return True
        assert self.allowance is not None
        budget = self.allowance.budget or "the tenant's monthly budget"
        raise QuotaExhaustedError(
            f"{budget} is used up ({self.allowance.remaining} {self.allowance.currency} left as of the last sync, "
            f"{self.allowance.period}); raise the budget or wait for its next period"
        )
