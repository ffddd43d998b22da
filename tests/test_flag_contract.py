"""One flag contract between the operator and the engine: the checked-in schema is the engine's, the CRD takes its
defaults from it, every rendered command line parses with the engine's real parser, and the engine refuses at
startup what its attention backend cannot run."""

from __future__ import annotations

import pytest
import torch
import yaml

from pagekube.engine.cli import build_parser, config_from_args
from pagekube.engine.config import EngineConfig
from pagekube.engine.flags import flag_schema_json
from pagekube.engine.model.attention import make_backend
from pagekube.operator import engine_flags
from pagekube.operator.engine_deployment import engine_args
from pagekube.operator.spec import EngineSpec, LLMDeploymentSpec
from tests.k8s_tools import EXAMPLES, REPO
from tests.server_process import ServerProcess


def test_checked_in_flag_schema_is_the_generated_one():
    assert (REPO / "operator/engine_flags.json").read_text() == flag_schema_json(), \
        "regenerate: python -m pagekube.engine.flags > operator/engine_flags.json"


def test_crd_engine_defaults_are_the_engine_defaults():
    spec = EngineSpec()
    engine = EngineConfig()
    for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "block_size",
                 "enable_prefix_caching"):
        assert getattr(spec, name) == getattr(engine, name), name
    assert set(engine_flags.BLOCK_SIZES) <= set(engine_flags.choices("block_size"))
    assert 8 not in engine_flags.BLOCK_SIZES  # the Triton kernels cannot run it


def llmd_specs():
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "LLMDeployment":
                yield pytest.param(doc["spec"], id=f"{path.stem}/{doc['metadata']['name']}")
    yield pytest.param({"model": {"name": "m", "source": "pvc://c/p", "dtype": "bfloat16", "maxModelLen": 4096},
                        "resources": {"gpu": 0}, "engine": {"enablePrefixCaching": False, "blockSize": 32}},
                       id="cpu-all-fields")


@pytest.mark.parametrize("raw", llmd_specs())
def test_every_rendered_engine_command_line_parses_with_the_engine_parser(raw):
    spec = LLMDeploymentSpec.model_validate(raw)
    config = config_from_args(build_parser().parse_args(["serve", *engine_args(spec)]))
    assert config.served_model_name == spec.model.name
    assert config.block_size == spec.engine.block_size
    assert config.enable_prefix_caching == spec.engine.enable_prefix_caching
    assert config.max_num_seqs == spec.engine.max_num_seqs
    assert config.drain_timeout == spec.drain.timeout_seconds
    assert (config.device == "cpu") == (spec.resources.gpu == 0)


def test_a_flag_the_engine_lacks_is_an_error_not_a_silent_arg():
    with pytest.raises(KeyError, match="no flag"):
        engine_flags.to_args({"model": "/m", "tensor_parallel_sizes": 2})


def test_the_triton_backend_refuses_block_size_8():
    with pytest.raises(ValueError, match="block-size 8.*at least 16"):
        make_backend("triton", torch.device("cpu"), 8, torch.bfloat16)
    assert make_backend("torch", torch.device("cpu"), 8, torch.bfloat16).name == "torch"


def test_serve_exits_with_the_reason_when_the_backend_cannot_run_the_flags(tiny_dir):
    srv = ServerProcess(str(tiny_dir), "--attention-backend", "triton", "--block-size", "8")
    try:
        assert srv.proc.wait(120) == 1
        assert "cannot run --block-size 8" in srv.log()
    finally:
        srv.stop()


def test_the_flag_table_in_the_docs_is_generated_from_engine_config():
    from pagekube.engine.flags import with_table

    doc = (REPO / "docs/operations.md").read_text()
    assert doc == with_table(doc), "regenerate: python -m pagekube.engine.flags --markdown"


VLLM_LINE = ["--swap-space", "16", "--enable-chunked-prefill", "--enforce-eager", "--distributed-executor-backend",
             "ray", "--disable-log-requests", "-tp", "1", "-pp", "1", "--cuda-graph-sizes", "1", "2", "4"]


def test_a_vllm_command_line_starts_the_server_and_says_which_flags_mean_nothing(tiny_dir):
    srv = ServerProcess(str(tiny_dir), "--dtype", "float32", *VLLM_LINE)
    try:
        srv.wait_ready()
        log = srv.log()
        assert "--swap-space 16 is accepted and unused" in log
        assert "--distributed-executor-backend ray is accepted" in log
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, says", [
    (["--no-enable-chunked-prefill"], "always chunks long prompts"),
    (["-pp", "3", "--nnodes", "2"], "--nnodes 2 does not divide the 3 ranks"),
    (["--headless"], "--headless runs a node other than the leader"),
    (["-q", "gguf", "/models/llama"], "--quantization gguf needs a .gguf model file"),
])
def test_values_the_engine_cannot_honour_are_refused_with_the_reason(flags, says, capsys):
    from pagekube.engine.cli import main

    assert main(["serve", *flags]) == 2
    assert says in capsys.readouterr().err
