"""``python -m kuralle_es.cli``: the ``kuralle-es`` command (internal); a closed pipe
(``| head``) ends it quietly.
"""

from __future__ import annotations

import contextlib

from . import main

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
