"""Reads are fail-closed too: an unknown, malformed or foreign run id reads as
nothing (``get_run`` None, ``get_steps`` empty), the same for all three."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from pydantic import BaseModel

from kuralle_es import Runtime, action, define_agent, define_flow, define_tool, end


class Args(BaseModel):
    n: int


async def test_unknown_malformed_and_foreign_runs_read_as_nothing(open_store: Any) -> None:
    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("echo", {"n": 1})
        return end("done")

    agent = define_agent(
        "a",
        "i",
        None,
        [define_tool("echo", "echo", Args, lambda a: {"n": a.n})],
        [define_flow("f", "f", "n", [action("n", node)])],
    )
    runtime = Runtime([agent], store=open_store())
    done = await runtime.run("owner", kind="flow", flow_name="f").result()
    assert len(await runtime.get_steps(done.run_id, "owner")) == 1

    for run_id, session in ((done.run_id, "intruder"), (str(uuid4()), "owner"), ("nope", "owner")):
        assert await runtime.get_run(run_id, session) is None
        assert await runtime.get_steps(run_id, session) == []
