"""DeepSpeed's config schema and the settings estimate and emit share."""
