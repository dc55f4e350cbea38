"""The emitted job directory: ds_config.json, launchers, interpreter."""
