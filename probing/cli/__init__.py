"""The command line's side: ``probing …`` (``app``, ``commands``), the client
that asks the node's engines (``client``), what it prints (``render``), the web
UI (``ui``), the timeline export (``export``), ``doctor`` and ``demo``."""
