"""Authenticated traffic through NGINX on the real node: without the key 401 in the OpenAI error shape, with it
200, and a rotated Secret taking effect in the running engine pod without a restart (the kubelet updates the
mounted Secret; the engine re-reads it: --api-key-file)."""

from __future__ import annotations

import json
import time

from e2e.node.test_real_node import chat, engine_pods, llmdeployment, ready
from e2e.waiting import wait_for

NAME = "keyed"
SECRET = "keyed-api-key"


def set_secret(node, value: str) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": "default"},
              "type": "Opaque", "stringData": {"api-key": value}}
    node.kubectl("apply", "-f", "-", input=json.dumps(secret))


def test_the_api_key_guards_nginx_and_a_rotated_secret_takes_effect_without_a_restart(node, operator_release,
                                                                                        model_claim):
    set_secret(node, "first-key")
    doc = llmdeployment(1, NAME)
    doc["spec"].pop("adapters")
    doc["spec"]["auth"] = {"apiKeySecretRef": {"name": SECRET}}
    node.kubectl("apply", "-f", "-", input=json.dumps(doc))
    try:
        pods = wait_for(lambda: [p for p in engine_pods(node, NAME) if ready(p)], timeout=300, interval=2,
                        what="a ready engine pod")
        ip = node.kubectl("get", "service", f"{NAME}-lb", "-o", "jsonpath={.spec.clusterIP}").stdout
        url = f"http://{ip}/v1"
        model = doc["spec"]["model"]["name"]
        wait_for(lambda: chat(url, model, "first-key")[0], lambda code: code == 200, timeout=60, interval=1,
                 what="NGINX routing an authenticated request")
        code, body = chat(url, model)
        assert code == 401 and body["error"]["code"] == "invalid_api_key", body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert chat(url, model, "wrong")[0] == 401

        rotated = time.monotonic()
        set_secret(node, "first-key\nsecond-key")  # both while clients move over
        wait_for(lambda: chat(url, model, "second-key")[0], lambda code: code == 200, timeout=120, interval=1,
                 what="the new key accepted after the Secret changed")
        took = time.monotonic() - rotated
        assert chat(url, model, "first-key")[0] == 200
        set_secret(node, "second-key")
        wait_for(lambda: chat(url, model, "first-key")[0], lambda code: code == 401, timeout=120, interval=1,
                 what="the old key refused once it left the Secret")
        (after,) = [p for p in engine_pods(node, NAME) if ready(p)]
        assert after["metadata"]["uid"] == pods[0]["metadata"]["uid"]  # the same pod...
        assert after["status"]["containerStatuses"][0]["restartCount"] == 0  # ...and the same engine process
        print(f"\n[node] API key rotated in the running pod: the new key served {took:.1f} s after the Secret changed")
    finally:
        node.kubectl("delete", "llmd", NAME, "--wait=false")
        node.kubectl("delete", "secret", SECRET, "--ignore-not-found")
