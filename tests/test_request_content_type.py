"""The message's content type reaches the pool in the request dict, however the worker's request
is handed over: the class Celery's strategy generates, or Celery's own ``execute_using_pool``."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import create_request_cls
from kombu.utils.imports import symbol_by_name

from celery_lock import LockedTask
from celery_lock.request import CONTENT_TYPE_FIELD

PICKLE = "application/x-python-serialize"


class Pool:
    """Takes what the worker hands a pool process."""

    request: dict[str, Any]

    def apply_async(self, target: Any, args: tuple[Any, ...], **kwargs: Any) -> None:
        self.request = args[2]


@pytest.fixture
def task() -> Any:
    app = Celery("content_type", broker="memory://", set_as_current=False)

    @app.task(base=LockedTask, name="ct.task", shared=False)
    def task(x: int) -> int:
        return x

    return app.tasks[task.name]


@pytest.mark.parametrize("generated", [True, False], ids=["strategy's class", "celery's own"])
def test_the_pool_is_handed_the_content_type(task: Any, generated: bool) -> None:
    pool = Pool()
    request_cls = symbol_by_name(task.Request)
    if generated:
        request_cls = create_request_cls(request_cls, task, pool, "host", None, app=task.app)
    message = TaskMessage(task.name, args=(1,))
    message.content_type = PICKLE
    request_cls(message, app=task.app, task=task).execute_using_pool(pool)
    assert pool.request[CONTENT_TYPE_FIELD] == PICKLE


def test_a_request_executed_in_process_hands_the_task_the_content_type(
    task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's ``Request.execute`` (in-process, no pool) traces the task with
    ``_request_dict``, not the property: the override adds the content type there too."""
    traced: dict[str, Any] = {}

    def trace_task(task: Any, uuid: str, args: Any, kwargs: Any, request: Any, **_: Any) -> Any:
        traced.update(request)
        return None, None, None, None

    monkeypatch.setattr("celery.worker.request.trace_task", trace_task)
    message = TaskMessage(task.name, args=(1,))
    message.content_type = PICKLE
    symbol_by_name(task.Request)(message, app=task.app, task=task).execute()
    assert traced[CONTENT_TYPE_FIELD] == PICKLE
