"""tools/gpu_check.sh runs end to end in its CPU dry mode: every part ok, the TE parts skipped with a reason."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert set(parts) == {"diffusers_parity", "schedule_parity", "bench", "te_parity", "fp8_agreement"}
    for name in ("diffusers_parity", "schedule_parity", "bench"):
        assert parts[name]["status"] == "ok", (name, parts[name]["status"])
    assert parts["diffusers_parity"]["rel_l2"] < 1e-5
    assert parts["schedule_parity"]["parity"]["reweight"]["cosine"] > 0.99999
    assert set(parts["bench"]["report"]["schedules"]) == {"native", "retain", "reweight"}
    for name in ("te_parity", "fp8_agreement"):
        assert parts[name]["status"].startswith("skipped: Transformer Engine"), parts[name]
    assert parts["fp8_agreement"]["dry_run_clip_fraction_without_fp8"] == 0.0


def test_gpu_check_usage_errors(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: unknown argument --bogus")
    done = subprocess.run([sys.executable, "-m", "leangrpo_mcore.bench.gpu_check", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "no CUDA device; use --cpu" in done.stderr
