"""PrefixHash's routing key, computed by the router script in NGINX's own JavaScript runtime (njs): a test
location answers with `routingKey(body, 40)`, imported from the script the operator ships."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from e2e.loopback import wait_http
from pagekube.operator.nginx import NJS_MODULE, SCRIPT_KEY, prefix_route_script
from tests.server_process import free_port

pytestmark = pytest.mark.skipif(not (shutil.which("nginx") and Path(NJS_MODULE).exists()),
                                reason="nginx and its njs module (Debian packages) are installed by scripts/test-deps.sh")

KEY_OF = """import router from 'prefix_route.js';
function key(r) { r.return(200, router.routingKey(r.requestText, 40)); }
export default {key};
"""


@pytest.fixture(scope="module")
def key_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("njs")
    (d / SCRIPT_KEY).write_text(prefix_route_script())
    (d / "key_of.js").write_text(KEY_OF)
    port = free_port()
    (d / "nginx.conf").write_text(f"""load_module {NJS_MODULE};
pid nginx.pid;
error_log stderr warn;
events {{}}
http {{
    access_log off;
    client_body_temp_path client_body;
    js_path "{d}";
    js_import test from key_of.js;
    server {{
        listen 127.0.0.1:{port};
        client_body_buffer_size 1m;
        location = /nginx-health {{ return 200; }}
        location / {{ js_content test.key; }}
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-p", str(d), "-e", "stderr", "-c", str(d / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/nginx-health")
        yield lambda body: httpx.post(f"http://127.0.0.1:{port}/",
                                      content=body if isinstance(body, bytes) else json.dumps(body)).text
    finally:
        proc.terminate()
        proc.wait(20)


SYSTEM = {"role": "system", "content": "You answer questions about the handbook of tenant seven."}


def test_a_conversation_keeps_its_prefix_key_from_turn_to_turn(key_server):
    first = key_server({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]})
    later = key_server({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello"},
                                                   {"role": "user", "content": "Where is my order?"}]})
    assert first == later == "m\n" + SYSTEM["content"][:40]
    parts = key_server({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM["content"]}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert parts == first  # content parts read as their text


def test_the_model_or_adapter_and_the_prompt_start_make_the_prefix_key(key_server):
    base = key_server({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]})
    adapter = key_server({"model": "sql", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]})
    assert adapter == "sql" + base[1:]
    short = key_server({"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": "Tell me about tenant seven"}]})
    assert short == "m\nBe brief.\nTell me about tenant seven"
    assert key_server({"model": "m", "prompt": "Once upon a time " * 5}) == "m\n" + ("Once upon a time " * 5)[:40]
    assert key_server({"model": "m", "prompt": ["first prompt", "second"]}) == "m\nfirst prompt"
    assert key_server({"model": "m", "prompt": [1, 2, 3]}) == "m\n[1,2,3]"
    assert key_server({"model": "e", "input": "embed this"}) == "e\nembed this"


@pytest.mark.parametrize("body", [b"{not json", b"null", b"[1, 2]", b"", {"prompt": "no model"},
                                  {"model": 7, "prompt": "x"}, {"model": "m"}, {"model": "m", "prompt": ""},
                                  {"model": "m", "messages": ["not an object"]}, {"model": "m", "messages": []}])
def test_a_body_without_a_prefix_key_gets_none(key_server, body):
    assert key_server(body) == ""  # the router then sends it to least connections
