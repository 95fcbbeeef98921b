"""What model calls spent, counted from the journal, and what it costs (internal).

Every model step journals the model's name and the token ``usage`` the
model reported (``{"input_tokens", "output_tokens", "total_tokens"}``, or
None), so the totals come from the journal and are exact: every attempt
counts, a call re-run after a crash included (docs/usage.md). The run
aggregate, the views and the budget check all count with these functions;
``Prices`` turn tokens into a cost.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import InvalidArgumentError
from ..redaction import Redacted
from ..shapes import Usage

__all__ = [
    "PRICES_ENV",
    "ModelUsage",
    "Prices",
    "cost_of",
    "normalise_usage",
    "prices_from_json",
    "result_usage",
    "total",
    "usage_kept_clear",
    "validate_prices",
]

#: ``{"model-name": (input_per_1k, output_per_1k)}``: what 1,000 tokens cost.
Prices = Mapping[str, tuple[float, float]]


class ModelUsage(BaseModel):
    """One model's share of a usage total (what a price applies to)."""

    model_config = ConfigDict(frozen=True)

    model: str
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


def normalise_usage(raw: Any) -> dict[str, int | None] | None:
    """A model's reported usage as ``{"input_tokens", "output_tokens", "total_tokens"}``.

    Accepts those names or the OpenAI ones (``prompt_tokens``,
    ``completion_tokens``); a missing total is the sum of the two. None when
    the model reported nothing usable.
    """
    if not isinstance(raw, Mapping):
        return None
    input_tokens = _count(raw.get("input_tokens", raw.get("prompt_tokens")))
    output_tokens = _count(raw.get("output_tokens", raw.get("completion_tokens")))
    total_tokens = _count(raw.get("total_tokens"))
    if total_tokens is None and input_tokens is not None and output_tokens is not None:
        total_tokens = input_tokens + output_tokens
    if input_tokens is None and output_tokens is None and total_tokens is None:
        return None
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": total_tokens,
    }


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


def cost_of(by_model: list[ModelUsage], prices: Prices | None) -> float | None:
    """What the tokens cost under ``prices``; None unless every model that
    reported tokens has a price (a partial sum would read as the whole)."""
    if prices is None:
        return None
    cost = 0.0
    for usage in by_model:
        if usage.input_tokens == 0 and usage.output_tokens == 0:
            continue
        price = prices.get(usage.model)
        if price is None:
            return None
        cost += usage.input_tokens / 1000 * price[0] + usage.output_tokens / 1000 * price[1]
    return cost


def total(by_model: list[ModelUsage], tool_calls: int, prices: Prices | None) -> Usage:
    """The ``Usage`` of per-model shares (and a count of tool calls)."""
    return Usage(
        model_calls=sum(u.calls for u in by_model),
        input_tokens=sum(u.input_tokens for u in by_model),
        output_tokens=sum(u.output_tokens for u in by_model),
        total_tokens=sum(u.total_tokens for u in by_model),
        tool_calls=tool_calls,
        cost=cost_of(by_model, prices),
    )


def validate_prices(prices: Any) -> dict[str, tuple[float, float]] | None:
    """``Runtime(prices=...)`` checked: model name -> (input_per_1k, output_per_1k)."""
    if prices is None:
        return None
    checked: dict[str, tuple[float, float]] = {}
    if isinstance(prices, Mapping):
        for model, pair in prices.items():
            if (
                isinstance(model, str)
                and isinstance(pair, tuple | list)
                and len(pair) == 2
                and all(_is_price(p) for p in pair)
            ):
                checked[model] = (float(pair[0]), float(pair[1]))
                continue
            msg = (
                f"prices[{model!r}] must be (input_per_1k, output_per_1k), two "
                f"non-negative numbers; got {pair!r}"
            )
            raise InvalidArgumentError(msg)
        return checked
    msg = f"prices must be a mapping of model name to (input_per_1k, output_per_1k); got {prices!r}"
    raise InvalidArgumentError(msg)


def _is_price(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    )


#: The variable the read-only tools (``kuralle-es runs usage``, the dashboard)
#: take prices from: a JSON object, model name -> [input_per_1k, output_per_1k].
PRICES_ENV = "KURALLE_PRICES"


def prices_from_json(text: str, source: str = PRICES_ENV) -> dict[str, tuple[float, float]]:
    """Prices written as JSON (``{"gpt-4o-mini": [0.00015, 0.0006]}``), checked;
    ``InvalidArgumentError`` naming ``source`` if they are not."""
    try:
        parsed = json.loads(text)
    except ValueError as e:
        msg = f"{source} is not JSON: {e}"
        raise InvalidArgumentError(msg) from None
    if not isinstance(parsed, dict):
        msg = f"{source} must be a JSON object of model name to [input_per_1k, output_per_1k]"
        raise InvalidArgumentError(msg)
    try:
        checked = validate_prices(parsed)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{source}: {e}") from None
    assert checked is not None
    return checked


def result_usage(result_json: Any) -> dict[str, int | None] | None:
    """The token usage a model step's recorded response (its JSON text) reported,
    normalised; of an erased response, the usage kept readable beside it."""
    if not isinstance(result_json, str):
        # Erased (``Redacted``) or still sealed (the views' ``Sealed``): the usage
        # kept readable beside the response, if any.
        kept = result_json.kept if isinstance(result_json, Redacted) else None
        kept = kept or getattr(result_json, "clear", None) or {}
        usage: dict[str, int | None] | None = kept.get("usage") if isinstance(kept, dict) else None
        return usage
    try:
        response = json.loads(result_json)
    except ValueError:
        return None
    return normalise_usage(response.get("usage") if isinstance(response, dict) else None)


def usage_kept_clear(result_json: Any) -> dict[str, Any] | None:
    """What of a step's result stays readable when it is sealed: a reported usage."""
    usage = result_usage(result_json)
    return {"usage": usage} if usage is not None else None
