"""dmuon's test suite: a regular package, so an installed top-level ``tests`` package (draccus ships
one) cannot shadow ``tests._pool`` and ``tests.models`` (issue 38)."""
