"""Celery apps that ``python -m bench`` runs in real worker subprocesses."""
