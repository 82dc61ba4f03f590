"""Shared pytest fixtures for dmuon's tests.

Multi-rank tests use the session-scoped :func:`dist_pool` fixture: one set of gloo worker
processes per world size, started on first use and reused by every test (see
``tests/_pool.py``), so a test pays ~0 s instead of ~2.5 s of process spawn.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Make ``import tests._pool`` and ``fn="tests.<module>:<function>"`` work under plain ``pytest``
# too (``python -m pytest`` from the repository root already has it on sys.path). The workers
# get the same root first on their sys.path from the pool.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tests._pool import DistPool  # noqa: E402
from tests._torchtitan_site import SiteUnavailable, torchtitan_site, use_site  # noqa: E402


#: The compatibility subset (``pytest -m compat``; README "Tested versions"): what CI runs on
#: Python 3.12 with torch 2.11 and on Python 3.13 with the newest torch, beside the whole suite
#: on 3.11 (issue 38). Node-id prefixes; a test can also join with ``@pytest.mark.compat``.
COMPAT_TESTS = (
    "tests/test_core.py",  # single-process parity with the installed torch.optim.Muon / AdamW
    "tests/test_meshes.py",  # FSDP2, HSDP, TP, FSDP x TP against the single-process reference
    "tests/test_pipeline.py::test_pipeline_schedules_match_single_process_reference",  # PP
    "tests/test_state_dict_api.py",  # model/optimizer state dicts, torch's get/set_state_dict
    "tests/test_distconfig_dcp.py",  # dcp.save / dcp.load round trips
    "tests/test_integrations.py",  # Accelerate and the transformers Trainer
    "tests/test_main_job.py",  # python -m dmuon.train --steps 3
    "tests/test_tests_package.py",  # the suite imports beside an installed ``tests`` package
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(COMPAT_TESTS):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """Session-wide :class:`tests._pool.DistPool`; its workers are stopped and reaped at the end.

    Use ``dist_pool.run(world_size=4, fn="tests.<module>:<function>", kwargs={...},
    timeout_s=60)``; it returns the per-rank values in rank order and raises (naming the ranks)
    when a rank raises, dies or hangs.
    """
    pool = DistPool()
    try:
        yield pool
    finally:
        pool.close()
        _reap_multiprocessing_helpers()


@pytest.fixture(scope="session")
def torchtitan_path() -> str | None:
    """torchtitan 0.3.0 made importable (``tests/_torchtitan_site.py``): ``None`` if installed,
    else the cache folder it was pip-installed into (put first on this process's ``sys.path``
    here; pass it to the pool's case functions, which do the same in the workers).

    Fails the test if pip cannot install it; skips instead with ``DMUON_TESTS_OFFLINE=1``.
    """
    try:
        site = torchtitan_site()
    except SiteUnavailable as exc:
        if exc.offline:  # the one way to run without it, asked for by name
            pytest.skip(f"DMUON_TESTS_OFFLINE=1 and torchtitan 0.3.0 is not installed: {exc}")
        pytest.fail(str(exc), pytrace=False)
    use_site(site)
    return site


def _reap_multiprocessing_helpers() -> None:
    """Stop and reap the forkserver and resource tracker the pool started.

    Left alone they exit after pytest and linger as zombies until the container's init reaps
    them (seconds). ``_stop`` is private CPython API (3.8+), hence the ``getattr`` guard.
    """
    for helper in (multiprocessing.forkserver._forkserver,
                   multiprocessing.resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            stop()
