"""The GPU check's sections as GPU tests (TOKEND_TEST_GPU=1 pytest -m gpu tests/gpu/): each one passes on CUDA.

scripts/gpu_check.sh stays the way GPU figures are collected (each section in a process of its own, one JSON line
each); this is the same checks where pytest finds them. On the CPU they are skipped: tests/test_gpu_check.py runs
the whole check's dry run there."""

from __future__ import annotations

import pytest
import torch

from gpu.sections import SECTIONS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and TOKEND_TEST_GPU=1)"),
]
# The environment is a report, not a check; the marked GPU tests are pytest's own to run.
NOT_CHECKS = {"environment", "gpu_tests"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [name for name in SECTIONS if name not in NOT_CHECKS])
def test_the_section_passes_on_cuda(name):
    result = SECTIONS[name]("cuda", False)
    assert result.get("ok", True) is not False, result
