"""Column types every table shares: UTC timestamps and money in integer micros.

``UTCDateTime`` stores a moment as UTC and always reads back a timezone-aware UTC datetime: SQLite keeps the
wall time without its offset (so a non-UTC value bound as-is would be stored wrong) and PostgreSQL answers in
the session's time zone. It is ``DateTime(timezone=True)`` underneath, the type every migration created.

``Micros`` is money as an integer count of 1e-6 of the currency unit (``BIGINT``): SQLite has no exact decimal
(it keeps ``NUMERIC`` as a float), so a sum of a ``NUMERIC`` column drifts there; a sum of integers is exact on
both databases and reads back as a ``Decimal``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

MICROS_PER_UNIT = 1_000_000


def as_utc(ts: datetime) -> datetime:
    """``ts`` in UTC; a naive datetime is taken to be UTC already (the storage convention)."""
    return ts.astimezone(UTC) if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp column: stored as UTC, read back timezone-aware (UTC) on SQLite and PostgreSQL alike."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return as_utc(value) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return as_utc(value) if value is not None else None


def to_micros(amount: Decimal | int | str) -> int:
    """``amount`` (currency units) as integer micros; ValueError for a float or anything finer than 1e-6."""
    if isinstance(amount, float):
        raise ValueError(f"money must be a Decimal, an int or a string, not the float {amount!r}")
    micros = Decimal(amount).scaleb(6)
    if micros != micros.to_integral_value():
        raise ValueError(f"{amount} has more than 6 decimal places")
    return int(micros)


def from_micros(micros: int | Decimal) -> Decimal:
    """Integer micros back to currency units, exactly (``1500`` -> ``Decimal("0.001500")``)."""
    return Decimal(int(micros)).scaleb(-6)


class Micros(TypeDecorator[Decimal]):
    """A money column kept as integer micros (``BIGINT``); Python sees ``Decimal``, and so does ``SUM`` of it.

    A Python value compared with the column itself is converted; an expression built from it (``column + amount``)
    is a plain ``BIGINT`` of micros, so wrap the values used with such an expression: ``literal(amount, Micros())``.
    """

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> int | None:
        return to_micros(value) if value is not None else None

    def process_result_value(self, value: Any, dialect: Dialect) -> Decimal | None:
        return from_micros(value) if value is not None else None
