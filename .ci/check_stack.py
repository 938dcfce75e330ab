"""Exit 1 unless the installed versions of the packages pinned in the given file (``name==version`` lines) are those
versions: an install that replaced one (a downgrade by the package's own requirements) fails CI."""

import sys
from importlib import metadata


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        pins = dict(line.strip().split("==") for line in fh if "==" in line and not line.startswith("#"))
    found = {name: metadata.version(name) for name in pins}
    print("ci: current stack: Python %d.%d.%d, " % sys.version_info[:3]
          + ", ".join(f"{name} {version}" for name, version in found.items()))
    wrong = {name: version for name, version in found.items() if version.split("+")[0] != pins[name]}
    if wrong:
        print(f"ci: error: the install replaced the pinned {sorted(pins)}: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
