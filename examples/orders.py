"""The payload both example programs share: a typed order (a dataclass; a pydantic model
works the same way)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Line:
    sku: str
    qty: int


@dataclass
class Order:
    customer: str
    lines: list[Line]
    express: bool = False
    currency: Literal["EUR", "USD"] = "EUR"
    notes: list[str] = field(default_factory=list)


#: Where orders go: the web service publishes here, the worker's group listens on "orders.#".
TOPIC = "orders.created"
GROUP = "fulfilment"
