"""Developer tools shipped with the package (code generation)."""
