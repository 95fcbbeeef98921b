"""A run's journal as a readable timeline (for the CLI and the demo)."""

from __future__ import annotations

import json

from .models import RunState, StepRecord

__all__ = ["format_timeline"]


def _short(value: object, width: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_timeline(state: RunState, steps: list[StepRecord]) -> str:
    lines = [
        f"run {state.run_id}  session={state.session_id}  kind={state.kind}  "
        f"status={state.status}  version={state.version}",
    ]
    if state.active_flow:
        lines.append(f"  flow {state.active_flow} at node {state.active_node}")
    for step in steps:
        at = step.started_at.strftime("%H:%M:%S.%f")[:-3] if step.started_at else "--"
        if step.status == "finished":
            outcome = f"-> {_short(step.result)}"
        elif step.status == "error" and step.error is not None:
            outcome = f"!! {step.error.type}: {step.error.message}"
        else:
            outcome = "… running (in doubt if the process died)"
        lines.append(
            f"  {at}  #{step.index:<3} {step.kind:<8} {step.name:<16} "
            f"callsite={step.callsite:<3} key={step.key[:12]}  {outcome}"
        )
    if state.waiting_for is not None:
        wf = state.waiting_for
        lines.append(f"  waiting for {wf.name} ({wf.kind}) request_id={wf.request_id}")
        if wf.operation is not None:
            lines.append(f"    operation: {wf.operation.tool_name} {_short(wf.operation.args)}")
    if state.outcome is not None:
        lines.append(f"  outcome: {state.outcome}")
    if state.error is not None:
        lines.append(f"  error: {state.error.type}: {state.error.message}")
    return "\n".join(lines)
