"""The plan: degrees, placement, bubble, resume layout."""
