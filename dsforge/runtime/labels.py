"""Label conventions shared by the data sources and the loss (a module of its own: the datasets package and
runtime.data both read it, and neither may import the other back)."""

#: Target id the loss skips (torch's and HF's convention).
IGNORE_INDEX = -100
