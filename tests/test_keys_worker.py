"""Request keys as an in-process worker derives them, on a real Redis: a copy of a request
that has run already is skipped whatever its key is made of, and a key the worker cannot
derive is refused when the call is published, not on the worker.

The first copy is a direct call in this process (it takes the lease and writes the
done-marker as a worker does), the second goes through the broker (JSON, memory transport).
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from celery.contrib.testing.worker import TestWorkController
from conftest import wait_for

from celery_lock import SKIPPED, LockedTask, LockKeyError

TIMEOUT = 20
pytestmark = pytest.mark.usefixtures("close_lock_runtime")


class Status(str, enum.Enum):
    PAID = "paid"


@pytest.fixture
def celery_config(celery_config: dict[str, Any]) -> dict[str, Any]:
    """The session's config, and a ``lock_key`` set the Celery way, by task annotations."""
    return {**celery_config, "task_annotations": {"kw.annotated": {"lock_key": "order_id"}}}


@pytest.fixture
def runs() -> list[tuple[str, Any]]:
    return []


@pytest.fixture
def tasks(celery_app: Celery, runs: list[tuple[str, Any]]) -> dict[str, Any]:
    @celery_app.task(base=LockedTask, name="kw.by_method", lock_key="{tenant.lower}:{order_id}")
    def by_method(tenant: str, order_id: int) -> str:
        runs.append(("kw.by_method", order_id))
        return f"{tenant}/{order_id}"

    @celery_app.task(base=LockedTask, name="kw.by_status", lock_key=lambda status: status.value)
    def by_status(status: str) -> str:
        runs.append(("kw.by_status", status))
        return status

    @celery_app.task(base=LockedTask, name="kw.annotated")
    def annotated(order_id: int, sent_at: float) -> int:
        runs.append(("kw.annotated", order_id))
        return order_id

    return {"by_method": by_method, "by_status": by_status, "annotated": annotated}


@pytest.fixture
def worker(tasks: dict[str, Any], celery_worker: TestWorkController) -> TestWorkController:
    return celery_worker


def test_a_template_reaching_a_method_never_runs_a_request_twice(
    worker: Any, tasks: dict[str, Any], runs: list[tuple[str, Any]]
) -> None:
    """``{tenant.lower}`` reaches the bound method ``str.lower``, whose text holds the
    address of the string: each copy of the request had a key of its own."""
    ship = tasks["by_method"]
    try:
        ship("acme", 7)
        copy = ship.delay("acme", 7)
    except LockKeyError:
        return  # refused before anything ran or was published: fine
    wait_for("the copy to end", lambda: copy.state in (SKIPPED, "SUCCESS", "FAILURE"), TIMEOUT)
    assert runs == [("kw.by_method", 7)], "the request ran twice"
    assert copy.state == SKIPPED


def test_a_callable_key_the_worker_cannot_derive_is_refused_at_publish(
    worker: Any, tasks: dict[str, Any], runs: list[tuple[str, Any]]
) -> None:
    """``status.value`` of an enum member works at the caller; the worker receives "paid"."""
    try:
        result = tasks["by_status"].delay(Status.PAID)
    except LockKeyError:
        return  # refused at publish: fine
    wait_for("the task to end", lambda: result.state in ("SUCCESS", "FAILURE"), TIMEOUT)
    assert result.state == "SUCCESS", f"published, then failed on the worker: {result.result!r}"


def test_a_lock_key_set_by_task_annotations_skips_a_copy_of_a_done_request(
    worker: Any, tasks: dict[str, Any], runs: list[tuple[str, Any]]
) -> None:
    annotated = tasks["annotated"]
    assert annotated(7, 1.0) == 7
    copy = annotated.delay(7, 2.0)  # one request: the key is order_id alone
    wait_for("the copy to end", lambda: copy.state in (SKIPPED, "SUCCESS", "FAILURE"), TIMEOUT)
    assert runs == [("kw.annotated", 7)], "the request ran twice"
    assert (copy.state, copy.info["reason"]) == (SKIPPED, "done")


# -- pydantic=True: Celery sends a model argument as its dump ------------------------------------

needs_model_dumps = pytest.mark.skipif(
    not hasattr(Task, "_dump_pydantic_arguments"),
    reason="this Celery does not dump pydantic models at publish",
)


@pytest.fixture
def models(celery_app: Celery, runs: list[tuple[str, Any]]) -> dict[str, Any]:
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        id: int
        tenant: str

    def by_attribute(order: Order) -> int:
        runs.append(("kw.by_attribute", order.id))
        return order.id

    def by_default(order: Order) -> int:
        runs.append(("kw.by_default", order.id))
        return order.id

    def by_item(self: Any, order: Order) -> int:
        runs.append(("kw.by_item", order.id))
        return order.id

    class Sent(Order):  # type: ignore[misc,valid-type]
        """Celery leaves a model with kombu's hook to kombu, which sends what it returns."""

        def __json__(self) -> dict[str, Any]:
            return {"id": self.id, "tenant": self.tenant}

    def by_hook(order: Sent) -> int:
        runs.append(("kw.by_hook", order.id))
        return order.id

    for function in (by_attribute, by_default, by_item):
        function.__annotations__["order"] = Order
    by_hook.__annotations__["order"] = Sent
    options: dict[str, Any] = {"base": LockedTask, "pydantic": True}
    return {
        "Order": Order,
        "Sent": Sent,
        "by_hook": celery_app.task(name="kw.by_hook", lock_key="{order[id]}", **options)(by_hook),
        "by_item": celery_app.task(name="kw.by_item", lock_key="{order[id]}", bind=True, **options)(
            by_item
        ),
        "by_attribute": celery_app.task(name="kw.by_attribute", lock_key="{order.id}", **options)(
            by_attribute
        ),
        "by_default": celery_app.task(name="kw.by_default", **options)(by_default),
    }


@needs_model_dumps
def test_a_template_over_a_model_the_worker_receives_as_a_dict_is_refused_at_publish(
    models: dict[str, Any], celery_worker: TestWorkController, runs: list[tuple[str, Any]]
) -> None:
    order = models["Order"](id=7, tenant="acme")
    try:
        result = models["by_attribute"].delay(order)
    except LockKeyError:
        return  # refused at publish: fine
    wait_for("the task to end", lambda: result.state in ("SUCCESS", "FAILURE"), TIMEOUT)
    assert result.state == "SUCCESS", f"published, then failed on the worker: {result.result!r}"


@needs_model_dumps
def test_the_default_key_of_a_model_argument_is_the_digest_of_what_celery_sends(
    models: dict[str, Any], celery_worker: TestWorkController, runs: list[tuple[str, Any]]
) -> None:
    """Celery sends the model as a dict: the digest of the dict, at the caller as on the
    worker. (The model itself, no JSON, made every call a LockKeyError.)"""
    task, order = models["by_default"], models["Order"](id=7, tenant="acme")
    assert task(order) == 7
    copy = task.delay(order)
    wait_for("the copy to end", lambda: copy.state in (SKIPPED, "SUCCESS", "FAILURE"), TIMEOUT)
    assert runs == [("kw.by_default", 7)], "the request ran twice"
    assert (copy.state, copy.info["reason"]) == (SKIPPED, "done")


@needs_model_dumps
@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_an_item_template_over_a_model_keys_a_direct_call_and_a_sent_copy_alike(
    models: dict[str, Any],
    celery_worker: TestWorkController,
    runs: list[tuple[str, Any]],
    by_keyword: bool,
) -> None:
    """``{order[id]}`` reads the dict Celery sends for the model: at publish, where the caller
    passes the model, on the worker, which receives the dict, and in a direct call."""
    task, order = models["by_item"], models["Order"](id=7, tenant="acme")
    assert task(order) == 7
    copy = task.apply_async(kwargs={"order": order}) if by_keyword else task.delay(order)
    wait_for("the copy to end", lambda: copy.state in (SKIPPED, "SUCCESS", "FAILURE"), TIMEOUT)
    assert runs == [("kw.by_item", 7)], "the request ran twice"
    assert (copy.state, copy.info["reason"]) == (SKIPPED, "done")
    assert copy.info["lock_key"] == task.request_keys((), {"order": {"id": 7, "tenant": "x"}}).lock


@needs_model_dumps
def test_a_model_kombu_sends_by_its_json_hook_keys_a_direct_call_and_a_sent_copy_alike(
    models: dict[str, Any], celery_worker: TestWorkController, runs: list[tuple[str, Any]]
) -> None:
    # The worker receives what __json__ returns; the caller refused {order[id]} of the model.
    task, order = models["by_hook"], models["Sent"](id=7, tenant="acme")
    assert task(order) == 7
    copy = task.delay(order)
    wait_for("the copy to end", lambda: copy.state in (SKIPPED, "SUCCESS", "FAILURE"), TIMEOUT)
    assert runs == [("kw.by_hook", 7)], "the request ran twice"
    assert (copy.state, copy.info["reason"]) == (SKIPPED, "done")


#: A class-based task (``app.register_task``), run in a process of its own, directly, with the
#: module imported (``import reports``) or run as ``__main__`` (``python reports.py``, a worker
#: started with ``app.worker_main()``). Prints the task's name, lock key and return value.
REGISTERED_TASK_MODULE = """
import json, os, sys

from celery import Celery
from celery_lock import LockedTask

app = Celery("reports", broker="memory://")
app.conf.celery_lock_redis_url = os.environ["LOCK_URL"]


class Rebuild(LockedTask):
    def run(self, day):
        return "rebuilt " + day


rebuild = app.register_task(Rebuild())


def main():
    result = rebuild("2026-11-21")
    json.dump([rebuild.name, rebuild.request_keys(("2026-11-21",), {}).lock, result], sys.stdout)


if __name__ == "__main__":
    main()
"""


def test_a_registered_task_keys_a_request_alike_in_a_process_running_its_module_as_main(
    tmp_path: Path, lock_url: str
) -> None:
    # Celery names the task reports.Rebuild in both processes; the default key digested the
    # name the class got when it was created, __main__.Rebuild in the first: two keys for one
    # request, which ran in both.
    (tmp_path / "reports.py").write_text(REGISTERED_TASK_MODULE)
    env = {**os.environ, "LOCK_URL": lock_url, "PYTHONPATH": str(tmp_path)}
    outputs = []
    for command in (["reports.py"], ["-c", "import reports; reports.main()"]):
        proc = subprocess.run(
            [sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    (as_main, main_key, first), (imported, imported_key, second) = outputs
    assert as_main == imported == "reports.Rebuild"
    assert main_key == imported_key
    assert first == "rebuilt 2026-11-21"
    assert second["celery_lock"] == "skipped"
    assert second["reason"] == "done"
