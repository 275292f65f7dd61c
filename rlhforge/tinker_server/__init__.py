"""``rlhforge serve-tinker``: a local server for Thinking Machines' ``tinker`` SDK (docs/tinker.md).

Layout: :mod:`.app` (routes), :mod:`.state` (sessions, models, futures, seq_id order, the worker thread),
:mod:`.training` (LoRA training over an rlhforge strategy), :mod:`.sampling` (the HF engine),
:mod:`.codec` (the SDK's protobuf wire), :mod:`.schemas` (its JSON bodies).
"""
