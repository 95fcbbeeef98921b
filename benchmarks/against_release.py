"""This checkout's per-step cost against an earlier release's, measured in one run.

A step's cost must not grow from one release to the next. This runs
``benchmarks/journal_overhead.py`` of this checkout and of ``--release``
(a git ref, checked out into a temporary worktree) alternately, ``--rounds``
times each (default 3), on the same PostgreSQL server, and prints, per
backend and step kind, the median µs per step of each, their ratio, and each
one's ratio to the two-commit floor measured in the same process (so a
machine that got slower or faster between rounds shows in the floor, not in
the verdict).

Usage::

    python benchmarks/against_release.py [--release 014f51e] [--rounds 3] [--steps 500]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: A row of journal_overhead's table: backend | label | steps | saves/step | us/step | ...
ROW = re.compile(r"^(memory|sqlite|postgres)\s*\|\s*([^|]+?)\s*\|\s*\d+\s*\|[^|]*\|\s*(\d+)\s*\|")

Series = dict[tuple[str, str], list[float]]


def measure(checkout: Path, steps: int) -> dict[tuple[str, str], float]:
    """One run of ``checkout``'s journal_overhead: µs per step by (backend, label)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, str(checkout / "benchmarks" / "journal_overhead.py"),
         "--steps", str(steps), "--reps", "1"],
        capture_output=True, text=True, env=env, cwd=checkout, check=False, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"journal_overhead.py of {checkout} failed:\n{done.stderr}")
    found: dict[tuple[str, str], float] = {}
    for line in done.stdout.splitlines():
        match = ROW.match(line)
        if match:
            found[(match.group(1), match.group(2))] = float(match.group(3))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--release", default="014f51e", help="the git ref to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kuralle-release-") as tmp:
        old = Path(tmp) / "release"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.release],
            check=True,
        )
        try:
            mine: Series = defaultdict(list)
            theirs: Series = defaultdict(list)
            for r in range(args.rounds):
                for series, checkout in ((theirs, old), (mine, ROOT)):
                    for key, us in measure(checkout, args.steps).items():
                        series[key].append(us)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False
            )
    print(
        f"\nus per step, median of {args.rounds} alternating rounds of {args.steps}-step runs; "
        f"release {args.release} vs this checkout"
    )
    header = f"{'backend':<8} | {'step':<26} | {'release':>7} | {'now':>7} | now/release"
    print(header)
    print("-" * len(header))
    for key in sorted(set(mine) & set(theirs)):
        before, now = statistics.median(theirs[key]), statistics.median(mine[key])
        print(f"{key[0]:<8} | {key[1]:<26} | {before:>7.0f} | {now:>7.0f} | {now / before:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
