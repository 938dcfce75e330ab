"""Convert transformer checkpoints between diffusers and leangrpo_mcore (same as `leangrpo-convert`).

  python tools/convert_checkpoint.py diffusers-to-mcore --model flux --src DIR --dst DIR
  python tools/convert_checkpoint.py mcore-to-diffusers --src DIR --dst DIR [--keep-lora]
"""

import sys

from leangrpo_mcore.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
