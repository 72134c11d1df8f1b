"""The repository stands on its own: no file refers to paths outside it."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".json", ".cfg", ""} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        for needle in ("../" + "shared", "SPEC" + ".md", "shared/" + "spec"):
            if needle in text:
                offenders.append(f"{name}: {needle}")
    assert offenders == []
