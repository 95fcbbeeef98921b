"""The app of the budget delivery tests: ``--app procs.budget_app:AGENTS`` (from
``tests/``) or ``budget_app:AGENTS`` (from ``tests/procs``).

A ``chatty`` flow of two ``reply`` nodes, each one model turn; its model
answers every request with 60 tokens. Started with
``budget=Budget(max_model_calls=1)``, a run pauses on ``__budget`` before its
second model call, and a human's approval (with ``raise_to``) or denial,
delivered from another process, decides it.
"""

from __future__ import annotations

from kuralle_es import Agent, ModelResponse, define_agent, define_flow, end, goto, reply
from kuralle_es.testing import ScriptedModel

FLOW = "chatty"
TOKENS = {"input_tokens": 40, "output_tokens": 20, "total_tokens": 60}


def _answer(request: object) -> ModelResponse:
    return ModelResponse(content="ok", usage=TOKENS)


def build_agents() -> list[Agent]:
    flow = define_flow(
        FLOW,
        "two replies",
        "first",
        [
            reply("first", "Say hello.", goto("second")),
            reply("second", "Say more.", end("said")),
        ],
    )
    return [define_agent("chatter", "talks", ScriptedModel(_answer, id="chatty-model"), [], [flow])]


AGENTS = build_agents()
