"""Integrations with existing trainers, and the extension points other packages plug into.

Trainer integrations (they import torch and the trainer; import them explicitly):

* ``dsforge.plugins.hf``         HF Transformers Trainer: TrainingArguments keywords and a checking callback
* ``dsforge.plugins.lightning``  Lightning: a DeepSpeedStrategy and the Trainer arguments that go with it
* ``dsforge.plugins.accelerate`` Accelerate: a DeepSpeedPlugin and an Accelerator; `dsforge compile` writes
  the `accelerate launch` config for ``launch.launcher: accelerate``

Extension points (torch-free; ``registry`` reads Python entry points lazily): presets, rules,
rewrite policies and launch targets. This package imports nothing at import time.
"""
