"""The front end: loading, extends, presets, paths, pretrained configs."""
