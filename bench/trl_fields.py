"""Every field of TRL 1.16's configs against leantune's: which are missing, whose defaults differ, and their status.

    python bench/trl_fields.py             # with TRL installed (`pip install "leantune[bench]"`): missing fields and
                                           # differing defaults, per config (exit 1 if a field is missing)
    python bench/trl_fields.py --snapshot  # with TRL: write tests/fixtures/trl_1_16_fields.json (TRL's names, types, defaults)
    python bench/trl_fields.py --docs      # from that snapshot (no TRL needed): write docs/trl_compatibility.md

The fields, their status and the docs' rendering live in devkit/trl_fields.py (the tests read them there).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devkit.trl_fields import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
