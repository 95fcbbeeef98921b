"""The public surface: every exported name is documented, every public error exported.

Users read docstrings in their editor and in the generated API reference
(docs/reference.md), so a public name without one is a bug.
"""

from __future__ import annotations

import inspect

import kuralle_es
from kuralle_es import testing


def _undocumented(module: object, names: list[str]) -> list[str]:
    missing = []
    for name in names:
        obj = getattr(module, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            missing.append(name)
    return missing


def test_every_public_class_and_function_has_a_docstring_of_its_own() -> None:
    assert _undocumented(kuralle_es, list(kuralle_es.__all__)) == []
    assert _undocumented(testing, list(testing.__all__)) == []


def test_every_name_in_all_is_importable() -> None:
    for module in (kuralle_es, testing):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_every_error_of_the_contract_is_exported_as_a_kuralle_error() -> None:
    errors = [
        "SuspendError", "NonDeterminismError", "ToolExecutionError", "ToolTimeoutError",
        "ToolResultTypeError", "ToolApprovalDeniedError", "InvalidToolArgsError",
        "UnknownToolError", "FlowNotFoundError", "SignalMismatchError", "InvalidSignalError",
        "PayloadTooLargeError", "ModelResponseError", "RunNotFoundError", "FlowDriftError",
        "StaleWriteError", "LeaseHeldError", "InvalidArgumentError", "DeadlineExpiredError",
        "NotPublishedError",
    ]  # fmt: skip
    for name in errors:
        error = getattr(kuralle_es, name)
        assert name in kuralle_es.__all__ and issubclass(error, kuralle_es.KuralleError), name
    assert issubclass(kuralle_es.InvalidArgumentError, ValueError)
    assert issubclass(kuralle_es.ToolTimeoutError, kuralle_es.ToolExecutionError)


def test_transitions_are_exported() -> None:
    assert isinstance(kuralle_es.goto("a"), kuralle_es.Goto)
    assert isinstance(kuralle_es.end("done"), kuralle_es.End)
    assert isinstance(kuralle_es.handoff("other"), kuralle_es.Handoff)


def test_the_testing_kit_exports_the_clock_and_the_replay_of_the_contract() -> None:
    for name in ("TestClock", "replay_with", "Counterfactual", "replay_check", "ScriptedModel"):
        assert name in testing.__all__, name
    assert inspect.signature(testing.replay_with).parameters["model"].default is None
    assert inspect.signature(testing.TestClock).parameters["start"].default is None
