"""Runtime tests: process groups and parallel building blocks against single-process dense references."""
