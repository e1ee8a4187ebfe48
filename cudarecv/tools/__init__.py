"""The command line, ``python -m cudarecv``, and the code its ranks run.

- :mod:`~cudarecv.tools.cli`: the entry point (``compare``, ``demo``, ``report``, ``tune``, ``--version``);
- :mod:`~cudarecv.tools.compare` / :mod:`~cudarecv.tools.demo` / :mod:`~cudarecv.tools.report` /
  :mod:`~cudarecv.tools.tune`: one subcommand each;
- :mod:`~cudarecv.tools.transfer_ranks` / :mod:`~cudarecv.tools.gpu_ranks`: timed transfers inside
  benchmark ranks (used by ``compare`` and ``bench/``);
- :mod:`~cudarecv.tools.console`: machine, versions, progress lines (tables: :mod:`cudarecv.testing.table`).

Built on the public API of :mod:`cudarecv` and on :mod:`cudarecv.testing`; the library never imports it.
"""
