"""Make PyPI torchvision importable beside CPU-only torch (CPU SGLang environments only).

`torchvision/_meta_registrations.py` registers fake kernels for `torchvision::nms` and
`torchvision::qnms` unconditionally, while its other registrations are guarded by
`torchvision.extension._has_ops()`. Beside a torch build whose ABI the wheel's C++ ops do not
match, those ops are missing and the import fails ("operator torchvision::nms does not exist"),
which takes `transformers` (and so SGLang) down with it. The fix applies the same guard to the
two unguarded registrations. Idempotent; run by `scripts/setup_sglang.sh`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPS = ("nms", "qnms")


def patch(path: Path) -> bool:
    """Guard the unconditional registrations in `path`; returns whether the file changed."""
    text = path.read_text()
    new = text
    for op in OPS:
        plain = f'@torch.library.register_fake("torchvision::{op}")\n'
        guarded = (f'@(torch.library.register_fake("torchvision::{op}")'
                   f" if torchvision.extension._has_ops() else (lambda fn: fn))\n")
        new = new.replace(plain, guarded)
    if new == text:
        return False
    path.write_text(new)
    return True


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("fix_torchvision: torchvision is not installed", file=sys.stderr)
        return 1
    target = Path(spec.origin).parent / "_meta_registrations.py"
    changed = patch(target)
    print(f"fix_torchvision: {'patched' if changed else 'already fine'}: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
