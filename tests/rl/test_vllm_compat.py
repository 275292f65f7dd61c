"""The start-up check of the vLLM version and of the signatures the weight sync calls by keyword
(rlhforge.rollout.vllm_compat.check_vllm_api): the installed vLLM passes, other versions and objects
without a parameter are refused naming the version or the parameter, and a VLLMEngine runs it."""

import inspect

import pytest

from rlhforge.rollout.vllm_compat import REQUIRED_PARAMS, SUPPORTED_VLLM, check_vllm_api, parse_version

pytestmark = pytest.mark.usefixtures("vllm")


def test_the_installed_vllm_passes():
    import vllm

    from rlhforge.rollout.vllm_compat import vllm_api_signatures

    signatures = vllm_api_signatures()
    assert set(signatures) | {"model_runner.reload_weights", "model.load_weights"} == set(REQUIRED_PARAMS)
    check_vllm_api(vllm.__version__, signatures, allow_other_version=False)
    assert any(lo <= parse_version(vllm.__version__)[:2] < hi for lo, hi in SUPPORTED_VLLM)


def test_the_worker_side_of_a_real_engine_passes(tiny_model_dir):
    import vllm

    from rlhforge.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), max_model_len=32)  # runs both checks at start-up
    try:
        sigs = engine.llm.collective_rpc("rlhforge_api_signatures")[0]
        assert "weights_iterator" in sigs["model_runner.reload_weights"]["params"]
        assert "weights" in sigs["model.load_weights"]["params"]
        assert sigs["model_runner.reload_weights"]["var_keyword"] is False  # 0.32's runners name every parameter
        check_vllm_api(vllm.__version__, sigs, allow_other_version=False)
    finally:
        engine.close()


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.9.2", "0.25.1", "0.27.1"])
def test_other_versions_are_refused_with_the_supported_range(version):
    with pytest.raises(RuntimeError) as err:
        check_vllm_api(version, {}, allow_other_version=False)
    assert f"vLLM {version} is not supported" in str(err.value) and "vLLM 0.26.x or 0.32.x" in str(err.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3+cpu", "0.32.1rc1", "v0.32.0.dev4+g1234", "0.26.0",
                                     "0.26.1+cu130"])
def test_supported_version_strings(version):
    check_vllm_api(version, {}, allow_other_version=False)


def test_an_unreadable_version_is_refused():
    with pytest.raises(RuntimeError, match="cannot read a vLLM version from 'dev'"):
        check_vllm_api("dev", {}, allow_other_version=False)


def test_the_escape_hatch_lets_a_version_through_but_not_a_signature(monkeypatch):
    monkeypatch.setenv("RLHFORGE_ALLOW_VLLM_VERSION", "1")
    check_vllm_api("0.40.0", {})

    def reload_weights(self, weights_path=None):  # a future vLLM without weights_iterator=
        pass

    with pytest.raises(RuntimeError) as err:
        check_vllm_api("0.40.0", {"model_runner.reload_weights": reload_weights})
    assert "model_runner.reload_weights has no parameter 'weights_iterator'" in str(err.value)
    assert "vLLM 0.40.0" in str(err.value)


def test_a_missing_parameter_or_method_is_named():
    class FakeLLM:
        def collective_rpc(self, method, args=()):  # no timeout
            pass

        def wake_up(self):  # no tags
            pass

    with pytest.raises(RuntimeError, match=r"LLM.collective_rpc has no parameter 'timeout'"):
        check_vllm_api("0.32.0", {"LLM.collective_rpc": FakeLLM.collective_rpc}, allow_other_version=False)
    with pytest.raises(RuntimeError, match=r"LLM.wake_up has no parameter 'tags'"):
        check_vllm_api("0.32.0", {"LLM.wake_up": inspect.signature(FakeLLM.wake_up)}, allow_other_version=False)
    with pytest.raises(RuntimeError, match=r"LLMEngine.reset_encoder_cache does not exist"):
        check_vllm_api("0.32.0", {"LLMEngine.reset_encoder_cache": None}, allow_other_version=False)
    with pytest.raises(RuntimeError, match=r"model.load_weights has no parameter 'weights'"):
        check_vllm_api("0.32.0", {"model.load_weights": ["self", "state_dict"]}, allow_other_version=False)


def test_a_worker_method_that_takes_kwargs_passes_and_one_without_the_parameter_does_not():
    """vLLM 0.26's V2 model runner (the default for dense models on CUDA) is ``reload_weights(self, *args,
    **kwargs)``: the worker reports its **kwargs, and the check accepts it; names alone without the parameter
    are still refused."""
    v2_026 = {"params": ["args", "kwargs"], "var_keyword": True}
    check_vllm_api("0.26.0", {"model_runner.reload_weights": v2_026}, allow_other_version=False)
    with pytest.raises(RuntimeError, match="model_runner.reload_weights has no parameter 'weights_iterator'"):
        check_vllm_api("0.26.0", {"model_runner.reload_weights": {"params": ["args", "kwargs"], "var_keyword": False}},
                       allow_other_version=False)


def test_the_version_seam():
    """Routing replay: 0.26's V1 runner records routed experts (V2 refuses), 0.32's V2 runner does and needs
    prefix caching; a wake on 0.26 empties torch's cache first (0.32's allocator does it itself)."""
    from rlhforge.rollout.vllm_compat import vllm_features
    from rlhforge.rollout.vllm_engine import routing_replay_settings

    old, new = vllm_features("0.26.0"), vllm_features("0.32.0+cpu")
    assert (old.routing_runner, old.routing_needs_prefix_caching, old.wake_empties_torch_cache) == ("v1", False, False)
    assert (new.routing_runner, new.routing_needs_prefix_caching, new.wake_empties_torch_cache) == ("v2", True, True)
    assert routing_replay_settings(old) == ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"enable_return_routed_experts": True})
    assert routing_replay_settings(new) == ({"VLLM_USE_V2_MODEL_RUNNER": "1"},
                                            {"enable_return_routed_experts": True, "enable_prefix_caching": True})
