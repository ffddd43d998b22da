"""Watch-fed caches of Kubernetes objects (client-go's reflector and store, small): LIST once, then WATCH from that
resourceVersion, so a steady state costs the API server nothing but open watches.

One `Informer` per kind (and per namespace when the operator watches only some), filtered on the API server by a
label selector, keeps its objects as plain dicts with an index by owner (the LLMDeployment label). A watch that
ends is resumed from the last resourceVersion (bookmarks keep it fresh); a 410 Gone lists again. A kind the
cluster does not serve (KEDA or prometheus-operator not installed) reads as not served and is looked for again on
a timer, not per pass.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger("pagekube.operator")
WATCH_TIMEOUT_SECONDS = 300  # the server ends each watch after this; we resume from the last resourceVersion
LIST_PAGE = 500


class Gone(Exception):
    """The resourceVersion is too old (410): list again."""


class Informer:
    def __init__(self, api: client.ApiClient, api_version: str, kind: str, plural: str, namespace: str | None,
                 label_selector: str | None, owner_label: str | None, on_change: Callable[[str, dict], None],
                 recheck_seconds: float = 60.0, on_served: Callable[[], None] | None = None):
        self.api, self.api_version, self.kind = api, api_version, kind
        group_path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        self.path = f"{group_path}/namespaces/{namespace}/{plural}" if namespace else f"{group_path}/{plural}"
        self.label_selector, self.owner_label, self.on_change = label_selector, owner_label, on_change
        self.recheck_seconds = recheck_seconds
        self.on_served = on_served  # called when a kind not served before is served now (its CRD installed)
        self.served: bool | None = None  # None until the first LIST answered
        self.synced = threading.Event()
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], dict] = {}
        self._by_owner: dict[tuple[str, str], dict[str, dict]] = {}
        self._stop = threading.Event()
        self._response = None

    # ---- reads (any thread) ------------------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def owned_by(self, namespace: str, owner: str) -> dict[str, dict]:
        with self._lock:
            return dict(self._by_owner.get((namespace, owner), {}))

    def keys(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._objects)

    # ---- the watch thread --------------------------------------------------------------------------------------
    def start(self) -> Informer:
        threading.Thread(target=self._run, name=f"informer-{self.kind}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:  # closing a stream another thread is reading can block: never make stop() wait
            threading.Thread(target=response.close, name=f"close-{self.kind}", daemon=True).start()

    def _run(self) -> None:
        backoff = 1.0
        resource_version = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                    if resource_version is None:  # not served: look again later
                        self._stop.wait(self.recheck_seconds)
                        continue
                resource_version = self._watch(resource_version)
                backoff = 1.0
            except Gone:
                resource_version = None
            except Exception as e:  # noqa: BLE001 - the API server restarting, a dropped connection: retry
                if self._stop.is_set():
                    return
                log.warning("%s watch failed (%s); retrying in %.0f s", self.kind, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                resource_version = None

    def _request(self, params: list[tuple[str, str]], timeout: float | None):
        if self.label_selector:
            params = [*params, ("labelSelector", self.label_selector)]
        method, url, headers, body, post = self.api.param_serialize(
            "GET", self.path, query_params=params, header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"])
        return self.api.call_api(method, url, headers, body, post, _request_timeout=timeout)

    def _list(self) -> str | None:
        """Replace the store with a fresh LIST (paged); the resourceVersion to watch from, None if not served."""
        items, params = [], [("limit", str(LIST_PAGE))]
        while True:
            response = self._request(params, timeout=60)
            if response.status == 404:
                if self.served is not False:
                    log.info("%s (%s) is not served by this cluster; looking again every %.0f s", self.kind,
                             self.api_version, self.recheck_seconds)
                self.served = False
                self._replace({})
                self.synced.set()
                return None
            if response.status != 200:
                raise RuntimeError(f"LIST {self.path}: HTTP {response.status} {response.read()[:200]!r}")
            page = json.loads(response.read())
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
            params = [("limit", str(LIST_PAGE)), ("continue", token)]
        newly_served = self.served is False
        self.served = True
        self._replace({_key(o): _with_type(o, self.api_version, self.kind) for o in items})
        self.synced.set()
        if newly_served:
            log.info("%s (%s) is served now", self.kind, self.api_version)
            if self.on_served is not None:
                self.on_served()
        return page["metadata"]["resourceVersion"]

    def _watch(self, resource_version: str) -> str:
        params = [("watch", "true"), ("resourceVersion", resource_version), ("allowWatchBookmarks", "true"),
                  ("timeoutSeconds", str(WATCH_TIMEOUT_SECONDS))]
        response = self._request(params, timeout=WATCH_TIMEOUT_SECONDS + 30)
        if response.status == 410:
            raise Gone()
        if response.status != 200:
            raise RuntimeError(f"WATCH {self.path}: HTTP {response.status}")
        self._response = response.response
        try:
            for line in iter_resp_lines(response.response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch {self.path}: {obj.get('message')}")
                resource_version = obj["metadata"]["resourceVersion"]
                if kind in ("ADDED", "MODIFIED"):
                    self._put(_with_type(obj, self.api_version, self.kind))
                elif kind == "DELETED":
                    self._delete(obj)
        finally:
            self._response = None
            response.response.release_conn()
        return resource_version

    # ---- the store -----------------------------------------------------------------------------------------------
    def _owner(self, obj: dict) -> tuple[str, str] | None:
        owner = ((obj["metadata"].get("labels") or {}).get(self.owner_label)) if self.owner_label else None
        return (obj["metadata"].get("namespace", ""), owner) if owner else None

    def _put(self, obj: dict) -> None:
        key = _key(obj)
        with self._lock:
            old = self._objects.get(key)
            self._objects[key] = obj
            if old is not None and (owner := self._owner(old)) is not None:
                self._by_owner.get(owner, {}).pop(key[1], None)
            if (owner := self._owner(obj)) is not None:
                self._by_owner.setdefault(owner, {})[key[1]] = obj
        self.on_change("MODIFIED" if old is not None else "ADDED", obj)

    def _delete(self, obj: dict) -> None:
        key = _key(obj)
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None and (owner := self._owner(old)) is not None:
                self._by_owner.get(owner, {}).pop(key[1], None)
        self.on_change("DELETED", old or obj)

    def _replace(self, objects: dict[tuple[str, str], dict]) -> None:
        with self._lock:
            gone = [o for k, o in self._objects.items() if k not in objects]
            changed = [o for k, o in objects.items()
                       if self._objects.get(k, {}).get("metadata", {}).get("resourceVersion")
                       != o["metadata"].get("resourceVersion")]
            self._objects = dict(objects)
            self._by_owner = {}
            for key, obj in objects.items():
                if (owner := self._owner(obj)) is not None:
                    self._by_owner.setdefault(owner, {})[key[1]] = obj
        for obj in gone:
            self.on_change("DELETED", obj)
        for obj in changed:
            self.on_change("ADDED", obj)


def _key(obj: dict) -> tuple[str, str]:
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _with_type(obj: dict, api_version: str, kind: str) -> dict:
    """LIST items come without apiVersion and kind; the reconciler compares whole objects."""
    obj.setdefault("apiVersion", api_version)
    obj.setdefault("kind", kind)
    return obj


def wait_synced(informers: list[Informer], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    return all(i.synced.wait(max(0.0, deadline - time.monotonic())) for i in informers)
