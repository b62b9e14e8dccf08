"""Run a snippet of Python under several string hash seeds: code whose result follows the
interpreter's hashing (set and dict orders of strings) gives different outputs."""

import os
import subprocess
import sys


def outputs_under_hash_seeds(code: str, *args: str, seeds=("1", "2")) -> set[str]:
    """The distinct stdouts of ``python -c code args…`` under each ``PYTHONHASHSEED``."""
    return {
        subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in seeds
    }
