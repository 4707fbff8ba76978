"""Test-only pieces for running real SGLang servers on CPU (never part of the package)."""
