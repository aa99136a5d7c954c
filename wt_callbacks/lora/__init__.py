"""LoRA / PEFT models: sent merged into the base weights, or as an adapter vLLM serves.

A PEFT model (``get_peft_model``, ``inject_adapter_in_model``, transformers'
``add_adapter``, TRL's ``peft_config``) is found in the module the adapters
sync, never configured (``layout``). The section's ``lora`` key picks what
crosses the wire:

* ``merge`` (the default): the base checkpoint's tensors, each LoRA-targeted
  one merged with its factors on the fly by PEFT's own rule (``merge``), in
  float32 before the cast to the wire dtype, without touching the trainer's
  model; the server serves a plain checkpoint.
* ``adapter``: only the adapter's tensors, which the server writes where vLLM
  reads adapters and loads under the section's ``lora_name``
  (``adapter``: the trainer's side; ``saved``: the names and config PEFT
  saves; ``files``: the on-disk versions both server sides share; ``apply``:
  an adapter applied to a model, for the reference receiver).

PEFT is imported only when the process already did (a module that is not a
PEFT model never makes this package import it).
"""
