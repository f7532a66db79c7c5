"""celery-lock's benchmarks: lock cycle, end-to-end throughput, duplicate storm, memory.

Run ``python -m bench`` (full, for ``docs/benchmarks.md``) or ``python -m bench --quick`` (CI).
"""
