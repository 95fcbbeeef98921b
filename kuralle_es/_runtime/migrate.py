"""Moving a run onto the newest definition of its flow (internal; ``Runtime.migrate``).

A migration is two writes: a fork of the run at ``at_step`` under the flow's
newest definition (``runtime.fork``, driven to its next pause or its end),
then the original stopped for good in one compare-and-set save that wins
over any lease (retried until it lands, like a cancel): a ``Migrated`` event
(``RunState.migrated_to``) and ``aborted`` with outcome
``"migrated: <fork id>"``.

A process can die between the two. The fork's id is therefore derived from
the original's id and ``at_step`` (``migration_id``), not drawn at random: a
retried migration finds the fork it made, drives it on by its id if it was
cut off mid-turn or errored (unless another holder's lease on it is live: a
sweeper recovers it once that expires), and then stops the original, so
every retry converges on one fork and one stopped original.
Two migrations racing make one fork (the second's create loses its
compare-and-set and takes the winner's). The original is stopped only once
its fork has reached a pause or its end without raising: a fork whose
replay no longer matches the new code (``NonDeterminismError``) stays in
status ``error``, and the original stays as it was.
"""

from __future__ import annotations

from uuid import UUID, uuid5

from .._journal.run import Run
from .._journal.store import RunStore
from ..errors import InvalidArgumentError, LeaseHeldError, RunNotFoundError
from ..shapes import TurnResult
from .handle import TurnHandle
from .observability import log_event
from .run_changes import MigrateTo, change_run
from .step_results import result_of
from .turn import drive_turn
from .turn_calls import Command, Fork, Resume, TurnEnv, load_run

__all__ = ["migrate_run", "migration_id"]

#: Namespace of the ids of migration forks.
MIGRATION_NAMESPACE = UUID("8f3b2c6e-51a4-4d0b-9c1e-7a2d6e0f4b93")


def migration_id(run_id: str, at_step: int) -> str:
    """The id of the fork that migrating run ``run_id`` at ``at_step`` makes."""
    return str(uuid5(MIGRATION_NAMESPACE, f"{run_id}#{at_step}"))


async def _turn(env: TurnEnv, command: Command) -> TurnResult:
    return await TurnHandle(lambda sink: drive_turn(env, command, sink)).result()


def _refuse_ended(original: Run) -> None:
    if original.status in ("finished", "aborted"):
        msg = (
            f"run {original.run_id} is {original.status} (outcome {original.outcome!r}); "
            "only a live run (running, paused or errored) is migrated"
        )
        raise InvalidArgumentError(msg)


async def _drive_on(env: TurnEnv, fork: Run) -> TurnResult:
    """A fork a previous attempt made: on to its next pause or end, if it was cut off
    (driven again by run id, as a restarted worker resumes its own run)."""
    if fork.status in ("running", "error"):
        try:
            return await _turn(env, Resume(fork.session_id, fork.run_id, None))
        except LeaseHeldError:
            # Another holder drives it right now (a racing migration), or holds the
            # lease of the attempt that died: a sweeper recovers it once it expires.
            return result_of(fork)
    if fork.status == "aborted":
        msg = (
            f"run {fork.run_id}, the fork this migration makes, was stopped "
            f"(outcome {fork.outcome!r}); migrate at another step, or cancel the run"
        )
        raise InvalidArgumentError(msg)
    return result_of(fork)


async def _stop_original(
    store: RunStore, run_id: str, session_id: str, fork_id: str, at_step: int
) -> None:
    run = await change_run(store, run_id, session_id, MigrateTo(fork_id, at_step))
    if run.migrated_to == fork_id:
        log_event("run migrated", run_id, to=fork_id, at_step=at_step)


async def migrate_run(env: TurnEnv, run_id: str, session_id: str, at_step: int) -> TurnResult:
    """Fork the run at ``at_step`` onto its flow's newest definition, then stop it
    (see ``Runtime.migrate``); the fork's turn result."""
    if isinstance(at_step, bool) or not isinstance(at_step, int):
        msg = f"at_step must be a step index (an int), got {at_step!r}"
        raise InvalidArgumentError(msg)
    original = await load_run(env.store, run_id, session_id)
    if original is None:
        raise RunNotFoundError(run_id, session_id)
    fork_id = migration_id(original.run_id, at_step)
    original.refuse_migration_elsewhere(fork_id)
    made = await env.store.load_async(fork_id)
    if made is None:
        _refuse_ended(original)
        result = await _turn(env, Fork(session_id, original.run_id, at_step, fork_id=fork_id))
    else:
        result = await _drive_on(env, made)
    await _stop_original(env.store, original.run_id, session_id, fork_id, at_step)
    return result
