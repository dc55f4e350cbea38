"""Emit: turn a validated plan into a runnable job directory (ds_config.json, plan.json, launchers, train.py).

Pure Python plus jinja2: nothing here imports torch or deepspeed, so `dsforge compile` runs where
neither is installed. The DeepSpeed behaviour the output relies on is cited where it is used.
"""
