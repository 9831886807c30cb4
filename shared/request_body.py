"""The request class of the HTTP services: a JSON body too deeply nested for the decoder is a 400, not a 500.

msgspec (Litestar's JSON decoder) raises ``RecursionError`` on a body nested past about 1,000 levels, which
Litestar does not map to a client error; such a body is refused here before any handler or validator sees it.
Shallower bodies decode, and the request schemas bound their free-form values (``shared.json_bounds``).
"""

from __future__ import annotations

from typing import Any

from litestar import Request

from shared.errors import ValidationError
from shared.json_bounds import MAX_JSON_DEPTH


class BoundedRequest(Request[Any, Any, Any]):
    """Litestar's request, with a body too deeply nested to decode refused (400, ``code: body_too_deep``)."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError:
            raise ValidationError(
                "the request body is nested too deeply to decode "
                f"(free-form values may nest at most {MAX_JSON_DEPTH} levels of objects and arrays)",
                code="body_too_deep",
            ) from None
