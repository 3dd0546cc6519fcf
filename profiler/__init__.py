"""Offline latency-model profiling (Eq. 5-7) and the latency-model file format.

``profiler.modelfile`` reads and writes the latency-model JSON that the
scheduler, the simulator and (later) the dispatcher load. The profiling driver
against a real engine (``python -m profiler``) lands with the scheduler-plugin
issue.
"""
