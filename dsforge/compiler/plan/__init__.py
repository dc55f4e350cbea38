"""The plan: degrees, batch split and rank placement of a job, its pipeline bubble and its resume layout."""
