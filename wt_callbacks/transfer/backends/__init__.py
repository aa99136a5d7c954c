"""One module or package per backend; each holds its trainer engine and its worker engine."""
