"""Where the compiled kernels are built and looked for."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
BUILD_DIR = REPO / "build" / "kernels"
NAME = "nereus_kernels"


def library_path() -> Path:
    return BUILD_DIR / f"{NAME}.so"
