"""`dsforge explain`: the estimates of a job as text tables, JSON, pictures and one HTML page.

Everything here reads the JSON-ready summary (`dsforge.compiler.estimate.summary`) plus the simulated
timeline, memory estimate and placement; matplotlib is imported only inside the plotting functions.
"""
