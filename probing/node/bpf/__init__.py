"""The BCC loader: BPF programs from ``bpf/``, uprobes, ring-buffer drain.

``ProbeContext.start_trace(["nccl", "gloo"])`` (a ``tracer.Tracer`` on the
probe's store, in the node's engine) traces the probe's process into the
store tables ``nccl.calls``, ``cuda.calls`` and ``gloo.calls``.
"""
