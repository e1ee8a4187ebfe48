"""What cudarecv's own tests and benchmarks run on, usable by yours.

- :mod:`cudarecv.testing.launch`: N local ranks over loopback (``Cluster``, ``Ranks``), every wait bounded;
- :mod:`cudarecv.testing.zygote`: where those ranks are forked from (torch imported once, a real exit);
- :mod:`cudarecv.testing.hosts`: N simulated hosts (network namespaces, shaped links) and torchrun on them;
- :mod:`cudarecv.testing.gpu`: whether two NCCL ranks can run here;
- :mod:`cudarecv.testing.nvml`: GPU count and topology without initializing CUDA;
- :mod:`cudarecv.testing.table`: the one text-table renderer (results, topology);
- :mod:`cudarecv.testing.rl`: a TorchRL policy whose actions tell which weights a worker acted with;
- :mod:`cudarecv.testing.pytest_plugin`: ``--gpus N`` and the ``gpus(k)`` marker, opt-in
  (``-p cudarecv.testing.pytest_plugin``, or ``pytest_plugins`` in a conftest).

None of it is imported by ``import cudarecv``.
"""
