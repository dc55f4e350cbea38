"""The layout search: the `auto` fields of a job resolved by ranking every legal layout with the cost
model."""
