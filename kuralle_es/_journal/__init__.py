"""Internal package (_journal); see README.md, "Architecture"."""
