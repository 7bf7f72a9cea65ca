"""Shared test set-up: CPU runs interpret Triton kernels; fixtures come from ../shared."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Triton reads this when kernels are decorated, so it must be set before kernels.py is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tiny models' ops are small: on a shared 2-core machine two threads ran them ~15x slower.
    torch.set_num_threads(1)

SHARED = Path(os.environ.get("GLM53_SHARED", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"shared fixtures not found at {FIXTURES}; set GLM53_SHARED")
    return FIXTURES
