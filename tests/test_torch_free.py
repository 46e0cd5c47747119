"""The schedule tools run without torch: `conveyor simulate` at 256 ranks must stay under 5 s and
300 MB, and importing torch alone costs about 2 s and 200 MB. `conveyor --help` lists the training
config's keys, whose sections are the pipeline's option records, so those must not import torch
either until a record is made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import contextlib, io, sys
import conveyor.cli
with contextlib.redirect_stdout(io.StringIO()):
    conveyor.cli.main(["simulate", "--schedule", "zbv", "--ranks", "8", "--virtual", "2", "--microbatches", "16"])
    conveyor.cli.build_parser().format_help()
from conveyor.train.config import config_reference
config_reference()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_simulate_and_the_config_reference_never_import_torch():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"torch was imported: {done.stdout.strip()[:300]}"
