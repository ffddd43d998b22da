"""The real-node harness's image tarball: the docker-save layout that `ctr images import` reads."""

import hashlib
import io
import json
import tarfile

from e2e.node.image_archive import write_image_archive


def test_archive_has_manifest_config_and_layer_with_matching_digests(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "pause").write_bytes(b"\x7fELF pretend")
    out = tmp_path / "pause.tar"

    image_id = write_image_archive(rootfs, out, "localhost/pause:3.10", ["/bin/pause"])

    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        assert manifest[0]["RepoTags"] == ["localhost/pause:3.10"]
        config_bytes = tar.extractfile(manifest[0]["Config"]).read()
        layer_bytes = tar.extractfile(manifest[0]["Layers"][0]).read()
    assert image_id == "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    config = json.loads(config_bytes)
    assert config["config"]["Entrypoint"] == ["/bin/pause"]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer_bytes).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer_bytes)) as layer:
        assert layer.extractfile("bin/pause").read() == b"\x7fELF pretend"
