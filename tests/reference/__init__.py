"""Independent reference implementations of outside systems, used only by differential tests."""
