"""The always-on detector of a traced job, run by the node's engine for its
probe: ``watch`` (the threads: its looks, its full detections, who detects),
``window`` (what it asks of the ranks and of its own rank), ``analyst`` (a
window's analysis, as ``diagnose``'s), ``groups`` (torch's names for the
job's groups), ``book`` (its findings, ``findings.jsonl``). What it
decides over tables is ``probing.analyze`` (``detection``, ``findings``)."""
