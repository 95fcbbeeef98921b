"""The curl examples of docs/http.md run against a real ``kuralle-es serve``, and answer
what the page says they answer.

The ``sh`` blocks of the page's "With curl" section run in order, in one
bash (``set -euo pipefail``: a failing command fails the test), with
``KURALLE_API_TOKEN`` set and the page's ``http://127.0.0.1:8000`` pointed at
the test's server. Each ``# => [STATUS] {json}`` line under a command is
checked against that command's answer: the JSON shown must be part of the
JSON answered (objects compared key by key), and the status, when shown,
must be the one ``-w '\\nHTTP %{http_code}\\n'`` printed. The Python blocks
of the page run with every other page's (tests/test_docs_snippets.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from http_kit import TOKEN, clean_env, start_server

PAGE = Path(__file__).resolve().parent.parent / "docs" / "http.md"
SECTION = ("## With curl", "## A webhook receiver")
PAGE_API = "http://127.0.0.1:8000"
_SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
_EXPECT = re.compile(r"^# => (?:(\d{3}) )?(.+)$")
_STATUS = re.compile(r"\nHTTP (\d{3})\s*$")


@dataclass
class Command:
    text: str
    line: int
    expected: list[tuple[int | None, Any]] = field(default_factory=list)


def page_commands() -> list[Command]:
    """The commands of the section's ``sh`` blocks, each with the answers it is shown with."""
    text = PAGE.read_text(encoding="utf-8")
    start, end = (text.index(heading) for heading in SECTION)
    commands: list[Command] = []
    for block in _SH_BLOCK.finditer(text, start, end):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, since = "", 0
        for offset, line in enumerate(block.group(1).splitlines()):
            expected = _EXPECT.match(line)
            if expected:
                status = int(expected.group(1)) if expected.group(1) else None
                commands[-1].expected.append((status, json.loads(expected.group(2))))
            elif line.strip() and not line.startswith("#"):
                since = since if pending else first + offset
                pending += line + "\n"
                if not line.endswith("\\"):
                    commands.append(Command(pending, since))
                    pending = ""
    return commands


def contains(answer: Any, shown: Any) -> bool:
    """Whether ``shown`` is part of ``answer``: objects key by key, anything else equal."""
    if isinstance(shown, dict):
        return isinstance(answer, dict) and all(
            k in answer and contains(answer[k], v) for k, v in shown.items()
        )
    return bool(answer == shown)


def _tools_or_skip() -> None:
    missing = [tool for tool in ("curl", "jq", "bash") if shutil.which(tool) is None]
    if missing:
        message = f"docs/http.md's examples need {', '.join(missing)} on PATH"
        if os.environ.get("CI") == "true" or os.environ.get("KURALLE_REQUIRE_POSTGRES") == "1":
            pytest.fail(message)
        pytest.skip(message)


def test_the_page_shows_answers_to_check() -> None:
    commands = page_commands()
    assert len(commands) >= 15
    assert sum(len(c.expected) for c in commands) >= 12
    assert any(status == 409 for c in commands for status, _ in c.expected)


def test_the_curl_examples_of_docs_http_answer_what_the_page_shows(tmp_path: Path) -> None:
    _tools_or_skip()
    server = start_server(f"sqlite:///{tmp_path / 'runs.db'}", tmp_path, token=TOKEN)
    commands = page_commands()
    script = ["set -euo pipefail"]
    for n, command in enumerate(commands):
        body = command.text.replace(PAGE_API, server.base)
        script += [f"echo '@@{n}'", body.rstrip("\n"), "echo", f"echo '@@/{n}'"]
    try:
        done = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=tmp_path,
            env=clean_env(KURALLE_API_TOKEN=TOKEN, REFUND_LEDGER=str(tmp_path / "refunds.jsonl")),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{server.output()}"
    for n, command in enumerate(commands):
        output = done.stdout.split(f"@@{n}\n", 1)[1].split(f"@@/{n}\n", 1)[0].strip()
        where = f"docs/http.md:{command.line}: {command.text.strip()}"
        for status, shown in command.expected:
            answered = _STATUS.search("\n" + output)
            if status is not None:
                assert answered is not None and int(answered.group(1)) == status, (where, output)
            text = output[: answered.start()] if answered else output
            assert contains(json.loads(text), shown), (where, output, shown)
