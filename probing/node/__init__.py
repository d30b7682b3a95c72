"""The node's engine: the process beside the jobs, one per node (per user and
install), that serves every traced process of the node.

Here: the engine's door (``service``), the probe contexts it holds
(``probe``), BPF load and drain (``bpf``), the compressed store (``store``),
the SQL layer over it (``sql``, DataFusion), the tables (``tables``) and the
cluster (``cluster``). ``assemble`` puts a probe together from them.
"""
