"""A rootfs directory as a single-layer image tarball in `docker save` layout.

No registry runs here, so the real-node harness turns a debootstrap rootfs (or a tiny pause rootfs) into the
format `ctr -n k8s.io images import` and `buildah pull docker-archive:` accept.
"""

import hashlib
import io
import json
import tarfile
from pathlib import Path


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_image_archive(rootfs: Path, out: Path, tag: str, entrypoint: list[str], env: list[str] = ()) -> str:
    """Write `out` and return the image config's digest (what `ctr images ls` shows as the image id)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        # numeric owners as they are on disk; the archive's root is the image's /
        for child in sorted(Path(rootfs).iterdir()):
            tar.add(child, arcname=child.name)
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Env": list(env) or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "pagekube e2e image_archive"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_hex = hashlib.sha256(config_bytes).hexdigest()
    manifest = [{"Config": f"{config_hex}.json", "RepoTags": [tag], "Layers": [f"{diff_id[7:]}/layer.tar"]}]
    with tarfile.open(out, "w") as tar:
        _add(tar, f"{config_hex}.json", config_bytes)
        _add(tar, f"{diff_id[7:]}/layer.tar", layer_bytes)
        _add(tar, "manifest.json", json.dumps(manifest).encode())
    return "sha256:" + config_hex
