"""The flplatform command line (Typer + rich)."""
