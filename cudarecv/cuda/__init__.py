"""The CUDA kernels (``kernels/*.cu``): compiled with NVRTC, loaded with cupy: the tag kernel and the
BLAKE3 digest. Imports only :mod:`cudarecv.core`.
"""
