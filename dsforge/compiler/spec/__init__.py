"""The schema language (typed sections with their checks and docs) and the job's typed spec declared in it."""
