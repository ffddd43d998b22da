"""LoRA adapters of an LLMDeployment (spec.adapters): where each one is in the engine pod, and what puts it there.

Every replica loads every declared adapter at start (`--enable-lora --lora-modules name=path ...`), so a restart or
a scale-up never loses one. The adapters are part of the pod template: adding or removing one rolls the replicas
(the rollout drains each old pod, so no request is lost). Sources are the model's schemes: file:// (in the image
or a volume of engine.volumes), pvc:// (the claim mounted read-only), hf:// and s3:// (downloaded by an init
container into an emptyDir).
"""

from __future__ import annotations

from pagekube.operator.pod_security import container_security_context
from pagekube.operator.spec import AdapterSpec, LLMDeploymentSpec

ADAPTERS_DIR = "/adapters"  # downloads (hf://, s3://), one folder per adapter
CLAIMS_DIR = "/adapter-claims"  # pvc:// claims, one mount per claim
DOWNLOAD_CONTAINER = "adapter-download"
# Runs in the engine image: (repo, revision, target) triples; HF_TOKEN etc. come from engine.env.
HF_ADAPTERS_DOWNLOAD = (
    "import sys; from huggingface_hub import snapshot_download\n"
    "a = sys.argv[1:]\n"
    "for repo, revision, target in zip(a[0::3], a[1::3], a[2::3]):\n"
    "    snapshot_download(repo_id=repo, revision=revision or None, local_dir=target)\n"
    "    print('downloaded adapter', repo, revision or '(default branch)', 'to', target, flush=True)"
)


def _scheme(adapter: AdapterSpec) -> tuple[str, str]:
    scheme, rest = adapter.source.split("://", 1)
    return scheme, rest


def _claim_volume(claim: str) -> str:
    return f"adapter-claim-{claim}"[:63].rstrip("-")


def adapter_path(adapter: AdapterSpec) -> str:
    """Where the engine finds the adapter's files inside its container."""
    scheme, rest = _scheme(adapter)
    if scheme == "file":
        return rest
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        return f"{CLAIMS_DIR}/{claim}/{sub}".rstrip("/")
    return f"{ADAPTERS_DIR}/{adapter.name.replace('/', '--')}"  # one folder, whatever the name's slashes


def lora_flags(spec: LLMDeploymentSpec) -> dict:
    """The engine flags the adapters need (none without adapters)."""
    if not spec.adapters:
        return {}
    return {"enable_lora": True, "lora_modules": [f"{a.name}={adapter_path(a)}" for a in spec.adapters],
            "max_loras": spec.engine.max_loras, "max_lora_rank": spec.engine.max_lora_rank}


def adapter_volumes(spec: LLMDeploymentSpec, image: str, env: list[dict], env_from: list[dict],
                    s3_image: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, engine mounts, init containers) for the adapters; `env`/`env_from` reach the downloads (HF_TOKEN,
    AWS_*), as they reach the model's."""
    volumes, mounts, inits = [], [], []
    claims = sorted({_scheme(a)[1].partition("/")[0] for a in spec.adapters if _scheme(a)[0] == "pvc"})
    for claim in claims:
        volumes.append({"name": _claim_volume(claim), "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": _claim_volume(claim), "mountPath": f"{CLAIMS_DIR}/{claim}", "readOnly": True})
    hf = [a for a in spec.adapters if _scheme(a)[0] == "hf"]
    s3 = [a for a in spec.adapters if _scheme(a)[0] == "s3"]
    if not hf and not s3:
        return volumes, mounts, inits
    volumes.append({"name": "adapters", "emptyDir": {}})
    mounts.append({"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True})
    common = {"volumeMounts": [{"name": "adapters", "mountPath": ADAPTERS_DIR}],
              "securityContext": container_security_context(read_only_root=False),
              **({"envFrom": env_from} if env_from else {})}
    if hf:
        triples = [x for a in hf for x in (_scheme(a)[1], a.revision or "", adapter_path(a))]
        inits.append({"name": DOWNLOAD_CONTAINER, "image": image,
                      "command": ["python", "-c", HF_ADAPTERS_DOWNLOAD, *triples], "env": env, **common})
    for i, a in enumerate(s3):  # one aws-cli container each: no shell between the spec and the command
        inits.append({"name": f"{DOWNLOAD_CONTAINER}-s3-{i}", "image": s3_image,
                      "args": ["s3", "sync", a.source, adapter_path(a)],
                      "env": [{"name": "HOME", "value": "/tmp"}, *env], **common})
    return volumes, mounts, inits
