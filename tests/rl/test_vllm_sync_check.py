"""The always-on sync check on a real vLLM engine (CPU build, in-process): every load reports the
fingerprint of what arrived (equal to the sender's) and whether the engine's parameters changed; a
loader that silently keeps the old weights is caught on the next sync."""

import pytest

pytestmark = pytest.mark.usefixtures("vllm")


def test_vllm_engine_reports_each_sync_and_a_silent_non_load_stops(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.fingerprint import WeightSyncMismatch, check_engine_sync, state_fingerprint
    from rlhforge.rollout.vllm_engine import VLLMEngine
    from rlhforge.rollout.vllm_worker import WeightSyncExtension

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = VLLMEngine(str(tiny_model_dir), max_model_len=32)
    try:
        assert engine.sync_reports() == [("vLLM engine", [None])]  # never synced: the folder's weights
        same = dict(model.state_dict())
        engine.update_weights(same)  # the first sync of a run: the weights it started with
        [(_, [rep])] = engine.sync_reports()
        assert rep["fingerprint"] == state_fingerprint(same) and rep["tensors"] == len(same)
        assert rep["previous"] is None
        check_engine_sync(engine, state_fingerprint(same), 0)

        new = {k: v + 0.01 for k, v in model.state_dict().items()}
        engine.update_weights(new)
        [(_, [rep])] = engine.sync_reports()
        assert rep["params_changed"] and rep["previous"] == state_fingerprint(same)
        check_engine_sync(engine, state_fingerprint(new), 1)
        with pytest.raises(WeightSyncMismatch, match="vLLM engine received weights with fingerprint"):
            check_engine_sync(engine, state_fingerprint(same), 1)  # not what the engine holds

        def reads_but_loads_nothing(self, named):
            for _ in named:
                pass

        monkeypatch.setattr(WeightSyncExtension, "_rlhforge_reload", reads_but_loads_nothing)
        newer = {k: v + 0.02 for k, v in model.state_dict().items()}
        engine.update_weights(newer)
        with pytest.raises(WeightSyncMismatch, match="received new weights .* but its parameters did not change"):
            check_engine_sync(engine, state_fingerprint(newer), 2)
    finally:
        engine.close()
