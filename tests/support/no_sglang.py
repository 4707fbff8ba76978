"""A pytest plugin (`-p tests.support.no_sglang`) that makes `import sglang` fail as it does in
a venv without SGLang: `tests/test_collection.py` collects the suite with it."""

from __future__ import annotations

import sys

for _name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
    del sys.modules[_name]
sys.modules["sglang"] = None  # type: ignore[assignment]  # `import sglang...` raises ImportError
