"""Stragglers, slow links and hangs, from every rank's collectives and stacks.

Pure: tables in, verdicts out. ``queries`` is the SQL a diagnosis asks,
``diagnose.analyze`` the analysis of the rows it gathered, ``tables`` its
``analyze.*`` tables, ``detection`` and ``findings`` what the always-on
detector decides and keeps; the asking is the command line's
(``probing.cli.asking``), the ``analyze.*`` tables of one engine
``probing.node.tables.analysis``, the detector's threads and asking the
node's (``probing.node.detector``). No module here starts a thread, opens a
socket or writes a file, or sleeps (``tests/test_analyze_pure.py``).
"""

from __future__ import annotations

from probing.analyze.diagnose import Diagnosis, analyze

__all__ = ["Diagnosis", "analyze"]
