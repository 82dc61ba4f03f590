"""torchtitan 0.3.0 for the tests, installed on demand (issue 32: "torchtitan in a test that
installs with torch 2.13").

torchtitan is not in the test extra: its full install pins ``datasets<4.8`` and downgrades
``huggingface_hub``, which clashes with the ``transformers`` 5.x the extra needs. The llama3
model, ``parallelize_llama``, its optimizer / LR-scheduler containers, activation checkpointing
and ``dist_utils.clip_grad_norm_`` import with four pure-python wheels and nothing else (found by
importing every module the cases use from a ``--target`` directory with the site-packages copies
hidden): :data:`PACKAGES`. :func:`torchtitan_site` installs them with ``pip install --no-deps
--target`` into a cache directory (~5 s; reused by later sessions) unless torchtitan 0.3.0 is
already installed, and the cases put the returned directory first on ``sys.path`` in every
pool worker (the workers start once per session, so it travels as an argument, not through the
environment).

``DMUON_TESTS_OFFLINE=1`` (read here only) turns a failed install into a skip; otherwise a failed
install fails the test, so CI cannot silently stop running it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: torchtitan and the pure-python packages its imported modules need (``--no-deps``).
PACKAGES = ("torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17", "docstring_parser==0.18.0")
VERSION = "0.3.0"
#: Where the packages go: ``$DMUON_TESTS_CACHE`` or ``~/.cache/dmuon-tests``, one folder per pin set.
CACHE_ROOT = Path(os.environ.get("DMUON_TESTS_CACHE", Path.home() / ".cache" / "dmuon-tests"))
_DONE = ".dmuon-complete"  # written last: a folder without it is a partial install
_INSTALL_TIMEOUT_S = 300


class SiteUnavailable(RuntimeError):
    """pip could not install :data:`PACKAGES` (no index, no network); ``offline`` is whether
    ``DMUON_TESTS_OFFLINE=1`` asks for a skip instead of a failure."""

    def __init__(self, message: str, offline: bool) -> None:
        super().__init__(message)
        self.offline = offline


def installed_version() -> str | None:
    """The version of the torchtitan importable in this environment, ``None`` without one (its
    metadata's version, if ``import torchtitan`` would find a module: nothing is imported)."""
    try:
        if importlib.util.find_spec("torchtitan") is None:
            return None
        return importlib.metadata.version("torchtitan")
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return None


def cache_dir() -> Path:
    """The folder :data:`PACKAGES` are installed into (named by the pins, so a new pin set gets a
    new folder)."""
    return CACHE_ROOT / f"torchtitan-{VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"


def torchtitan_site() -> str | None:
    """Make torchtitan 0.3.0 importable: ``None`` if this environment has it, else the cache
    folder holding :data:`PACKAGES` (installed now if missing), to put first on ``sys.path``.

    Returns:
        ``None`` or the folder's path (str).

    Raises:
        SiteUnavailable: pip failed (its output in the message); ``offline`` set from
            ``DMUON_TESTS_OFFLINE``.
    """
    if installed_version() == VERSION:
        return None
    target = cache_dir()
    if (target / _DONE).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--target", str(staging), *PACKAGES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
        failed = proc.returncode != 0
        detail = (proc.stdout + proc.stderr).strip()[-3000:]
    except subprocess.TimeoutExpired as exc:
        failed, detail = True, f"timed out after {exc.timeout} s"
    if failed:
        shutil.rmtree(staging, ignore_errors=True)
        offline = os.environ.get("DMUON_TESTS_OFFLINE", "") == "1"
        raise SiteUnavailable(
            f"dmuon tests: could not install {' '.join(PACKAGES)} into {target} "
            f"(`{' '.join(cmd)}`):\n{detail}\nInstall them by hand with that command (or "
            f"`pip install --no-deps torchtitan==0.3.0 ...`), or set DMUON_TESTS_OFFLINE=1 to "
            f"skip the torchtitan tests.", offline)
    (staging / _DONE).write_text(" ".join(PACKAGES) + "\n")
    try:
        staging.rename(target)  # atomic; a concurrent session may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / _DONE).exists():
            raise
    return str(target)


def use_site(site: str | None) -> None:
    """Put ``site`` (from :func:`torchtitan_site`) first on ``sys.path``; ``None``: nothing."""
    if site is not None and site not in sys.path:
        sys.path.insert(0, site)
