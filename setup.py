"""pip install entry point; the metadata lives in pyproject.toml.

hooks/ sits at the top level (framework adapters apart from the library) and installs as
the subpackage crossover.hooks. The native fast path, crossover._native, is built by
CMake from CMakeLists.txt (C++17, pybind11). Without CMake, a compiler or pybind11 the
install goes on without it and crossover uses its socket path (it says so in the log).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension that CMake builds (sources are listed in CMakeLists.txt)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        try:
            import pybind11
        except ImportError:
            self._skip("pybind11 is not installed (pip install pybind11)")
            return
        if shutil.which("cmake") is None:
            self._skip("cmake is not installed (apt-get install cmake, or pip install cmake)")
            return
        build = Path(self.build_temp).resolve() / "cmake"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        jobs = str(os.cpu_count() or 1)
        try:
            subprocess.run(configure, check=True)
            subprocess.run(["cmake", "--build", str(build), "--target", "_native", "-j", jobs],
                           check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            self._skip(f"the CMake build failed ({exc})")

    @staticmethod
    def _skip(why: str) -> None:
        print(f"crossover: not building the native fast path: {why}; the socket path "
              f"works without it", file=sys.stderr)


setup(
    packages=[
        "crossover",
        "crossover.client",
        "crossover.daemon",
        "crossover.scheduler",
        "crossover.launch",
        "crossover.pipeline",
        "crossover.freeze",
        "crossover.hooks",
    ],
    package_dir={"crossover": "crossover", "crossover.hooks": "hooks"},
    # crossoverrun puts this directory on a job's PYTHONPATH (not a package).
    package_data={"crossover.launch": ["inject/sitecustomize.py"]},
    ext_modules=[CMakeExtension("crossover._native")],
    cmdclass={"build_ext": CMakeBuild},
)
