"""The one native piece: host memory copies (cudarecv/native/host_copy.c) and delta pushes' codec on host
memory (cudarecv/native/delta.c), built if a C compiler is there; without one the package installs all the
same, copies with memmove (cudarecv.core.host_copy) and diffs with torch (cudarecv.weights.delta)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cudarecv.core.host_copy_native",
            ["cudarecv/native/host_copy.c", "cudarecv/native/delta.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
