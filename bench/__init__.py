"""The benchmark harness: ``bench/run`` (see ``bench/README.md``).

A package so that its processes start as ``python -m bench.<module>`` from the
repository root: the fake upstream, the load generator, the raw proxy and the
orchestrator are separate processes on purpose (each measured or pinned on its own).
"""
