"""Internal package (_runtime); see README.md, "Architecture"."""
