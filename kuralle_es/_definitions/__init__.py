"""Internal package (_definitions); see README.md, "Architecture"."""
