"""The Gateway API Inference Extension's InferencePool over the engine pods (`gateway.inferencePool`).

A gateway with an endpoint picker (llm-d's, the extension's reference EPP) then routes each request to a pod by
the metrics the engines export under vLLM's names (queue, KV-cache usage, LoRA adapters) and by prefix; NGINX and
the Services stay as they are, for clients that do not go through that gateway.
"""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.spec import LLMDeploymentSpec

API_VERSION = "inference.networking.k8s.io/v1"


def build_inference_pool(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    pool = {
        "selector": {"matchLabels": naming.selector(name, "engine")},
        "targetPorts": [{"number": naming.ENGINE_PORT}],
    }
    picker = spec.gateway.endpoint_picker
    if picker is not None:
        pool["endpointPickerRef"] = {"kind": "Service", "name": picker.name, "port": {"number": picker.port},
                                     "failureMode": picker.failure_mode}
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": naming.metadata(name, namespace, name, "inference-pool"),
        "spec": pool,
    }
