import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_rollout_prints_finite_rewards():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_rollout.py"), "--iterations", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    means = [float(m) for m in re.findall(r"reward mean ([-+]\d+\.\d+) kB", out.stdout)]
    assert len(means) == 2
    # JPEG size of a 32x32 RGB image is between a few hundred bytes and a few kB: compressibility is -size.
    assert all(-10.0 < m < -0.1 for m in means)
