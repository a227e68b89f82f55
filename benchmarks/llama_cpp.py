"""llama.cpp's own tools as the baseline for GGUF files: built from the source that PyPI's llama-cpp-python sdist
vendors (`vendor/llama.cpp`), never a dependency of fulcrum.

    python benchmarks/llama_cpp.py ensure [--dir .llama.cpp]     # download the sdist and build (15-25 min, 2 cores)
    python benchmarks/llama_cpp.py path llama-bench              # where a built tool is

The build lives beside the project (default `<repo>/.llama.cpp`, gitignored): `src/` the unpacked source, `build/bin/`
the tools (llama-bench, llama-batched-bench, llama-perplexity, llama-quantize). The build is native (`GGML_NATIVE`),
as a user building llama.cpp on this CPU gets it, CPU backend only, no network features.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".llama.cpp"
SDIST_PIN = "llama-cpp-python==0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-perplexity", "llama-quantize")
MARKER = ".fulcrum-built"


def tool(name: str, root: Path = DEFAULT_DIR) -> Path:
    return root / "build" / "bin" / name


def built(root: Path = DEFAULT_DIR) -> bool:
    return (root / MARKER).exists() and all(tool(t, root).exists() for t in TOOLS)


def version(root: Path = DEFAULT_DIR) -> str:
    """The sdist it was built from and llama.cpp's build number (llama-bench --version's first line)."""
    out = subprocess.run([tool("llama-bench", root), "--version"], capture_output=True, text=True)
    line = (out.stdout + out.stderr).strip().splitlines()
    return f"{SDIST_PIN}; {line[0] if line else 'unknown build'}"


def ensure(root: Path = DEFAULT_DIR, jobs: int | None = None) -> Path:
    if built(root):
        return root
    root.mkdir(parents=True, exist_ok=True)
    dl = root / "sdist"
    if not any(dl.glob("*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST_PIN,
                        "-d", dl], check=True)  # fmt: skip
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(next(dl.glob("*.tar.gz"))) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            for m in members:
                m.name = m.name.split("/vendor/llama.cpp/", 1)[1]
            tar.extractall(src, members=members, filter="data")
    build = root / "build"
    subprocess.run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF"], check=True)  # fmt: skip
    subprocess.run(["cmake", "--build", build, "-j", str(jobs or os.cpu_count() or 2), "--target", *TOOLS], check=True)
    (root / MARKER).write_text(SDIST_PIN + "\n")
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ensure")
    e.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    e.add_argument("--jobs", type=int)
    w = sub.add_parser("path")
    w.add_argument("tool", choices=TOOLS)
    w.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    a = p.parse_args()
    if a.cmd == "ensure":
        print(ensure(a.dir, a.jobs))
    else:
        print(tool(a.tool, a.dir))


if __name__ == "__main__":
    main()
