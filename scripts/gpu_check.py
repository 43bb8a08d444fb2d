"""The GPU check's command line: one JSON line per section on stdout, in under 8 minutes on one H200.

Run it through scripts/gpu_check.sh, which finds the machine's own Python with torch and puts the repository on
its path:

  scripts/gpu_check.sh              # on a CUDA machine
  scripts/gpu_check.sh --dry-run    # anywhere: every section on the CPU with tiny shapes, CUDA-only figures skipped
  scripts/gpu_check.sh --sections exactness_fp32,seeds

The runner and its sections live in tests/gpu/ (run.py, sections.py, models.py), beside the checkpoints the tests
write; see run.py for how the sections are split into processes. Exit status: 0 when every section is ok (or
skipped), 1 otherwise.
"""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # the project's packages, then the tests' (gpu, checkpoints)

from gpu.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
