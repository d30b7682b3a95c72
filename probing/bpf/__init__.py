"""The BCC loader: BPF programs from ``bpf/``, uprobes, ring-buffer drain.

``probing.bpf.tracer.start(["nccl", "gloo"])`` traces this process into
the store tables ``nccl.calls``, ``cuda.calls`` and ``gloo.calls``.
"""
