"""Builds the optional native extension ``mlx_streaming._native`` (everything else is in pyproject.toml).

A compiler failure does not fail the install: the package then runs on the extension's pure-Python twins
and says so once when it is imported (see ``mlx_streaming/io/native.py``).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler or toolchain failure
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skip(exc)

    @staticmethod
    def _skip(exc):
        sys.stderr.write(f"warning: mlx_streaming._native was not built ({exc}); the pure-Python twins will run\n")


setup(
    ext_modules=[Extension("mlx_streaming._native", sources=["native/_native.c"],
                           extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-D_GNU_SOURCE"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
