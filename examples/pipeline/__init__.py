"""A three-stage pipeline (pending -> process -> callback) that must handle each request once.

Each stage is its own task, its own queue and its own worker pool; the three tasks share the
lock scope ``request``, so no two stages ever work on one request at the same time, while each
stage keeps a done-marker of its own. See ``README.md`` in this folder.
"""
