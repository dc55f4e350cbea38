"""What DeepSpeed accepts and writes: its config schema, its key names, and the settings estimate and emit
share."""
