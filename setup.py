"""The one native piece: host memory copies (cudarecv/native/host_copy.c), built if a C compiler is
there; without one the package installs all the same and copies with memmove (cudarecv.core.host_copy)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cudarecv.core.host_copy_native",
            ["cudarecv/native/host_copy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
