"""The two walks of docs/architecture.md, counted: the library's modules each one crosses.

Walk 1 is ``Runtime.approve``, from the call until the save that stores the
accepted delivery returns (``RunStore.save_run_async``); walk 2 is one
``ctx.tool`` call, from the node's call until ``RunWriter.effect`` returns
its result. A profile hook records every function of ``kuralle_es`` called on
the way; the script prints how many modules were crossed, how many were
entered again after the walk had left them, and the modules in the order
first entered. A count, not a time: the same on any machine.

The hook sees this thread only, and everything it runs meanwhile: on the
memory store (the default) a save is made inline, so its modules count; on
SQLite it is made on a worker thread and they do not. Callbacks the event
loop runs while the walk awaits (a stream part handed to the turn's handle)
count too: the walk is what the thread did, not a call graph.

Usage::

    python benchmarks/walks.py [--store memory|sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._runtime import context as context_module


class Args(BaseModel):
    x: int


def noop(args: Args) -> dict[str, int]:
    return {"x": args.x}


async def node(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.tool("noop", {"x": 1})
    await ctx.approve("go on?")
    return end("done")


AGENT = define_agent(
    "walker", "", None, [define_tool("noop", "", Args, noop)],
    [define_flow("walk", "", "n", [action("n", node)])],
)  # fmt: skip


class Walk:
    """The modules a walk enters, in order, until ``until`` (file, function) returns."""

    def __init__(self, until: tuple[str, str]) -> None:
        self.until = until
        self.entered: list[str] = []
        self.done = False

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        code = frame.f_code
        if "/kuralle_es/" not in code.co_filename:
            return
        module = code.co_filename.split("/kuralle_es/", 1)[1]
        if event == "return" and (module, code.co_name) == self.until:
            self.done = True
        elif event == "call" and (not self.entered or self.entered[-1] != module):
            self.entered.append(module)

    async def over(self, awaitable: Awaitable[Any]) -> Any:
        sys.setprofile(self.hook)
        try:
            return await awaitable
        finally:
            sys.setprofile(None)

    def report(self, name: str) -> str:
        modules = list(dict.fromkeys(self.entered))
        again = {m for i, m in enumerate(self.entered) if m in self.entered[:i]}
        return (
            f"{name}: {len(modules)} modules crossed, {len(again)} entered again\n"
            f"  {' '.join(modules)}"
        )


async def main(store: RunStore) -> None:
    runtime = Runtime([AGENT], store=store)
    real_tool = context_module.RunContext.tool
    tool_walk = Walk(("_runtime/writer.py", "effect"))

    def walked_tool(self: RunContext, *args: Any, **kwargs: Any) -> Any:
        awaitable = real_tool(self, *args, **kwargs)
        return tool_walk.over(awaitable) if not tool_walk.entered else awaitable

    context_module.RunContext.tool = walked_tool  # type: ignore[method-assign]
    try:
        paused = await runtime.run("walks", kind="flow", flow_name="walk").result()
    finally:
        context_module.RunContext.tool = real_tool  # type: ignore[method-assign]
    approve_walk = Walk(("_journal/store.py", "save_run_async"))
    await approve_walk.over(runtime.approve(paused.run_id, "walks", by="walker"))
    print(approve_walk.report("walk 1, Runtime.approve to its stored event"))
    print(tool_walk.report("walk 2, ctx.tool from intent to result"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        opened = (
            RunStore.memory()
            if options.store == "memory"
            else RunStore.sqlite(str(Path(tmp) / "walks.db"))
        )
        with opened:
            asyncio.run(main(opened))
