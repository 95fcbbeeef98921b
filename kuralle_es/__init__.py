"""kuralle_es: durable execution for LLM-agent runs, event-sourced.

Every side effect of a run is a journaled step; re-entering a run replays
recorded outcomes instead of executing again.
"""

from __future__ import annotations

from .agents import Agent, define_agent
from .context import RunContext
from .errors import (
    BudgetExceededError,
    FlowDriftError,
    FlowNotFoundError,
    InvalidArgumentError,
    InvalidSignalError,
    InvalidToolArgsError,
    KuralleError,
    LeaseHeldError,
    NonDeterminismError,
    PayloadTooLargeError,
    RunNotFoundError,
    SignalMismatchError,
    StaleWriteError,
    StoreUnavailableError,
    SuspendError,
    ToolApprovalDeniedError,
    ToolExecutionError,
    ToolResultTypeError,
    ToolTimeoutError,
    TurnClosedError,
    UnknownToolError,
)
from .flows import End, Flow, Goto, Handoff, action, collect, define_flow, end, goto, handoff, reply
from .handle import TurnHandle
from .keys import idempotency_key
from .llm import (
    Model,
    ModelRequest,
    ModelResponse,
    ModelResponseError,
    OpenAIModel,
    ToolCallRequest,
    openai_model,
)
from .models import (
    ApprovalDecision,
    FrozenOperation,
    Message,
    RunState,
    SignalDelivery,
    StepError,
    StepRecord,
    StreamPart,
    ToolCall,
    TurnResult,
    WaitingFor,
)
from .recovery import (
    Scheduler,
    Sweeper,
    SweepJob,
    SweepReport,
    create_sweep_job_runner,
    fire_timers,
    recover_orphaned_runs,
    start_run_sweeper,
    sweep_deadlines,
)
from .retry import RetryPolicy
from .runtime import Runtime
from .store import RunStore
from .tools import Tool, define_tool
from .usage import Budget, Usage
from .views import RunSummary, RunViews, ToolStats

__all__ = [
    "Agent",
    "ApprovalDecision",
    "Budget",
    "BudgetExceededError",
    "End",
    "Flow",
    "FlowDriftError",
    "FlowNotFoundError",
    "FrozenOperation",
    "Goto",
    "Handoff",
    "InvalidArgumentError",
    "InvalidSignalError",
    "InvalidToolArgsError",
    "KuralleError",
    "LeaseHeldError",
    "Message",
    "Model",
    "ModelRequest",
    "ModelResponse",
    "ModelResponseError",
    "NonDeterminismError",
    "OpenAIModel",
    "PayloadTooLargeError",
    "RetryPolicy",
    "RunContext",
    "RunNotFoundError",
    "RunState",
    "RunStore",
    "RunSummary",
    "RunViews",
    "Runtime",
    "Scheduler",
    "SignalDelivery",
    "SignalMismatchError",
    "StaleWriteError",
    "StepError",
    "StepRecord",
    "StoreUnavailableError",
    "StreamPart",
    "SuspendError",
    "SweepJob",
    "SweepReport",
    "Sweeper",
    "Tool",
    "ToolApprovalDeniedError",
    "ToolCall",
    "ToolCallRequest",
    "ToolExecutionError",
    "ToolResultTypeError",
    "ToolStats",
    "ToolTimeoutError",
    "TurnClosedError",
    "TurnHandle",
    "TurnResult",
    "UnknownToolError",
    "Usage",
    "WaitingFor",
    "action",
    "collect",
    "create_sweep_job_runner",
    "define_agent",
    "define_flow",
    "define_tool",
    "end",
    "fire_timers",
    "goto",
    "handoff",
    "idempotency_key",
    "openai_model",
    "recover_orphaned_runs",
    "reply",
    "start_run_sweeper",
    "sweep_deadlines",
]
