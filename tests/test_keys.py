"""Idempotency keys and flow digests (docs/concepts.md: callsites and idempotency keys).

Every expected key here is computed independently of ``kuralle_es``: either a
literal hex digest obtained once with ``printf '%s' '<canonical json>' | sha256sum``,
or ``hashlib.sha256`` over JSON built with exactly the settings docs/concepts.md
pins (keys sorted, separators ``(",", ":")``, ``ensure_ascii=False``, UTF-8,
no NaN/Infinity).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    idempotency_key,
)

HEX64 = re.compile(r"[0-9a-f]{64}")


def spec_key(logical_run_id: str, callsite: int, payload: Any) -> str:
    """The documented key (docs/concepts.md), written out independently of the library."""
    text = json.dumps(
        {"run": logical_run_id, "callsite": callsite, "payload": payload},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- golden vectors
# (logical run id, callsite, payload, canonical JSON written by hand, sha256sum of it)
GOLDEN: list[tuple[str, int, Any, str, str]] = [
    (
        "r#0",
        0,
        "now",
        '{"callsite":0,"payload":"now","run":"r#0"}',
        "9b693bdd87f4b31d101380cf3e1081b2c25ff48b7c863a2ee63edc4896b0eede",
    ),
    (
        "r#0",
        1,
        "uuid",
        '{"callsite":1,"payload":"uuid","run":"r#0"}',
        "8ba091fe43dc8f222ec4e1f09e39a95b9e2adfb97e958beb017eea8ff85223dc",
    ),
    (
        "r#1",
        0,
        "approve-refund",
        '{"callsite":0,"payload":"approve-refund","run":"r#1"}',
        "a404db2fd2b2dbd3b733e1b61897310bb8e08b4f23ea3428b0039aa2b25e0801",
    ),
    (
        # a tool payload inside a flow: "<run_id>#<epoch>#<flow>@<digest>"
        "9f1c2d3e-0000-4000-8000-000000000001#0#refund@abc123",
        2,
        {"name": "charge", "args": {"currency": "EUR", "amount": 1250}},
        '{"callsite":2,"payload":{"args":{"amount":1250,"currency":"EUR"},"name":"charge"},'
        '"run":"9f1c2d3e-0000-4000-8000-000000000001#0#refund@abc123"}',
        "01f89b87bda3b0474368b38069312a00e6bf97388ef4003df26ad5765d6ba015",
    ),
    (
        # nested dicts given in reverse order: every level is sorted
        "r#3",
        7,
        {
            "name": "nested",
            "args": {"b": {"z": 1, "a": [{"y": 2, "x": 1}, True, False]}, "a": None},
        },
        '{"callsite":7,"payload":{"args":{"a":null,"b":{"a":[{"x":1,"y":2},true,false],"z":1}},'
        '"name":"nested"},"run":"r#3"}',
        "4ce52ed91c2d5d1e0719f36c30deee5f7e43c7bf39161ead62208f7b06cfd772",
    ),
    (
        # non-ASCII stays raw (ensure_ascii=False) and is hashed as UTF-8
        "r#0",
        1,
        {"name": "greet", "args": {"name": "Zoë", "emoji": "🚀", "city": "東京"}},
        '{"callsite":1,"payload":{"args":{"city":"東京","emoji":"🚀","name":"Zoë"},'
        '"name":"greet"},"run":"r#0"}',
        "3bc7a0c75eac871d205a700651495049f9760d31a708b5fb84739753e044c1bc",
    ),
    (
        # JSON escapes: newline, quote and backslash
        "r#0",
        4,
        {"name": "t", "args": {"note": 'line1\nq"b\\e'}},
        '{"callsite":4,"payload":{"args":{"note":"line1\\nq\\"b\\\\e"},"name":"t"},"run":"r#0"}',
        "344f781b36086281a3b58a480173409855419c29298491d02ab80ca331a7028c",
    ),
]


@pytest.mark.parametrize(
    ("run", "callsite", "payload", "canonical", "digest"),
    GOLDEN,
    ids=["now", "uuid", "signal-name", "tool-in-flow", "nested-order", "non-ascii", "escapes"],
)
def test_idempotency_key_matches_golden_sha256_vectors(
    run: str, callsite: int, payload: Any, canonical: str, digest: str
) -> None:
    # The hand-written canonical text really hashes to the golden digest ...
    assert sha256_of(canonical) == digest
    # ... the documented json.dumps settings produce exactly that text ...
    assert spec_key(run, callsite, payload) == digest
    # ... and the library agrees.
    assert idempotency_key(run, callsite, payload) == digest


def test_non_ascii_payload_is_hashed_as_raw_utf8_not_escaped() -> None:
    payload = {"name": "greet", "args": {"name": "Zoë"}}
    escaped = '{"callsite":0,"payload":{"args":{"name":"Zo\\u00eb"},"name":"greet"},"run":"r#0"}'
    raw = '{"callsite":0,"payload":{"args":{"name":"Zoë"},"name":"greet"},"run":"r#0"}'
    key = idempotency_key("r#0", 0, payload)
    assert key == sha256_of(raw)
    assert key != sha256_of(escaped)


def test_dict_insertion_order_never_changes_the_key() -> None:
    a = {"name": "t", "args": {"x": 1, "y": {"p": 1, "q": [1, {"m": 1, "n": 2}]}}}
    b = {"args": {"y": {"q": [1, {"n": 2, "m": 1}], "p": 1}, "x": 1}, "name": "t"}
    assert idempotency_key("r#0", 3, a) == idempotency_key("r#0", 3, b)
    assert idempotency_key("r#0", 3, a) == spec_key("r#0", 3, a)


def test_list_order_run_callsite_and_payload_all_change_the_key() -> None:
    base = idempotency_key("r#0", 0, {"name": "t", "args": {"l": [1, 2]}})
    others = {
        idempotency_key("r#0", 0, {"name": "t", "args": {"l": [2, 1]}}),
        idempotency_key("r#1", 0, {"name": "t", "args": {"l": [1, 2]}}),
        idempotency_key("r#0", 1, {"name": "t", "args": {"l": [1, 2]}}),
        idempotency_key("r#0", 0, {"name": "u", "args": {"l": [1, 2]}}),
        idempotency_key("r#0#f@d1", 0, {"name": "t", "args": {"l": [1, 2]}}),
    }
    assert base not in others
    assert len(others) == 5


@pytest.mark.parametrize(
    "payload",
    ["now", "uuid", None, 0, {"name": "t", "args": {}}, ["x", 1.5, None], "東京"],
)
def test_keys_are_64_lowercase_hex_chars(payload: Any) -> None:
    key = idempotency_key("some-run#0", 12, payload)
    assert HEX64.fullmatch(key), key
    assert key == spec_key("some-run#0", 12, payload)


@pytest.mark.parametrize(
    "payload",
    [
        math.nan,
        math.inf,
        -math.inf,
        {"name": "t", "args": {"x": math.nan}},
        {"name": "t", "args": {"deep": [1, {"y": math.inf}]}},
    ],
    ids=["nan", "inf", "-inf", "nested-nan", "deep-inf"],
)
def test_nan_and_infinity_are_rejected_with_value_error(payload: Any) -> None:
    with pytest.raises(ValueError):
        idempotency_key("r#0", 0, payload)


# --------------------------------------------------------------- across processes
_KEY_SCRIPT = textwrap.dedent(
    """
    import json
    from kuralle_es import idempotency_key
    words = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"}
    # Set iteration order depends on PYTHONHASHSEED; so does this dict's insertion order.
    args = {w: len(w) for w in words}
    keys = [
        idempotency_key("r#0#refund@d", 5, {"name": "tag", "args": args}),
        idempotency_key("r#0", 0, "now"),
        idempotency_key("r#0", 1, {"name": "greet", "args": {"name": "Zoë 東京"}}),
    ]
    print(json.dumps(keys))
    """
)


def _run_python(script: str, hashseed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_keys_are_stable_across_processes_with_different_hash_seeds() -> None:
    first = json.loads(_run_python(_KEY_SCRIPT, "1"))
    second = json.loads(_run_python(_KEY_SCRIPT, "4242"))
    assert first == second
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    expected = [
        spec_key("r#0#refund@d", 5, {"name": "tag", "args": {w: len(w) for w in words}}),
        "9b693bdd87f4b31d101380cf3e1081b2c25ff48b7c863a2ee63edc4896b0eede",
        spec_key("r#0", 1, {"name": "greet", "args": {"name": "Zoë 東京"}}),
    ]
    assert first == expected


_FLOW_SCRIPT = textwrap.dedent(
    """
    from kuralle_es import action, define_flow, end, goto

    async def check(state, ctx):
        return goto("charge")

    async def charge(state, ctx):
        return end("done")

    flow = define_flow("refund", "refund a purchase", "check",
                       [action("check", check), action("charge", charge)])
    print(flow.digest)
    """
)


async def _check(state: dict[str, Any], ctx: Any) -> Any:
    return goto("charge")


async def _charge(state: dict[str, Any], ctx: Any) -> Any:
    return end("done")


def test_flow_digest_is_identical_across_processes() -> None:
    first = _run_python(_FLOW_SCRIPT, "7")
    second = _run_python(_FLOW_SCRIPT, "99991")
    assert HEX64.fullmatch(first), first
    assert first == second
    here = define_flow(
        "refund", "refund a purchase", "check", [action("check", _check), action("charge", _charge)]
    )
    assert here.digest == first


def test_flow_digest_changes_when_the_definition_changes() -> None:
    nodes = [action("check", _check), action("charge", _charge)]
    base = define_flow("refund", "d", "check", nodes).digest
    renamed_node = define_flow(
        "refund", "d", "check", [action("check", _check), action("pay", _charge)]
    ).digest
    other_start = define_flow("refund", "d", "charge", nodes).digest
    other_name = define_flow("refund2", "d", "check", nodes).digest
    assert len({base, renamed_node, other_start, other_name}) == 4


# ------------------------------------------------------------ keys the runtime uses
class _Args(BaseModel):
    amount: int
    note: str = ""


async def test_runtime_keys_use_the_flow_logical_run_id_and_visit_callsites() -> None:
    """Tool, now and uuid steps get sha256({"run": "<run>#0#<flow>@<digest>", ...}),
    with callsites counted across the nodes of one visit."""
    seen: list[ToolCall] = []

    def charge(args: _Args, call: ToolCall) -> dict[str, Any]:
        seen.append(call)
        return {"ok": args.amount}

    tool = define_tool("charge", "charge a card", _Args, charge)

    async def first(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"amount": 5, "note": "Zoë"})
        await ctx.now()
        return goto("second")

    async def second(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.uuid()
        await ctx.tool("charge", {"amount": 7})
        return end("done")

    flow = define_flow("pay", "d", "first", [action("first", first), action("second", second)])
    agent = define_agent("a", "i", None, [tool], [flow])
    rt = Runtime([agent], store=RunStore.memory())
    handle = rt.run("s1", kind="flow", flow_name="pay")
    result = await handle.result()
    assert result.status == "finished"
    run_id = await handle.run_id
    steps = await rt.get_steps(run_id, "s1")

    logical = f"{run_id}#0#pay@{flow.digest}"
    expected = [
        ("tool", 0, spec_key(logical, 0, {"name": "charge", "args": {"amount": 5, "note": "Zoë"}})),
        ("now", 1, spec_key(logical, 1, "now")),
        ("uuid", 2, spec_key(logical, 2, "uuid")),
        ("tool", 3, spec_key(logical, 3, {"name": "charge", "args": {"amount": 7, "note": ""}})),
    ]
    assert [(s.kind, s.callsite, s.key) for s in steps] == expected
    # The tool sees exactly the journaled key.
    assert [c.idempotency_key for c in seen] == [expected[0][2], expected[3][2]]
    assert all(c.run_id == run_id and c.session_id == "s1" for c in seen)


async def test_tool_idempotency_key_override_is_the_key_unhashed() -> None:
    seen: list[str] = []

    def charge(args: _Args, call: ToolCall) -> int:
        seen.append(call.idempotency_key)
        return args.amount

    tool = define_tool("charge", "d", _Args, charge, idempotency_key=lambda a: f"order-{a.amount}")

    async def only(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"amount": 42})
        return end("done")

    flow = define_flow("f", "d", "only", [action("only", only)])
    rt = Runtime([define_agent("a", "i", None, [tool], [flow])], store=RunStore.memory())
    handle = rt.run("s1", kind="flow", flow_name="f")
    await handle.result()
    steps = await rt.get_steps(await handle.run_id, "s1")
    assert seen == ["order-42"]
    assert [s.key for s in steps] == ["order-42"]
