"""Stragglers, slow links and hangs, from every rank's collectives and stacks.

Pure: tables in, verdicts out. ``queries`` is the SQL a diagnosis asks,
``diagnose.analyze`` the analysis of the rows it gathered; the asking is the
command line's (``probing.cli.asking``), the ``analyze.*`` tables of one
engine ``probing.node.tables.analysis``.
"""

from __future__ import annotations

from probing.analyze.diagnose import Diagnosis, analyze

__all__ = ["Diagnosis", "analyze"]
