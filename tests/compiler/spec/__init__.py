"""The schema language and the job spec."""
