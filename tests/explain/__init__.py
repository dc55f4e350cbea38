"""Explain's labels, pictures and HTML report."""
