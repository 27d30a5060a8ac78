"""Builds pyengine and its extension pyengine._C by driving CMake (pybind11, ninja when available)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def stable_pybind11(build_dir: Path) -> Path:
    """pybind11's CMake dir from a copy under build_dir: pip builds in a fresh isolated environment
    each time, and a header path that changes would make ninja recompile every file."""
    import pybind11

    src = Path(pybind11.__file__).resolve().parent
    dst = build_dir / "pybind11"
    stamp = dst / ".version"
    if not stamp.exists() or stamp.read_text() != pybind11.__version__:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        stamp.write_text(pybind11.__version__)
    return dst / Path(pybind11.get_cmake_dir()).relative_to(src)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A build directory in the source tree that survives pip's temporary ones: `pip install -e .`
        # again recompiles only what changed.
        build_dir = ROOT / "build" / f"pip-{sys.implementation.cache_tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={stable_pybind11(build_dir)}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPYENGINE_KERNELS={os.environ.get('PYENGINE_KERNELS', 'AUTO')}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)


setup(
    name="pyengine",
    version="0.1.0",
    description="A compact LLM inference engine with lossless speculative decoding",
    packages=find_packages(include=["pyengine", "pyengine.*"]),
    # the shipped EAGLE-3 head for the default model (speculative method "eagle3" without a model)
    package_data={"pyengine": ["heads/*/*.json", "heads/*/*.safetensors"]},
    ext_modules=[CMakeExtension("pyengine._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "numpy",
        "gguf>=0.10",
        "tokenizers>=0.19",
        "safetensors",
        "jinja2",
        "tqdm",
    ],
    extras_require={
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
        "test": ["pytest", "hypothesis", "scipy", "transformers>=4.45", "accelerate",
                 "fastapi>=0.110", "uvicorn>=0.29", "openai>=1.40", "httpx>=0.27"],
    },
    entry_points={"console_scripts": ["pyengine = pyengine.__main__:main"]},
    zip_safe=False,
)
