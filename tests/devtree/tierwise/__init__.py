"""Development only (never installed): `tierwise` is the checkout this file lives in.

tests/conftest.py puts tests/devtree first on sys.path (and on PYTHONPATH, for the tests'
subprocesses), so `python -m pytest` in any checkout or git worktree tests that checkout's
code even when another checkout holds the editable install. Nothing is re-exported: the
package's path is the repository root, whose folders are its sub-packages."""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[3])]
