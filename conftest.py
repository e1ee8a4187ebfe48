"""The repository's pytest set-up: cudarecv's ``--gpus`` plugin, for tests/ and bench/ alike.

Installing cudarecv changes no other project's pytest; elsewhere load it with
``-p cudarecv.testing.pytest_plugin``.
"""

pytest_plugins = ["cudarecv.testing.pytest_plugin"]
