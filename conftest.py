"""Repo-level test setup: the fixtures, options and markers come from the installed plugin
(``mlx_streaming.pytest_plugin``, registered through the ``pytest11`` entry point)."""
