"""Install leangrpo_mcore.

On a CPU-only machine install ``torch==2.13.0`` first (see README): an unpinned torch in a fresh
environment resolves to a multi-gigabyte CUDA build. ``pip install -e .`` keeps an installed torch; with pip
constrained to the installed torch and megatron-core (``-c``, as ``.ci/current-stack.txt`` does) it never
replaces them.
NVIDIA apex is detected at run time and is never a dependency (the PyPI package named ``apex`` is an
unrelated project).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup


def read_version() -> str:
    """``__version__`` of ``leangrpo_mcore/__init__.py``, read as text (importing the package needs torch)."""
    text = (Path(__file__).parent / "leangrpo_mcore" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError("leangrpo_mcore/__init__.py defines no __version__")
    return match.group(1)


setup(
    name="leangrpo_mcore",
    version=read_version(),
    description="Recompute-free GRPO for diffusion policies (FLUX, Wan) on megatron-core and FSDP2",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["leangrpo_mcore", "leangrpo_mcore.*"]),
    include_package_data=True,
    package_data={"leangrpo_mcore": ["data/*.txt"]},
    # Ranges are those the test suite has passed with (README, "Supported versions"): .ci/run tests Python 3.11 +
    # torch 2.13 + megatron-core 0.16.1 and Python 3.12 + torch 2.14.1 + megatron-core 0.19.2 (0.17.1 and 0.18.2
    # were checked once); what differs between those releases is answered in leangrpo_mcore/compat.py.
    install_requires=[
        "torch>=2.13,<2.15",
        "megatron-core>=0.16.1,<0.20",
        "diffusers>=0.35.2,<0.43",
        "safetensors",
        "pyyaml",
        "numpy",
        "einops",
        "psutil",
        "pillow",
        "tensorboard",
        "tqdm",
        "httpx>=0.28,<1",  # the remote reward's client (pure Python)
        "httpcore>=1.0,<2",  # its transport, used directly for per-request deadlines
    ],
    extras_require={
        # Transformer Engine: the range each stack's megatron-core accepts (0.16.1 declares >=2.9,<2.12; 0.17-0.19
        # declare none, and the current-scaling FP8 recipes need >=2.3). Not installable without CUDA: untested in CI.
        "te": ["transformer-engine[pytorch]>=2.9,<2.12; python_version < '3.12'",
               "transformer-engine[pytorch]>=2.9,<3; python_version >= '3.12'"],
        "ocr": ["rapidocr>=3.10,<4", "onnxruntime"],
        "text": ["transformers"],
        "rewards": ["transformers"],  # PickScore, CLIPScore, the aesthetic predictor and HPSv2.1 (CLIPModel)
        "video": ["imageio>=2.30", "imageio-ffmpeg>=0.5"],  # mp4 samples (the wheel ships ffmpeg)
        "wandb": ["wandb>=0.31,<1"],
        "lora": ["peft>=0.17"],  # diffusers loads the unmerged adapters of `leangrpo-convert --keep-lora` through peft
        # conditioning images (data.images): decoded and resized by NVIDIA DALI, CPU operators or nvJPEG on a GPU
        "dali": ["nvidia-dali-cuda120>=2.4,<3"],
        # ftfy: diffusers' WanImageToVideoPipeline, the reference of the Wan image-to-video tests, calls it unchecked
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.5", "transformers", "accelerate", "imageio>=2.30",
                 "imageio-ffmpeg>=0.5", "nvidia-dali-cuda120>=2.4,<3", "ftfy"],
    },
    entry_points={
        "console_scripts": [
            "leangrpo-train=leangrpo_mcore.cli.train:launch",
            "leangrpo-torchrun=leangrpo_mcore.cli.torchrun:main",
            "leangrpo-convert=leangrpo_mcore.cli.convert:main",
            "leangrpo-plan=leangrpo_mcore.cli.plan:main",
            "leangrpo-bench=leangrpo_mcore.cli.bench:launch",
            "leangrpo-eval=leangrpo_mcore.cli.eval:launch",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
