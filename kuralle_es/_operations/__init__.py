"""Internal package (_operations); see README.md, "Architecture"."""
