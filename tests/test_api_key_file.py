"""--api-key-file: the keys a server accepts come from a file, one per line, re-read when it changes (a mounted
Kubernetes Secret rotates without a restart), through a real `pagekube serve` and the official openai client."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server_process import ServerProcess


def write_atomically(path, text: str) -> None:
    """As the kubelet updates a mounted Secret: a new file swapped in, never a partial write."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("api-key") / "api-key"
    path.write_text("old-key\n")
    return path


@pytest.fixture(scope="module")
def server(tiny_dir, key_file):
    srv = ServerProcess(str(tiny_dir), "--served-model-name", "tiny", "--api-key-file", str(key_file))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def status_with(server, key: str | None) -> int:
    """The status of a completion with `key` (None: no Authorization header at all)."""
    if key is None:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code != 401 or r.json()["error"]["code"] == "invalid_api_key", r.text
        return r.status_code
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        return 200
    except openai.APIStatusError as e:
        if e.status_code == 401:
            assert e.body["code"] == "invalid_api_key" and e.body["type"] == "authentication_error", e.body
        return e.status_code


def wait_status(server, key: str | None, status: int) -> None:
    deadline = time.monotonic() + 10
    while status_with(server, key) != status:
        assert time.monotonic() < deadline, f"key {key!r} did not get {status} within 10 s of the file's change"
        time.sleep(0.3)


def test_a_rotated_key_file_takes_effect_without_a_restart(server, key_file):
    write_atomically(key_file, "old-key\n")  # as the fixture wrote it, whatever ran before
    wait_status(server, "old-key", 200)
    assert status_with(server, None) == 401 and status_with(server, "new-key") == 401
    pid = server.proc.pid

    write_atomically(key_file, "old-key\nnew-key\n")  # both while clients move over
    wait_status(server, "new-key", 200)
    assert status_with(server, "old-key") == 200

    write_atomically(key_file, "# rotated\nnew-key\n")  # then the old one goes
    wait_status(server, "old-key", 401)
    assert status_with(server, "new-key") == 200
    assert server.proc.pid == pid and server.proc.poll() is None  # no restart
    assert "API keys re-read" in server.log()


def test_an_empty_key_file_keeps_the_keys_read_before(server, key_file):
    write_atomically(key_file, "new-key\n")
    wait_status(server, "new-key", 200)
    write_atomically(key_file, "\n")  # a broken write must not lock everyone out
    time.sleep(2.5)
    assert status_with(server, "new-key") == 200 and status_with(server, None) == 401
    assert "keeping the keys read before" in server.log()
    write_atomically(key_file, "new-key\n")


def test_a_missing_key_file_stops_the_start_with_the_reason(tiny_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "pagekube.engine.server", str(tiny_dir), "--api-key-file",
                        str(tmp_path / "absent")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key-file" in r.stderr and "absent" in r.stderr, r.stderr
    (tmp_path / "empty").write_text("\n# none\n")
    r = subprocess.run([sys.executable, "-m", "pagekube.engine.server", str(tiny_dir), "--api-key-file",
                        str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no key in the file" in r.stderr, r.stderr
