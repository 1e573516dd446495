"""Print what failed in the JUnit XML files pytest wrote (`--junitxml`), each failure's message and the end of
its traceback, so that the last lines of a long CI log say why, not only which test."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL_LINES = 25


def main(paths: list[str]) -> int:
    failed = 0
    for path in paths:
        if not Path(path).is_file():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            for problem in list(case.iter("failure")) + list(case.iter("error")):
                failed += 1
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                print(f"--- {problem.tag}: {test}")
                message = problem.get("message", "")[:2000]
                print("\n".join(f"    {line}" for line in message.splitlines()))
                lines = (problem.text or "").rstrip().splitlines()
                for line in lines[-TAIL_LINES:]:
                    print(f"    | {line[:300]}")
    if failed:
        print(f"{failed} failure(s) above (JUnit XML: {' '.join(paths)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
