"""The operator's informer without a cluster (the real control plane covers the rest, e2e/test_operator_scale.py):
a kind whose CRD appears after start is noticed, and the owner index follows objects as they change."""

from __future__ import annotations

import json

from pagekube.operator.informer import Informer


class Response:
    def __init__(self, status: int, body: dict | None = None):
        self.status, self.body = status, body

    def read(self) -> bytes:
        return json.dumps(self.body).encode()


def informer(responses: list[Response], **kw) -> Informer:
    inf = Informer(None, "keda.sh/v1alpha1", "ScaledObject", "scaledobjects", None, "managed=yes",
                   "serving.pagekube.io/llmdeployment", kw.pop("on_change", lambda *a: None), **kw)
    inf._request = lambda params, timeout: responses.pop(0)
    return inf


def scaled_object(name: str, owner: str, rv: str) -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                         "labels": {"serving.pagekube.io/llmdeployment": owner}}}


def test_a_kind_installed_after_start_is_served_and_says_so_once():
    served = []
    inf = informer([Response(404), Response(200, {"items": [], "metadata": {"resourceVersion": "5"}})],
                   on_served=lambda: served.append(True))
    assert inf._list() is None and inf.served is False and inf.synced.is_set() and served == []
    assert inf._list() == "5" and inf.served is True and served == [True]


def test_the_owner_index_follows_adds_moves_and_deletes():
    events = []
    page = {"items": [scaled_object("a-engine", "a", "1")], "metadata": {"resourceVersion": "1"}}
    inf = informer([Response(200, page)], on_change=lambda kind, obj: events.append((kind, obj["metadata"]["name"])))
    inf._list()
    assert set(inf.owned_by("ns", "a")) == {"a-engine"} and inf.get("ns", "a-engine")["kind"] == "ScaledObject"
    inf._put(scaled_object("a-engine", "b", "2"))  # relabelled to another owner
    assert inf.owned_by("ns", "a") == {} and set(inf.owned_by("ns", "b")) == {"a-engine"}
    inf._delete(scaled_object("a-engine", "b", "3"))
    assert inf.owned_by("ns", "b") == {} and inf.get("ns", "a-engine") is None
    assert events == [("ADDED", "a-engine"), ("MODIFIED", "a-engine"), ("DELETED", "a-engine")]
