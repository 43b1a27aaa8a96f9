"""Builds the C++ core (torchneuron._C) with PyTorch's cpp_extension at install time, never at import."""
import glob
import os

# torch autoloads installed backends on import; never let a previous (possibly stale) torchneuron load here.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("torchneuron", "csrc", "*.cpp")))

setup(
    ext_modules=[
        CppExtension(
            "torchneuron._C",
            sources,
            # kineto: the activity-profiler plugin interface torch.profiler's device track goes through
            include_dirs=[os.path.join(here, "torchneuron", "csrc"), os.path.join(include_paths()[0], "kineto")],
            extra_compile_args=["-O2", "-std=c++17", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
