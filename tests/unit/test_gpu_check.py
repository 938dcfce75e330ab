"""tools/gpu_check.sh runs end to end in its CPU dry mode: every part ok, the TE parts skipped with a reason; from
a wheel bundle that holds wheels for several Python versions it installs the ones that fit the interpreter."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _wheel(folder: Path, name: str, version: str, tag: str) -> None:
    """A minimal wheel of one module ``name`` whose ``VERSION`` is ``version``, tagged ``tag``."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-{tag}.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


def test_gpu_check_dry_run_on_cpu(tmp_path):
    # one bundle for both stacks: a wheel per interpreter (as megatron-core's are) and a newer one for none
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    this = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp311" if this != "cp311" else "cp312"
    _wheel(bundle, "stackprobe", "1.0", "py3-none-any")
    _wheel(bundle, "stackprobe", "2.0", f"{this}-{this}-manylinux_2_17_x86_64")
    _wheel(bundle, "stackprobe", "3.0", f"{other}-{other}-manylinux_2_17_x86_64")
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(out),
                           "--wheels", str(bundle)],
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "site" / "stackprobe" / "__init__.py").read_text() == "VERSION = '2.0'\n"
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
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
