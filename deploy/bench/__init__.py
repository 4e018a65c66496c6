"""Benchmarks of the served system (`moectl bench serving | pd`, bench/*.py): imported by
`deploy.serve_cli` and bench/ scripts only, never by the serving path."""
